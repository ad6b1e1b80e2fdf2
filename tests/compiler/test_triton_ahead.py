"""Building our ops' Triton kernels ahead (``k3compile/triton_ahead.py``), on the CPU: Triton's driver is a stand-in
that names an H200 target (no GPU), so a launch inside ``capturing`` is recorded and a worker's ``build`` compiles it
for sm_90 into Triton's disk cache; the launch that follows then finds it there (compiles nothing). The GPU run of
``benchmarks/compile_time.py`` covers the ops' own launchers."""
from __future__ import annotations

import json

import pytest
import torch

from k3compile import kernel_cache, triton_ahead, workers

triton = pytest.importorskip("triton")
tl = triton.language


def _copy(x, y, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y + i, tl.load(x + i, mask=i < n), mask=i < n)


# a compiled kernel even where the suite runs Triton's interpreter (TRITON_INTERPRET=1 makes @triton.jit interpret)
_copy = triton.runtime.jit.JITFunction(_copy)


class _H200Driver:
    """What Triton's launch path asks of its driver before it compiles, for a GPU this host does not have."""

    def __init__(self):
        from triton.backends.compiler import GPUTarget
        self.target = GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target

    def get_active_torch_device(self):
        return torch.device("cpu")

    def is_active(self):
        return True


@pytest.fixture
def h200(monkeypatch, tmp_path):
    from triton.runtime.driver import driver

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(driver, "_active", _H200Driver())   # restored after (reset_active would look for a GPU)
    _copy.device_caches.clear()
    yield tmp_path
    _copy.device_caches.clear()


def _entries(folder) -> set:
    return {p.name for p in folder.iterdir()}


def _without_target(serialize):
    """Triton 3.6's specialisation data (the H200 image's): no target in it."""
    def serialize_36(*args, **kwargs):
        obj = json.loads(serialize(*args, **kwargs))
        obj.pop("target", None)
        return json.dumps(obj)
    return serialize_36


@pytest.mark.parametrize("target_in_data", [True, False], ids=["triton-3.7", "triton-3.6"])
def test_a_dry_launch_is_a_compile_request_whose_build_the_launch_then_finds(h200, monkeypatch, target_in_data):
    """Captured with the launch's own specialisation, built by a worker whose environment names another cache folder
    (Inductor may set Triton's after the workers started), found by the launch. Where Triton's specialisation data
    has no target (3.6), the request takes the launching device's."""
    import triton.runtime.jit as jit

    if not target_in_data:
        monkeypatch.setattr(jit, "serialize_specialization_data", _without_target(jit.serialize_specialization_data))
    x = triton_ahead.DryTensor((1000,), (1,), torch.bfloat16, torch.device("cpu"))
    y = triton_ahead.DryTensor((1000,), (1,), torch.bfloat16, torch.device("cpu"), offset=3)[1:]   # 8 bytes in
    requests = []
    with triton_ahead.capturing(requests):
        assert _copy[(8,)](x, y, 1000, BLOCK=128) is None   # nothing compiled, nothing launched
    ((module, name, spec, cache),) = requests
    assert (module, name, cache) == (__name__, "_copy", str(h200)) and not _entries(h200)
    data = json.loads(spec)
    attrs = dict(zip(map(tuple, data["attrs_keys"]), data["attrs_vals"]))
    assert attrs[(0,)] == [["tt.divisibility", 16]] and attrs[(1,)] == attrs[(2,)] == []   # x aligned; y at 8 bytes
    assert data["target"] == {"backend": "cuda", "arch": 90, "warp_size": 32}
    # a worker compiles it (a fresh process: no interpreter patches), into the folder the request names
    pool = workers.WorkerPool(1, {"TRITON_CACHE_DIR": str(h200 / "elsewhere")}, timeout=600)
    try:
        ok, detail, _ = pool.submit(triton_ahead.build, module, name, spec, cache).result(timeout=300)
    finally:
        pool.shutdown()
    assert ok, detail
    built = _entries(h200)
    assert built
    _copy.warmup(x, y, 1000, BLOCK=128, grid=(8,))   # the first call's compile: a hit
    assert _entries(h200) == built


def test_dry_tensors_follow_views_and_refuse_data():
    a = triton_ahead.DryTensor((4, 64), (64, 1), torch.bfloat16, torch.device("cpu"), offset=8)
    v = a[:, 8:].t()
    assert isinstance(v, triton_ahead.DryTensor) and v.shape == (56, 4) and v.stride() == (1, 64)
    assert v.data_ptr() == (8 + 8) * 2
    s = (a.float() * 2).sum(-1)
    assert isinstance(s, triton_ahead.DryTensor) and s.shape == (4,) and s.dtype == torch.float32
    with pytest.raises(Exception):
        a.sum().item()   # a value: the dry call stops there (its kernels are left to the first call)


