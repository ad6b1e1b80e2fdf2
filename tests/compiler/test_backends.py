"""Backend selection (k3compile/backends.py): fallbacks, forced backends and the profit check, on stand-in ops."""
import pytest
import torch

from k3compile.backends import BackendUnavailableError, Impl, OpImpls
from k3compile.kernel_module import KernelModule


def _ran(label):
    return lambda *args: label


def _op(cute_supports=None, cute_profitable=None, triton_available=None, triton_profitable=None, with_aten=True,
        aten_available=None):
    return OpImpls(
        "stand_in",
        reference=Impl(_ran("reference")),
        triton=Impl(_ran("triton"), available=lambda *a: triton_available,
                    profitable=lambda *a: triton_profitable),
        cute=Impl(_ran("cute"), supports=lambda *a: cute_supports, profitable=lambda *a: cute_profitable),
        aten=Impl(_ran("aten"), available=lambda *a: aten_available) if with_aten else None,
    )


def test_auto_prefers_cute():
    op = _op()
    assert op.select("auto", "k", torch.zeros(1))() == "cute"
    assert op.choices()[0].reason == "preferred"


def test_auto_yields_to_aten_where_no_kernel_is_profitable():
    op = _op(cute_profitable="cuBLAS measured faster", triton_profitable="cuBLAS faster too")
    assert op.select("auto", "k", torch.zeros(1))() == "aten"
    reason = op.choices()[0].reason
    assert op.choices()[0].impl == "aten" and "cuBLAS measured faster" in reason and "cuBLAS faster too" in reason


def test_an_unprofitable_kernel_yields_to_the_next_profitable_one():
    op = _op(cute_profitable="cuBLAS measured faster")
    assert op.select("auto", "k", torch.zeros(1))() == "triton"
    assert "cuBLAS measured faster" in op.choices()[0].reason


def test_unprofitable_kernel_then_unavailable_one_goes_to_aten_not_reference():
    op = _op(cute_profitable="cuBLAS measured faster", triton_available="no triton here")
    assert op.select("auto", "k", torch.zeros(1))() == "aten"


def test_a_fallback_that_cannot_run_here_leaves_the_unprofitable_kernel():
    op = _op(cute_profitable="the split path measured faster", triton_available="no triton",
             aten_available="the split path does not import")
    assert op.select("auto", "k", torch.zeros(1))() == "cute"
    assert "aten: the split path does not import" in op.choices()[0].reason


def test_a_kernel_module_that_does_not_import_is_a_recorded_fallback():
    """The dispatch files' pattern: ``available`` adds the kernel module's reason after the device checks."""
    missing = KernelModule("k3compile.ops.no_such_kernel", requires=lambda: None)
    op = OpImpls("stand_in_missing", reference=Impl(_ran("reference")),
                 triton=Impl(missing.no_such_fn, available=lambda *a: missing.reason(),
                             supports=missing.predicate("supports")))
    assert op.select("auto", "k", torch.zeros(1))() == "reference"
    assert "k3compile.ops.no_such_kernel does not import (ModuleNotFoundError" in op.choices()[0].reason
    with pytest.raises(BackendUnavailableError, match="does not import"):
        op.select("triton", "k", torch.zeros(1))
    assert missing.predicate("supports")(torch.zeros(1)) == missing.reason()
    with pytest.raises(BackendUnavailableError, match="does not import"):
        missing.no_such_fn()


def test_forced_backend_skips_the_profit_check():
    op = _op(cute_profitable="cuBLAS measured faster")
    assert op.select("cute", "k", torch.zeros(1))() == "cute"


def test_without_a_vendor_path_an_unprofitable_kernel_yields_to_the_next_kernel():
    op = _op(cute_profitable="the Triton kernel measured faster", with_aten=False)
    assert op.select("auto", "k", torch.zeros(1))() == "triton"
    assert "the Triton kernel measured faster" in op.choices()[0].reason


def test_without_a_vendor_path_an_unprofitable_kernel_still_beats_the_reference():
    op = _op(cute_profitable="the Triton kernel measured faster", triton_available="no triton", with_aten=False)
    assert op.select("auto", "k", torch.zeros(1))() == "cute"


def test_unsupported_shape_falls_back_and_records_why():
    op = _op(cute_supports="K not a multiple of 8")
    assert op.select("auto", "k", torch.zeros(1))() == "triton"
    assert "K not a multiple of 8" in op.choices()[0].reason


def test_forced_unavailable_backend_raises():
    op = _op(triton_available="tensor on cpu")
    with pytest.raises(BackendUnavailableError, match="tensor on cpu"):
        op.select("triton", "k", torch.zeros(1))


def test_reference_is_never_replaced():
    op = _op(cute_supports="no", cute_profitable="no", triton_available="no")
    assert op.select("reference", "k", torch.zeros(1))() == "reference"
    assert op.select("auto", "k2", torch.zeros(1))() == "reference"


def test_choice_is_cached_per_key():
    calls = []
    op = OpImpls("stand_in_cache", reference=Impl(_ran("reference"),
                                                   supports=lambda *a: calls.append(1)))
    for _ in range(3):
        op.select("auto", "same", torch.zeros(1))
    assert len(calls) == 1 and op.choices()[0].calls == 3
