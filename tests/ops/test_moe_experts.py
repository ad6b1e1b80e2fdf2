"""k3::moe_experts: the Triton kernels (decode and sorted forms, float and MXFP4 weights) and the op's dispatch,
against the reference; the reference against the model's own expert code.

On CPU the kernels run under TRITON_INTERPRET=1 (conftest). The interpreter (triton 3.7) truncates fp32 -> bf16
where a GPU rounds to nearest, and the experts round four times (gate, up, h, y), so bf16 errors here are a few
times the GPU's; the tolerances cover both. Shapes are small and examples few: interpreted programs are slow.
"""
from __future__ import annotations

import re

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import example, given, settings
from hypothesis import strategies as st

from k3compile.backends import BackendUnavailableError
from k3compile.model.loading import dequantize_mxfp4 as model_dequantize
from k3compile.model.moe import experts_dense, experts_gathered
from k3compile.ops.moe_experts import MOE_EXPERTS, moe_experts
from k3compile.ops.moe_experts import dispatch
from k3compile.ops.moe_experts.reference import dequantize_mxfp4, moe_experts_ref
from k3compile.ops.moe_experts.triton import MoeConfig, decode_form, moe_experts_triton
from k3compile.ops.moe_experts.triton_tiles import _mxfp4_tile
from k3compile.testing import moe_experts_inputs, rel_err

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TOL = {torch.float32: 2e-5, torch.bfloat16: 4e-2, torch.float16: 8e-3}
K3_BETAS = (4.0, 25.0)


def truth(args, betas=K3_BETAS):
    """The reference on the same inputs (it rounds where the model rounds: the kernels do too)."""
    return moe_experts_ref(*args, *betas)


def run_triton(args, betas=K3_BETAS, **kwargs):
    z = args[0]
    out = torch.full_like(z, float("nan"))
    moe_experts_triton(*args, *betas, out=out, **kwargs)
    return out


@pytest.fixture
def clean_records():
    MOE_EXPERTS.clear()
    yield
    MOE_EXPERTS.clear()


# ---------------------------------------------------------------------------------------------
# the kernels against the reference