def test_a_k3_op_called_inside_another_runs_its_implementation_dry(monkeypatch):
    """``k3::experts_beside`` calls ``k3::moe_experts`` (and ``k3::route_beside`` ``k3::moe_route``, ...) through the
    dispatcher: on DryTensors that call reaches ``DryTensor.__torch_dispatch__``, which must run the op's
    implementation (its Triton launches are requests) rather than its meta kernel (which launches nothing)."""
    from torch._library.custom_ops import OPDEFS

    import k3compile.ops.skinny_gemm  # noqa: F401 - registers k3::skinny_gemm

    calls = []

    def impl(a, w, bias=None, residual=None, backend="auto", m_limit=16, *rest):
        calls.append((type(a), type(w), backend, m_limit))
        return a.new_empty((a.shape[0], w.shape[0]))

    monkeypatch.setattr(OPDEFS["k3::skinny_gemm"], "_init_fn", impl)
    a = triton_ahead.DryTensor((2, 64), (64, 1), torch.bfloat16, torch.device("cpu"))
    w = triton_ahead.DryTensor((32, 64), (64, 1), torch.bfloat16, torch.device("cpu"))
    out = torch.ops.k3.skinny_gemm(a, w, None, None, "triton", 8, False, None, True)
    assert calls == [(triton_ahead.DryTensor, triton_ahead.DryTensor, "triton", 8)]
    assert isinstance(out, triton_ahead.DryTensor) and out.shape == (2, 32)
    assert triton_ahead._launching_k3_op(torch.ops.aten.mm.default) is None


def test_no_kernel_is_loaded_during_a_dry_run():
    """A dry call asking for a kernel gets one that does nothing: nothing loaded, built or run."""
    with kernel_cache.dry_running():
        assert kernel_cache.get("cute", ("any",))("a", "b") is None
    assert ("cute", ("any",)) not in kernel_cache._kernels


def test_on_unless_turned_off(monkeypatch):
    hook = hasattr(triton.knobs.runtime, "jit_cache_hook")
    monkeypatch.delenv(triton_ahead.ENV, raising=False)
    assert triton_ahead.enabled() == hook
    monkeypatch.setenv(triton_ahead.ENV, "1")
    assert triton_ahead.enabled() == hook
    monkeypatch.setenv(triton_ahead.ENV, "0")
    assert not triton_ahead.enabled()


def test_the_launcher_is_built_through_the_targets_driver_without_an_active_one(monkeypatch):
    """A worker sees no GPU: no active driver. ``build`` makes the kernel's launcher (a C module a signature on Triton
    3.6, which the first call would otherwise compile) through the driver of the target's backend; a driver that
    cannot start there leaves the launcher to the first call, without an error (the kernel is built)."""
    import dataclasses
    import sys
    import types

    from triton.backends import backends
    from triton.backends.compiler import GPUTarget

    def no_gpu():
        raise RuntimeError("0 active drivers")

    driver_module = sys.modules["triton.runtime.driver"]   # the package's name `driver` is the module's object
    monkeypatch.setattr(driver_module.driver, "_active", None)
    monkeypatch.setattr(driver_module.driver, "_default", None)
    monkeypatch.setattr(driver_module, "_create_driver", no_gpu)
    built = []

    class Driver:   # the target's backend driver: starts without a GPU
        def __init__(self):
            self.launcher_cls = lambda src, metadata: built.append((src, metadata))

    class BrokenDriver:
        def __init__(self):
            raise RuntimeError("libcuda.so cannot be found")

    target = GPUTarget("cuda", 90, 32)
    (nvidia,) = [n for n, b in backends.items() if b.compiler.supports_target(target)]
    kernel = types.SimpleNamespace(src="the kernel's source", metadata="its metadata")
    monkeypatch.setitem(backends, nvidia, dataclasses.replace(backends[nvidia], driver=Driver))
    triton_ahead._build_launcher(kernel, target)
    assert built == [("the kernel's source", "its metadata")]
    monkeypatch.setitem(backends, nvidia, dataclasses.replace(backends[nvidia], driver=BrokenDriver))
    triton_ahead._build_launcher(kernel, target)
    assert len(built) == 1


def _attn_res_site(sources: int, width: int) -> dict:
    """The call site of ``k3::attn_res`` over ``sources`` bf16 rows of ``width`` (Triton asked for) that our pass
    leaves in the mix's graph."""
    from k3compile.call_sites import call_sites
    from k3compile.passes import K3Options, K3PostGradPass
    from k3compile.patterns._common import fake_mode, trace_fn
    from k3compile.patterns.attn_res import _mix_norm, search

    with fake_mode():
        t = [torch.empty(1, 1, width, dtype=torch.bfloat16) for _ in range(sources)]
        w = [torch.empty(1, width, dtype=torch.bfloat16), torch.empty(width, dtype=torch.bfloat16)]
        graph = trace_fn(search(_mix_norm, sources),
                         t + w + [1e-6, torch.empty(width, dtype=torch.bfloat16), 1e-6]).graph
    K3PostGradPass(K3Options(backend="triton", passes=("attn_res",)))(graph)
    (site,) = call_sites(graph, ops=triton_ahead.OPS)
    return site


_ATTN_RES_AHEAD = r"""
import json, os, sys, tempfile
import torch
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction
from k3compile import triton_ahead


class H200:   # as the module's _H200Driver: what Triton's launch path asks before it compiles
    target = GPUTarget("cuda", 90, 32)
    def get_current_device(self): return 0
    def get_current_stream(self, device=None): return 0
    def get_current_target(self): return self.target
    def get_active_torch_device(self): return torch.device("cpu")
    def is_active(self): return True


knobs.cache.dir = os.environ["TRITON_CACHE_DIR"] = cache = tempfile.mkdtemp()
driver._active = H200()
from k3compile.ops.attn_res.triton import attn_res_triton

site = json.loads(sys.argv[1])["site"]
args = {k: triton_ahead._dry(v) for k, v in site["args"].items()}
call = [args[k] for k in ("sources", "proj_weight", "mix_norm_weight", "eps", "norm_weight", "norm_eps")]
requests = []
with triton_ahead.capturing(requests):
    attn_res_triton(*call)
(request,) = requests
triton_ahead.build(*request)
built = set(os.listdir(cache))
run = JITFunction.run   # the launch itself, compiling (or finding) its kernel without running it
JITFunction.run = lambda self, *a, grid, warmup, **k: run(self, *a, grid=grid, warmup=True, **k)
attn_res_triton(*call)
print(json.dumps(dict(sources=len(json.loads(request[2])["signature"]["sources"]), built=len(built),
                      hit=set(os.listdir(cache)) == built)))
"""


def test_a_tensor_list_argument_is_planned_dry_launched_built_and_found():
    """``k3::attn_res`` takes its sources as a Tensor[]: its call site lists each, the dry launch captures the kernel's
    tuple of pointers, a build compiles it and the launch then finds it (a fresh process: no interpreter)."""
    from k3compile.testing import ptx_in_a_fresh_process

    site = _attn_res_site(3, 7168)
    assert "unplanned" not in site and len(site["args"]["sources"]) == 3
    assert site["args"]["sources"][0] == {"shape": [1, 1, 7168], "stride": [7168, 7168, 1], "offset": 0,
                                          "dtype": "bfloat16", "device": "cpu"}
    out = ptx_in_a_fresh_process(_ATTN_RES_AHEAD, {"site": site})
    assert out == {"sources": 3, "built": 1, "hit": True}


_DRY_RUN_SITE = r"""
import json, sys
import k3compile.ops.attn_res  # noqa: F401 - registers k3::attn_res, as the compiled graph's process has
from k3compile import triton_ahead
from k3compile.backends import REGISTRY

site = json.loads(sys.argv[1])["site"]
before = {name: dict(impls._choices) for name, impls in REGISTRY.items()}
requests, skipped = triton_ahead.dry_run([site])
after = {name: dict(impls._choices) for name, impls in REGISTRY.items()}
print(json.dumps(dict(requests=len(requests), skipped=list(skipped), restored=before == after)))
"""


def test_dry_run_follows_a_site_through_the_op_and_restores_the_choices():
    """``dry_run`` calls the op of each site (here ``k3::attn_res`` asked for Triton on CPU tensors, which a process
    without Triton's interpreter cannot run: the call is left to its first call, with the op's reason) and puts
    every op's choice tables back as they were. The requests a GPU site makes: ``benchmarks/compile_time.py``'s
    ``optimize-whole`` (its JSON's ``ahead.unplanned`` lists what was not followed)."""
    from k3compile.testing import ptx_in_a_fresh_process

    out = ptx_in_a_fresh_process(_DRY_RUN_SITE, {"site": _attn_res_site(2, 256)})
    assert out["requests"] == 0 and out["restored"]
    (why,) = out["skipped"]
    assert why.startswith("k3::attn_res: BackendUnavailableError") and "cannot run here" in why


def test_a_call_through_auto_functionalized_is_a_call_site():
    """An op that writes an input (``k3::kda_decode``'s state) is ``auto_functionalized`` in the graph our pass leaves
    (Inductor unwraps it after us): its call is listed with its arguments, as a direct call's are."""
    import k3compile.ops.kda_decode  # noqa: F401 - registers k3::kda_decode
    from k3compile.call_sites import call_sites

    op = torch.ops.k3.kda_decode.default
    graph = torch.fx.Graph()
    kwargs = {}
    with torch._subclasses.fake_tensor.FakeTensorMode():
        for i, arg in enumerate(op._schema.arguments):
            if isinstance(arg.type, torch.TensorType):
                node = graph.placeholder(arg.name)
                node.meta["val"] = torch.empty(2, 4 + i)
                kwargs[arg.name] = node
            elif arg.has_default_value():
                continue
            else:
                kwargs[arg.name] = {"float": 1e-6, "str": "triton", "bool": False, "int": 1}.get(str(arg.type))
    graph.call_function(torch.ops.higher_order.auto_functionalized, (op,), kwargs)
    (site,) = call_sites(graph, triton_ahead.OPS)
    assert site["op"] == "kda_decode" and list(site["args"]) == [a.name for a in op._schema.arguments]
    assert site["args"]["q"] == {"shape": [2, 4], "stride": [4, 1], "offset": 0, "dtype": "float32", "device": "cpu"}