@settings(max_examples=max(10, settings.default.max_examples // 3))
@given(m=st.integers(1, 5), a=st.integers(1, 3), e=st.integers(1, 6), i=st.integers(1, 50), l=st.integers(1, 70),
       dtype=st.sampled_from(list(DTYPES)), routing=st.sampled_from(["random", "skewed", "repeat", "one"]),
       limit=st.sampled_from([1, 16]), tiles=st.sampled_from(["small", "default"]), seed=st.integers(0, 2**16))
@example(m=1, a=3, e=6, i=48, l=64, dtype="bf16", routing="random", limit=16, tiles="default", seed=0)   # decode
@example(m=5, a=2, e=3, i=33, l=50, dtype="fp32", routing="repeat", limit=1, tiles="small", seed=1)    # sorted
@example(m=4, a=3, e=6, i=17, l=40, dtype="fp16", routing="one", limit=16, tiles="small", seed=2)      # one expert
def test_triton_float_matches_reference(m, a, e, i, l, dtype, routing, limit, tiles, seed):
    """Widths not multiples of 16, duplicate experts across and within tokens, every pair on one expert, experts
    nobody chose; the decode form (limit 16) and the sorted form (limit 1); tiles smaller than the widths (several
    row chunks: ``one`` puts m·a pairs on one expert) and the interpreter's default."""
    if routing in ("random", "skewed") and a > e:
        a = e
    dt = DTYPES[dtype]
    args = moe_experts_inputs(m, a, e, i, l, dt, routing, seed=seed)
    config = MoeConfig(block_m=16, block_i=16, block_l=32, block_n=16, block_k=32, stages_up=1, stages_down=1) \
        if tiles == "small" else None
    out = run_triton(args, small_m_limit=limit, config=config)
    assert rel_err(out, truth(args)) < TOL[dt], f"M{m}-A{a}-E{e}-I{i}-L{l}-{dtype}-{routing}-lim{limit}-{tiles}"


@settings(max_examples=max(6, settings.default.max_examples // 4))
@given(m=st.integers(1, 4), a=st.integers(1, 3), e=st.integers(1, 5), i=st.sampled_from([32, 64]),
       l=st.sampled_from([32, 64, 96]), dtype=st.sampled_from(list(DTYPES)),
       routing=st.sampled_from(["random", "repeat", "one"]), limit=st.sampled_from([1, 16]), halves=st.booleans(),
       seed=st.integers(0, 2**16))
@example(m=2, a=2, e=4, i=64, l=96, dtype="bf16", routing="random", limit=16, halves=False, seed=0)
@example(m=3, a=2, e=3, i=32, l=64, dtype="fp32", routing="repeat", limit=1, halves=True, seed=1)
def test_triton_mxfp4_matches_reference(m, a, e, i, l, dtype, routing, limit, halves, seed):
    """Random E2M1 codes (every byte) and E8M0 scales, dequantised in registers to z's dtype; interleaved into one
    tile, or (``halves``) the even and odd columns as two products."""
    if routing == "random" and a > e:
        a = e
    dt = DTYPES[dtype]
    args = moe_experts_inputs(m, a, e, i, l, dt, routing, mxfp4=True, seed=seed)
    config = MoeConfig(block_i=64, block_l=64, block_n=64, block_k=64, stages_up=1, stages_down=1, mxfp4_halves=halves)
    out = run_triton(args, small_m_limit=limit, config=config)
    assert rel_err(out, truth(args)) < TOL[dt], f"M{m}-A{a}-E{e}-I{i}-L{l}-{dtype}-{routing}-lim{limit}-h{halves}"


@settings(max_examples=max(6, settings.default.max_examples // 4))
@given(m=st.integers(1, 5), a=st.integers(1, 3), e=st.integers(1, 6), i=st.sampled_from([32, 48, 96]),
       l=st.sampled_from([32, 64, 96]), dtype=st.sampled_from(list(DTYPES)), mxfp4=st.booleans(),
       routing=st.sampled_from(["random", "skewed", "repeat", "one"]), limit=st.sampled_from([1, 16]),
       tiles=st.sampled_from(["even", "ragged"]), rows=st.booleans(), by_token=st.booleans(),
       seed=st.integers(0, 2**16))
@example(m=1, a=3, e=6, i=96, l=64, dtype="bf16", mxfp4=True, routing="random", limit=16, tiles="even", rows=True,
         by_token=False, seed=0)
@example(m=4, a=2, e=3, i=48, l=64, dtype="fp32", mxfp4=False, routing="repeat", limit=1, tiles="ragged", rows=True,
         by_token=True, seed=1)
@example(m=3, a=3, e=2, i=96, l=96, dtype="fp16", mxfp4=True, routing="one", limit=16, tiles="ragged", rows=False,
         by_token=True, seed=2)
@example(m=5, a=3, e=4, i=48, l=32, dtype="bf16", mxfp4=False, routing="repeat", limit=16, tiles="even", rows=True,
         by_token=True, seed=3)
def test_triton_weight_rows_matches_reference(m, a, e, i, l, dtype, mxfp4, routing, limit, tiles, rows, by_token,
                                              seed):
    """``MoeConfig.weight_rows``: w1 and w3 rows stacked in one tile, the weights as the products' rows, z split into
    even and odd columns in registers (MXFP4); ``down_by_token``: the down product and the combine in one kernel
    (decode form; the sorted form keeps the combine); decode and sorted forms; steps that divide the widths (the
    row-constant masks of EVEN_K) and steps that do not (64 columns over I = 48 or 96, L = 96)."""
    if routing in ("random", "skewed") and a > e:
        a = e
    if mxfp4 and i % 32:
        i = 32   # MXFP4 widths are whole groups
    dt = DTYPES[dtype]
    args = moe_experts_inputs(m, a, e, i, l, dt, routing, mxfp4=mxfp4, seed=seed)
    step = 32 if tiles == "even" else 64
    config = MoeConfig(block_i=16, block_l=step, block_n=16, block_k=step, stages_up=1, stages_down=1,
                       weight_rows=rows, trigger_early=True, down_by_token=by_token)
    out = run_triton(args, small_m_limit=limit, config=config)
    assert rel_err(out, truth(args)) < TOL[dt], \
        f"M{m}-A{a}-E{e}-I{i}-L{l}-{dtype}-mx{mxfp4}-{routing}-lim{limit}-rows{rows}-token{by_token}"


def test_triton_weight_rows_strided_up_falls_back():
    """w1 and w3 with different column strides cannot share the stacked tile: the other kernels run, still exact."""
    args = list(moe_experts_inputs(2, 2, 3, 32, 64, torch.float32, seed=5))
    args[4] = args[4].transpose(1, 2).contiguous().transpose(1, 2)          # w3 column-major
    config = MoeConfig(block_i=16, block_l=32, block_n=16, block_k=32, stages_up=1, stages_down=1, weight_rows=True)
    assert rel_err(run_triton(args, config=config), truth(args)) < TOL[torch.float32]


@pytest.mark.parametrize("betas", [(4.0, None), (None, None), (2.5, 7.0)], ids=["uncapped-up", "silu", "other-betas"])
def test_triton_other_activations(betas):
    args = moe_experts_inputs(3, 2, 4, 24, 40, torch.float32, seed=3)
    assert rel_err(run_triton(args, betas), truth(args, betas)) < TOL[torch.float32]


@pytest.mark.parametrize("limit,config", [(16, None), (1, None), (16, MoeConfig(weight_rows=True)),
                                          (16, MoeConfig(down_by_token=True))],
                         ids=["decode", "sorted", "decode-rows", "decode-by-token"])
def test_triton_id_outside_range_poisons_only_its_token(limit, config):
    """An id of -1 or E reads no weight: the tokens holding one come out NaN, the others exact."""
    args = list(moe_experts_inputs(4, 2, 5, 24, 40, torch.float32, seed=4))
    experts = args[1].clone()
    experts[1, 0], experts[2, 1] = -1, 5
    args[1] = experts
    out = torch.full_like(args[0], 7.0)
    moe_experts_triton(*args, *K3_BETAS, out=out, small_m_limit=limit, config=config)
    assert out[1].isnan().all() and out[2].isnan().all()
    good = [0, 3]
    ref = moe_experts_ref(args[0][good], args[1][good], args[2][good], *args[3:], *K3_BETAS)
    assert rel_err(out[good], ref) < TOL[torch.float32]


def test_reference_rejects_id_outside_range():
    args = list(moe_experts_inputs(2, 2, 4, 16, 32, torch.float32))
    args[1] = torch.tensor([[0, 1], [4, 2]])
    with pytest.raises(ValueError, match=r"expert id 4 at \(1, 0\) is outside \[0, 4\)"):
        moe_experts(*args, *K3_BETAS, backend="reference")


def test_dense_fallback_without_host_sync():
    """The cuBLAS fallback runs inside CUDA graphs: an id out of range poisons its token instead of raising."""
    args = list(moe_experts_inputs(6, 2, 4, 16, 32, torch.float32, seed=8))
    args[1] = args[1].clone()
    args[1][3, 1] = -2
    out = dispatch.moe_experts_dense(*args[:6], *K3_BETAS)
    good = [0, 1, 2, 4, 5]
    assert out[3].isnan().all()
    assert rel_err(out[good], moe_experts_ref(*[t[good] for t in args[:3]], *args[3:], *K3_BETAS)) < 1e-5


def test_repeated_calls_identical():
    args = moe_experts_inputs(4, 3, 5, 24, 40, torch.bfloat16, routing="repeat", seed=6)
    first, second = run_triton(args), run_triton(args)
    assert torch.equal(first, second)


@triton.jit
def _dequantise_kernel(p_codes, p_scales, p_out, R: tl.constexpr, K: tl.constexpr):
    o_r = tl.arange(0, R)
    b_v = _mxfp4_tile(p_codes, p_scales, o_r, o_r < R, 0, K, K // 2, 1, K // 32, 1, R, K, tl.float32)
    tl.store(p_out + o_r[:, None] * K + tl.arange(0, K)[None, :], b_v)


@pytest.mark.filterwarnings("ignore:overflow encountered")   # 6·2^127 is inf, in the reference too
def test_mxfp4_dequantisation_every_code_and_extreme_scales():
    """The kernels' register dequantisation equals the reference's, which equals the loader's, for every code byte
    and the E8M0 extremes 0 and 254 (255 is NaN), bit for bit in fp32."""
    codes = torch.arange(256, dtype=torch.uint8).reshape(4, 64)                     # [rows, C/2]: C = 128
    scales = torch.tensor([[0, 127, 254, 100], [1, 126, 128, 140], [127] * 4, [120, 130, 125, 127]],
                          dtype=torch.uint8)
    ref = dequantize_mxfp4(codes, scales, torch.float32)
    assert torch.equal(ref, model_dequantize(codes, scales, torch.float32))
    nan_scale = scales.clone()
    nan_scale[0, 0] = 255
    assert dequantize_mxfp4(codes, nan_scale, torch.float32)[0, :32].isnan().all()
    out = torch.full((4, 128), float("nan"))
    _dequantise_kernel[(1,)](codes, nan_scale, out, R=4, K=128)
    assert torch.equal(out[1:], ref[1:]) and torch.equal(out[0, 32:], ref[0, 32:]) and out[0, :32].isnan().all()


def test_reference_equals_model_forms():
    """The reference is the model's math: both forms of model/moe.py give its values."""
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
        z, experts, weights, w1, w3, w2, *_ = moe_experts_inputs(5, 3, 6, 24, 40, dtype, seed=7)
        ref = moe_experts_ref(z, experts, weights, w1, w3, w2, None, None, None, *K3_BETAS)
        for form in (experts_gathered, experts_dense):
            assert rel_err(form(z, experts, weights, w1, w3, w2, *K3_BETAS), ref) < tol


# ---------------------------------------------------------------------------------------------
# the op and its dispatch

def test_auto_runs_triton_on_cpu_under_interpreter_recorded(clean_records):
    args = moe_experts_inputs(2, 2, 4, 16, 32, torch.float32)
    out = moe_experts(*args, *K3_BETAS)
    assert rel_err(out, truth(args)) < TOL[torch.float32]
    (choice,) = MOE_EXPERTS.choices()
    assert choice.impl == "triton" and choice.key[1][:3] == ("float32", "float", "decode")


def test_dense_where_the_table_measured_it_faster(clean_records, monkeypatch):
    args = moe_experts_inputs(6, 2, 4, 16, 32, torch.float32)
    entry = dict(dtype="float32", format="float", E=4, I=16, L=32, A=2, dense_from_m=5)
    monkeypatch.setattr(dispatch, "table", lambda device: {"dense": [entry]})
    out = moe_experts(*args, *K3_BETAS, small_m_limit=4)
    (choice,) = MOE_EXPERTS.choices()
    assert choice.impl == "aten" and "dense form" in choice.reason
    assert rel_err(out, truth(args)) < TOL[torch.float32]


def test_forced_triton_without_interpreter_raises(monkeypatch, clean_records):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    args = moe_experts_inputs(2, 2, 4, 16, 32, torch.float32)
    with pytest.raises(BackendUnavailableError):
        moe_experts(*args, *K3_BETAS, backend="triton")


def test_dtype_the_kernels_lack_falls_back_recorded(clean_records):
    args = moe_experts_inputs(2, 2, 4, 16, 32, torch.float64)
    out = moe_experts(*args, *K3_BETAS)
    (choice,) = MOE_EXPERTS.choices()
    assert choice.impl == "reference" and "float64" in choice.reason
    assert rel_err(out, truth(args)) < 1e-12


@pytest.mark.parametrize("m,a,limit,form", [(16, 16, 16, True), (17, 16, 16, False), (17, 16, 64, False),
                                            (8, 4, 4, False), (4, 64, 16, True)])
def test_decode_form_by_rows_and_pairs(m, a, limit, form):
    assert decode_form(m, a, limit) is form


def test_tuned_config_keeps_decode_picks_to_decode():
    """A pick measured on the decode kernels (M <= 16) serves the Ms up to the next measured one; the sorted form's
    Ms (> 16) get only picks measured there, else none (the defaults), and old entries without the new fields
    still load."""
    from k3compile.ops.moe_experts.config import tuned_config

    def entry(m, **config):
        return dict(dtype="bfloat16", format="float", I=384, L=3584, m=m, config=config)

    table = {"configs": [entry(1, weight_rows=True, trigger_early=True), entry(16, block_n=32), entry(256, block_m=64)]}
    pick = lambda m: tuned_config(table, m, torch.bfloat16, False, 384, 3584)   # noqa: E731
    assert pick(1).weight_rows and pick(1).trigger_early
    assert pick(2).block_n == 32 and pick(16).block_n == 32 and not pick(16).weight_rows
    assert pick(64).block_m == 64 and pick(300).block_m == 64
    assert tuned_config({"configs": table["configs"][:2]}, 64, torch.bfloat16, False, 384, 3584) is None
    assert tuned_config(table, 1, torch.bfloat16, True, 384, 3584) is None


def _bad_cases():
    z, experts, weights, w1, w3, w2, *_ = moe_experts_inputs(2, 2, 4, 32, 64, torch.float32)
    _, _, _, c1, c3, c2, s1, s3, s2 = moe_experts_inputs(2, 2, 4, 32, 64, torch.float32, mxfp4=True)
    return {
        "z-1d": ((z[0], experts, weights, w1, w3, w2, None, None, None), "z must be"),
        "float-ids": ((z, experts.float(), weights, w1, w3, w2, None, None, None), "integer ids"),
        "rows-differ": ((z, experts[:1], weights, w1, w3, w2, None, None, None), "disagree"),
        "w2-transposed": ((z, experts, weights, w1, w3, w2.transpose(1, 2), None, None, None), "w2 must be"),
        "w-dtype": ((z, experts, weights, w1.double(), w3, w2, None, None, None), "w1 dtype"),
        "one-scale": ((z, experts, weights, c1, c3, c2, s1, None, s2), "all three MXFP4 scales"),
        "scale-shape": ((z, experts, weights, c1, c3, c2, s1, s3, s2[:, :1]), "w2_scale must be"),
        "codes-float": ((z, experts, weights, w1, w3, w2, s1, s3, s2), "must be uint8"),
    }


@pytest.mark.parametrize("case", list(_bad_cases()))
def test_bad_input_clear_error(case):
    args, msg = _bad_cases()[case]
    with pytest.raises(ValueError, match=msg):
        moe_experts(*args, *K3_BETAS, backend="reference")


def test_opcheck():
    args = moe_experts_inputs(3, 2, 4, 32, 64, torch.float32)
    torch.library.opcheck(torch.ops.k3.moe_experts.default, (*args, *K3_BETAS, "reference", 16),
                          test_utils=("test_schema", "test_faketensor"))
    mx = moe_experts_inputs(3, 2, 4, 32, 64, torch.bfloat16, mxfp4=True)
    torch.library.opcheck(torch.ops.k3.moe_experts.default, (*mx, *K3_BETAS, "reference", 16),
                          test_utils=("test_schema", "test_faketensor"))


# ---------------------------------------------------------------------------------------------
# the kernels compiled for sm_90 (Triton's NVIDIA backend needs no GPU)

_PTX_SCRIPT = """
import json, os, subprocess, sys, tempfile, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from k3compile.ops.moe_experts import triton as kernels

POINTERS = dict(p_ids="*i64", p_order="*i32", p_offsets="*i32", p_wts="*fp32", p_part="*fp32", p_cnt="*i32",
                p_s1="*u8", p_s3="*u8", p_s2="*u8")
FLOATS = ("beta", "linear_beta")
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
out = {}
for name, flavour in json.loads(sys.argv[1]).items():
    kind = flavour.pop("kernel")
    kernel = getattr(kernels, f"_{kind}_kernel")
    dtype, mxfp4 = flavour.pop("dtype"), flavour.get("MXFP4", False)
    # integer arguments not a multiple of 16 at K3 shapes (MXFP4: I/32; the gate/up steps of an L slice)
    not_16 = flavour.pop("not_16", []) + ["STEPS"]
    options = dict(num_warps=flavour.pop("num_warps", 4), num_stages=flavour.pop("num_stages", 3),
                   **({"maxnreg": flavour.pop("maxnreg")} if "maxnreg" in flavour else {}))
    const = dict(BLOCK_M=16, BLOCK_A=16, SORTED=False, MXFP4=False, HALVES=False, ASM=False, DOTS=False,
                 X_FMT="fp16" if dtype == "fp16" else "bf16", IEEE=dtype == "fp32",
                 UPCAST=False, PDL=True, EARLY=False, EVEN_K=False, ROWS=False, S_ALIGN=1, BLOCK_N=64, BLOCK_K=128,
                 SPLIT=1, FMA=False)
    # unit inner strides as Triton specialises them at a launch (the loads vectorise)
    const.update(dict(BLOCK_I=32, BLOCK_L=128, HAS_BETA=True, HAS_LINEAR_BETA=True, s_zl=1, s_1l=1, s_3l=1, s_s1l=1,
                      s_s3l=1) if kind == "gate_up"
                 else dict(BLOCK_N=64, BLOCK_K=128, PRELOAD=True, s_2i=1, s_s2i=1))
    const.update(flavour)
    const = {k: v for k, v in const.items() if k in kernel.arg_names}
    weight = "*u8" if mxfp4 else f"*{dtype}"
    sig = {}
    for n in kernel.arg_names:
        if n in const:
            sig[n] = "constexpr"
        elif n in POINTERS:
            sig[n] = POINTERS[n]
        elif n in ("p_w1", "p_w3", "p_w2"):
            sig[n] = weight
        elif n.startswith("p_"):
            sig[n] = f"*{dtype}"
        else:
            sig[n] = "fp32" if n in FLOATS else "i32"
    # pointers 16-byte aligned and integers multiples of 16, as Triton specialises a launch at K3 shapes
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names)
               if n not in const and n not in FLOATS and n != "M" and n not in not_16}
    src = ASTSource(fn=kernel, signature=sig, constexprs=const, attrs=aligned)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    ptxas = ""
    if os.path.exists(PTXAS):
        with tempfile.TemporaryDirectory() as d:
            with open(os.path.join(d, "k.ptx"), "w") as f:
                f.write(compiled.asm["ptx"])
            ptxas = subprocess.run([PTXAS, "-arch=sm_90a", "-v", os.path.join(d, "k.ptx"), "-o",
                                    os.path.join(d, "k.cubin")], capture_output=True, text=True).stderr
    out[name] = dict(ptx=compiled.asm["ptx"], ttgir=compiled.asm["ttgir"], ptxas=ptxas)
print(json.dumps(out))
"""
_MX_DOWN = dict(MXFP4=True, not_16=["s_s2l"])   # w2's scale rows are I/32 = 12 bytes apart at TP=8
PTX_FLAVOURS = {
    "gate_up-bf16-decode": dict(kernel="gate_up", dtype="bf16"),
    "gate_up-fp16-sorted": dict(kernel="gate_up", dtype="fp16", SORTED=True),
    "gate_up-fp32-decode": dict(kernel="gate_up", dtype="fp32"),
    "gate_up-bf16-mxfp4": dict(kernel="gate_up", dtype="bf16", MXFP4=True),
    "down-bf16-decode": dict(kernel="down", dtype="bf16"),
    "down-bf16-sorted": dict(kernel="down", dtype="bf16", SORTED=True),
    "down-fp32-decode": dict(kernel="down", dtype="fp32", BLOCK_K=64),
    "down-bf16-mxfp4": dict(kernel="down", dtype="bf16", **_MX_DOWN),
    "gate_up-bf16-mxfp4-halves": dict(kernel="gate_up", dtype="bf16", MXFP4=True, HALVES=True),
    "down-bf16-mxfp4-halves": dict(kernel="down", dtype="bf16", HALVES=True, **_MX_DOWN),
    # the PTX lookup: ptxas assembles it here; tests below emulate it; the GPU tests run it
    "gate_up-bf16-mxfp4-asm": dict(kernel="gate_up", dtype="bf16", MXFP4=True, HALVES=True, ASM=True),
    "down-bf16-mxfp4-asm": dict(kernel="down", dtype="bf16", HALVES=True, ASM=True, **_MX_DOWN),
    # Triton's scaled product (the interpreter lacks it: compiled here, run by the GPU tests)
    "gate_up-bf16-mxfp4-dot-scaled": dict(kernel="gate_up", dtype="bf16", MXFP4=True, DOTS=True, EVEN_K=True),
    "down-fp16-mxfp4-dot-scaled": dict(kernel="down", dtype="fp16", DOTS=True, **_MX_DOWN),
    # trigger_early: the next kernel may launch right after our wait
    "gate_up-bf16-early": dict(kernel="gate_up", dtype="bf16", EARLY=True, num_stages=4),
    "down-bf16-early-whole-k": dict(kernel="down", dtype="bf16", EARLY=True, BLOCK_N=32, BLOCK_K=512,
                                    num_stages=1),
    # weight_rows: the weights as the products' rows (benchmarks/moe_experts.py sweeps these at K3 TP=8 tiles)
    "gate_up_rows-bf16": dict(kernel="gate_up", dtype="bf16", ROWS=True, EARLY=True, EVEN_K=True, num_stages=4),
    "down_rows-bf16": dict(kernel="down", dtype="bf16", ROWS=True, EARLY=True, EVEN_K=True),
    "gate_up_rows-bf16-mxfp4-bits": dict(kernel="gate_up", dtype="bf16", ROWS=True, MXFP4=True, ASM=True, EARLY=True,
                                         EVEN_K=True, BLOCK_L=256),
    "down_rows-bf16-mxfp4-bits": dict(kernel="down", dtype="bf16", ROWS=True, ASM=True, EARLY=True, EVEN_K=True,
                                      S_ALIGN=4, BLOCK_N=128, **_MX_DOWN),
    "gate_up_rows-fp16-mxfp4-sorted": dict(kernel="gate_up", dtype="fp16", ROWS=True, MXFP4=True, SORTED=True),
    # down_by_token: the down product and the combine in one kernel
    "down_token-bf16": dict(kernel="down_token", dtype="bf16", EARLY=True, EVEN_K=True, BLOCK_N=16, num_stages=8),
    # split_l: gate/up over slices of L, the last slice to arrive summing them; gemv: the products on CUDA cores
    "gate_up-bf16-split-early": dict(kernel="gate_up", dtype="bf16", SPLIT=2, EARLY=True, num_stages=3),
    "gate_up-bf16-mxfp4-bits-split-early": dict(kernel="gate_up", dtype="bf16", ROWS=True, MXFP4=True, ASM=True,
                                                EARLY=True, EVEN_K=True, BLOCK_L=128, SPLIT=2, num_stages=5),
    "gate_up-bf16-mxfp4-bits-split-maxnreg-early": dict(kernel="gate_up", dtype="bf16", ROWS=True, MXFP4=True,
                                                        ASM=True, EARLY=True, EVEN_K=True, BLOCK_L=128, SPLIT=2,
                                                        num_stages=5, maxnreg=80),
    "gate_up-bf16-mxfp4-bits-split-gemv-early": dict(kernel="gate_up", dtype="bf16", ROWS=True, MXFP4=True, ASM=True,
                                                     EARLY=True, EVEN_K=True, BLOCK_I=16, BLOCK_L=128, SPLIT=7,
                                                     FMA=True, BLOCK_M=1, num_stages=1),
    "down-bf16-gemv-early": dict(kernel="down", dtype="bf16", FMA=True, BLOCK_M=1, BLOCK_N=32, EARLY=True,
                                 num_stages=1),
}


@pytest.fixture(scope="module")
def sm90_ptx():
    from k3compile.testing import ptx_in_a_fresh_process

    pytest.importorskip("triton.backends.nvidia")
    return ptx_in_a_fresh_process(_PTX_SCRIPT, PTX_FLAVOURS)


@pytest.mark.parametrize("flavour", sorted(PTX_FLAVOURS))
def test_pdl_order_in_sm90_ptx(sm90_ptx, flavour):
    """Every kernel triggers only after its own wait (static_weights.py, step 1), and writes nothing before it; the
    gate/up kernel reads nothing before it (z and the ids are the previous kernels' outputs)."""
    ptx = sm90_ptx[flavour]["ptx"].splitlines()
    wait = [i for i, line in enumerate(ptx) if "griddepcontrol.wait" in line]
    trigger = [i for i, line in enumerate(ptx) if "griddepcontrol.launch_dependents" in line]
    assert wait and trigger and min(trigger) > min(wait)
    before = ptx[:min(wait)]
    assert not any(op in line for line in before for op in ("st.global", "atom.global", "red.global"))
    if flavour.startswith("gate_up"):
        assert not any("ld.global" in line for line in before)
    if "-early" in flavour or flavour.startswith(("gate_up_rows-bf16", "down_rows-bf16", "down_token")):
        # trigger_early: the trigger follows the wait with no load between (the next kernel launches at once)
        assert not any("ld.global" in line or "cp.async" in line for line in ptx[min(wait):min(trigger)])


@pytest.mark.parametrize("flavour", sorted(f for f in PTX_FLAVOURS if "_rows" in f or "_token" in f or "whole-k" in f))
def test_candidates_sm90_loads_pipelined_no_spills(sm90_ptx, flavour):
    """The sweep's new candidates as ptxas sees them: no spills; the weight rows form runs wgmma and pipelines every
    load of its K loop through cp.async (16-byte weight copies, the scale bytes as words: no byte loads left in the
    loop), as does the down-by-token kernel; the whole-K down form issues all of its w2 tile as 16-byte loads before
    its wait."""
    got = sm90_ptx[flavour]
    if got["ptxas"]:
        assert " 0 bytes spill stores" in got["ptxas"], got["ptxas"]
    ptx = got["ptx"]
    if "whole-k" in flavour:
        before = ptx[:ptx.index("griddepcontrol.wait")]
        assert before.count("ld.global.L1::evict_first.L2::cache_hint.v4") >= 8   # 32 x 512 bf16: 16 per thread
        return
    ttgir = got["ttgir"]
    loop = ttgir[ttgir.rindex("scf.for"):]
    loop = loop[:loop.index("scf.yield")]
    assert any("cp.async.cg.shared.global" in line and "0x10" in line for line in ptx.splitlines())
    if "_rows" in flavour:   # 64+ weight rows on 4 warps: a wgmma with the weights as its register operand
        assert "wgmma.mma_async" in ptx
    if "sorted" not in flavour:
        assert "tt.load " not in loop, "a load of the K loop is not pipelined"
    if "mxfp4" in flavour:
        assert "tt.elementwise_inline_asm" in loop or "sorted" in flavour or "fp16" in flavour


@pytest.mark.parametrize("flavour", sorted(f for f in PTX_FLAVOURS if "-split" in f or "-gemv" in f))
def test_split_and_gemv_sm90(sm90_ptx, flavour):
    """The split gate/up counts its arrival with an acq_rel atomic at GPU scope, reads the other slices' partials
    through L2 (.cg), rearms its counter by an exchange, and pipelines its slice's loads (16-byte cp.async) where the
    products are MMAs; the CUDA-core forms issue no MMA. No spills, but where a register cap is asked (ptxas honours
    it, spilling little)."""
    got = sm90_ptx[flavour]
    ptx = got["ptx"]
    if got["ptxas"]:
        regs = int(re.search(r"Used (\d+) registers", got["ptxas"]).group(1))
        spills = int(re.search(r"(\d+) bytes spill stores", got["ptxas"]).group(1))
        assert (regs <= 80 and spills <= 64) if "maxnreg" in flavour else spills == 0, got["ptxas"]
    if "-split" in flavour:
        atoms = [line for line in ptx.splitlines() if "atom.global" in line]
        assert any(".acq_rel." in a and ".gpu." in a and ".add." in a for a in atoms), "arrival: acq_rel add, GPU scope"
        assert any(".exch." in a for a in atoms), "the counter rearmed by an exchange"
        assert "ld.global.cg" in ptx, "the partials read through L2"
    if "-gemv" in flavour:
        assert "mma" not in ptx
    else:
        assert any("cp.async.cg.shared.global" in line and "0x10" in line for line in ptx.splitlines())


# ---------------------------------------------------------------------------------------------
# GPU: K3 rank shapes (TP=8: E 896, top-16, L 3584, I 384), CUDA graphs, PDL

K3_RANK = dict(e=896, a=16, l=3584, i=384)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
@pytest.mark.parametrize("m,routing", [(1, "random"), (8, "random"), (16, "skewed"), (64, "random"), (256, "repeat")],
                         ids=lambda v: str(v))
def test_gpu_k3_shapes_match_reference(m, routing, fmt):
    args = moe_experts_inputs(m, K3_RANK["a"], K3_RANK["e"], K3_RANK["i"], K3_RANK["l"], torch.bfloat16, routing,
                              mxfp4=fmt == "mxfp4", seed=m, device="cuda")
    out = run_triton(args)
    torch.cuda.synchronize()
    assert rel_err(out, truth(args)) < 1e-2, f"M{m}-{routing}-{fmt}"


@pytest.mark.gpu
@pytest.mark.parametrize("i", [48, 64], ids=lambda i: f"I{i}")
def test_gpu_sorted_form_at_the_micro_widths(i):
    """The micro K3's routed experts (E 16, top-4, L 64) at its prefill M (2 x 12) through the Triton kernels: the
    widths where one sequence's prefill logits came out 0.74 off eager's on the H200 (an ill-conditioned prompt,
    not the kernels: docs/tuning/moe_experts.md); I = 64 is the control."""
    args = moe_experts_inputs(24, 4, 16, i, 64, torch.bfloat16, "random", seed=24, device="cuda")
    out = run_triton(args)
    torch.cuda.synchronize()
    rows = ((out.float() - truth(args).float()).norm(dim=-1) / truth(args).float().norm(dim=-1)).cpu()
    assert rows.max() < 3e-2, f"I{i}: rows off the reference:\n{rows}"


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["interleaved", "halves", "halves-asm", "dot-scaled", "rows", "rows-bits"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_gpu_mxfp4_variants(variant, dtype):
    """Every MXFP4 form on the GPU (the PTX conversions and tl.dot_scaled run nowhere else), decode and sorted."""
    flags = dict(interleaved={}, halves=dict(mxfp4_halves=True), rows=dict(weight_rows=True), **{
        "halves-asm": dict(mxfp4_halves=True, mxfp4_asm=True), "dot-scaled": dict(mxfp4_dot_scaled=True),
        "rows-bits": dict(weight_rows=True, mxfp4_asm=True, trigger_early=True, block_l=256, block_n=128)})[variant]
    for m, limit in ((3, 16), (40, 16)):
        args = moe_experts_inputs(m, 8, 64, 96, 256, DTYPES[dtype], mxfp4=True, seed=m, device="cuda")
        out = run_triton(args, small_m_limit=limit, config=MoeConfig(**flags))
        assert rel_err(out, truth(args)) < 1e-2, (variant, dtype, m)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp16", "fp32"])
def test_gpu_other_dtypes(dtype):
    args = moe_experts_inputs(4, 8, 64, 96, 256, DTYPES[dtype], seed=1, device="cuda")
    assert rel_err(run_triton(args), truth(args)) < (5e-3 if dtype == "fp16" else 1e-5)


GRAPH_CONFIGS = {"table": None, "early": MoeConfig(trigger_early=True),
                 "whole-k-early": MoeConfig(block_n=32, block_k=512, stages_down=1, trigger_early=True),
                 "rows-early": MoeConfig(weight_rows=True, trigger_early=True),
                 "by-token-early": MoeConfig(down_by_token=True, block_n=16, stages_down=8, trigger_early=True)}


@pytest.mark.gpu
@pytest.mark.parametrize("config", list(GRAPH_CONFIGS))
@pytest.mark.parametrize("m", [2, 16, 40], ids=lambda m: f"M{m}")
def test_gpu_graph_replays_fresh_inputs(m, config):
    """Captured once, replayed on fresh z, ids and router weights with the output NaN-poisoned: no host sync, no
    data-dependent allocation, PDL order kept (also where each kernel lets the next launch right after its wait)."""
    e, a, l, i = 128, 8, 512, 96
    args = [t for t in moe_experts_inputs(m, a, e, i, l, torch.bfloat16, seed=0, device="cuda")]
    z, experts, weights = args[:3]
    out = torch.empty_like(z)
    kw = dict(config=GRAPH_CONFIGS[config])
    moe_experts_triton(*args, *K3_BETAS, out=out, **kw)   # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        moe_experts_triton(*args, *K3_BETAS, out=out, **kw)
    for seed in range(1, 4):
        fresh = moe_experts_inputs(m, a, e, i, l, torch.bfloat16, routing="repeat" if seed == 2 else "random",
                                   seed=seed, device="cuda")
        for dst, src in zip((z, experts, weights), fresh[:3]):
            dst.copy_(src)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, truth(args)) < 1e-2, seed


@pytest.mark.gpu
def test_gpu_id_outside_range_poisons_only_its_token():
    args = list(moe_experts_inputs(4, 16, 896, 384, 3584, torch.bfloat16, seed=3, device="cuda"))
    args[1][2, 5] = 896
    out = run_triton(args)
    assert out[2].isnan().all() and not out[[0, 1, 3]].isnan().any()



# ---------------------------------------------------------------------------------------------
# the PTX lookup (triton_tiles.E2M1_BF16_PTX), emulated instruction by instruction

def _run_ptx(asm: str, regs: dict) -> dict:
    """Execute the straight-line PTX of ``asm`` (mov, and, or, shl, shr, mul.hi/lo, prmt, fma.rn.bf16x2) on ``regs``
    ({"$4": value, ...}); returns every register."""
    def val(op):
        op = op.strip()
        return int(op, 16) if op.startswith("0x") else int(op) if op.isdigit() else regs[op]

    def bf16x2(v):
        return torch.tensor([v & 0xFFFF, v >> 16], dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()

    for line in asm.strip().splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        dst, *src = [t.strip() for t in rest.split(",")]
        a = [val(t) for t in src]
        if op == "mov.b32":
            r = a[0]
        elif op == "and.b32":
            r = a[0] & a[1]
        elif op == "or.b32":
            r = a[0] | a[1]
        elif op == "shl.b32":
            r = (a[0] << a[1]) & 0xFFFFFFFF
        elif op == "shr.b32":
            r = a[0] >> a[1]
        elif op == "mul.hi.u32":
            r = (a[0] * a[1]) >> 32
        elif op == "mul.lo.u32":
            r = (a[0] * a[1]) & 0xFFFFFFFF
        elif op == "prmt.b32":
            pool = [(a[0] >> 8 * k) & 0xFF for k in range(4)] + [(a[1] >> 8 * k) & 0xFF for k in range(4)]
            sel = [(a[2] >> 4 * i) & 0xF for i in range(4)]
            assert all(c < 8 for c in sel), "sign-replicate mode is not used"
            r = sum(pool[c] << 8 * i for i, c in enumerate(sel))
        elif op == "fma.rn.bf16x2":
            halves = (bf16x2(a[0]) * bf16x2(a[1]) + bf16x2(a[2])).to(torch.bfloat16).view(torch.int16).int() & 0xFFFF
            r = int(halves[0]) | int(halves[1]) << 16
        else:
            raise AssertionError(f"unexpected instruction {op}")
        regs[dst] = r
    return regs


@pytest.mark.parametrize("scale", [127, 120, 140, 0, 254], ids=lambda s: f"e8m0-{s}")
def test_ptx_lookup_emulated_every_byte(scale):
    """Every code byte in every position of the 32-bit word, against the reference dequantisation."""
    from k3compile.ops.moe_experts.triton_tiles import E2M1_BF16_PTX

    g = torch.Generator().manual_seed(scale)
    sb = (0x40 if scale == 0 else scale << 7)                                # the bf16 scale, as _e8m0_bf16
    for pos in range(4):
        for byte in range(256):
            word = torch.randint(0, 256, (4,), generator=g, dtype=torch.uint8)
            word[pos] = byte
            x = sum(int(b) << 8 * k for k, b in enumerate(word))
            regs = _run_ptx(E2M1_BF16_PTX, {"$4": x, "$5": sb | sb << 16, "$6": sb | sb << 16})
            got = torch.tensor([regs[f"${i}"] >> 16 * h & 0xFFFF for i in range(4) for h in range(2)],
                               dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
            ref = dequantize_mxfp4(torch.cat([word, torch.zeros(12, dtype=torch.uint8)])[None],
                                   torch.tensor([[scale]], dtype=torch.uint8), torch.bfloat16)[0, :8]
            # outputs: $0, $1 the low nibbles (even elements 0, 2 | 4, 6), $2, $3 the high ones (odd)
            assert torch.equal(got[:4].view(torch.int16), ref[0::2].view(torch.int16)), (pos, byte)
            assert torch.equal(got[4:].view(torch.int16), ref[1::2].view(torch.int16)), (pos, byte)



@pytest.mark.parametrize("scale", [127, 120, 140, 0, 1, 128, 129, 254, 255], ids=lambda s: f"e8m0-{s}")
def test_ptx_bits_emulated_every_byte_pair(scale):
    """``E2M1_BF16_BITS_PTX`` (the weight rows form's conversion) on every code byte in either position of its two,
    bit for bit against the reference dequantisation (scale 255: NaN throughout, as the reference)."""
    from k3compile.ops.moe_experts.triton_tiles import E2M1_BF16_BITS_PTX

    g = torch.Generator().manual_seed(scale)
    sb = 0x40 if scale == 0 else 0x7FC0 if scale == 255 else scale << 7      # the bf16 scale, as _e8m0_bf16
    for pos in range(2):
        for byte in range(256):
            pair = torch.randint(0, 256, (2,), generator=g, dtype=torch.uint8)
            pair[pos] = byte
            regs = _run_ptx(E2M1_BF16_BITS_PTX, {"$2": int(pair[0]) | int(pair[1]) << 8, "$3": sb | sb << 16})
            got = torch.tensor([regs[f"${i}"] >> 16 * h & 0xFFFF for i in range(2) for h in range(2)],
                               dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
            ref = dequantize_mxfp4(torch.cat([pair, torch.zeros(14, dtype=torch.uint8)])[None],
                                   torch.tensor([[scale]], dtype=torch.uint8), torch.bfloat16)[0, :4]
            if scale == 255:
                assert got.isnan().all() and ref.isnan().all()
                continue
            # outputs: $0 the low nibbles (elements 0, 2), $1 the high ones (1, 3)
            assert torch.equal(got[:2].view(torch.int16), ref[0::2].view(torch.int16)), (pos, byte)
            assert torch.equal(got[2:].view(torch.int16), ref[1::2].view(torch.int16)), (pos, byte)
