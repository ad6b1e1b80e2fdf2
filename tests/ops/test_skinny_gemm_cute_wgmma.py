"""The wgmma CuTe skinny GEMM (``k3compile/kernels/cute/wgmma.py``) against the reference.

CPU (CI): the module imports without cutlass, its predicates give reasons, configurations are checked (tag,
shared-memory budget, rejects), the table/heuristic give launchable configurations, and (when CuTe DSL is
installed) one variant compiles for sm_90a. GPU (`-m gpu` on the H200): NaN-poisoned outputs against a float64
reference over configurations, M = 1..16, bf16/fp16, bias/residual on and off, N not a multiple of the row tile,
K not a multiple of the K tile, static weight, random N/K (hypothesis), and CUDA-graph capture and replay.
"""
import dataclasses
import importlib.util

import pytest
import torch
from hypothesis import example, given, settings, strategies as st

from k3compile.backends import cute_can_run_on
from k3compile.kernels.cute import compile as cc, configs
from k3compile.kernels.cute.configs import WgmmaConfig as C
from k3compile.ops.skinny_gemm import cute as kc, cute_config, dispatch
from k3compile.ops.skinny_gemm.reference import skinny_gemm_reference
from k3compile.testing import check_chain_replays, rel_err

HAS_CUTLASS = importlib.util.find_spec("cutlass") is not None
needs_cutlass = pytest.mark.skipif(not HAS_CUTLASS, reason="CuTe DSL (nvidia-cutlass-dsl) not installed")
H200 = dispatch.table_for("NVIDIA H200")


def table_picks(static_weight: bool) -> dict:
    """The H200 table's bf16 picks that name this kernel: {(M bucket, N, K): config}."""
    return {(m, n, k): p.configs["cute"] for (dt, m, n, k, st), p in H200.picks.items()
            if dt == "bfloat16" and st == static_weight and isinstance(p.configs.get("cute"), C)}


def op_config(m, n, k, static_weight=False):
    """What the op runs on an H200 (its table, else the heuristic)."""
    return dispatch.cute_config_for(torch.bfloat16, m, n, k, static_weight, H200)


def tol(dtype):
    return 8e-3 if dtype == torch.bfloat16 else 2e-3


# ---------------------------------------------------------------------------------------- CPU tests

def test_config_tag_spells_every_field():
    assert C(block_n=128, block_k=64, stages=6, split_k=3).tag() == "wg-n128-k64-s6-c3"
    assert C(block_n=64, block_k=64, stages=8, split_k=1, producer_warp=True, evict_hints=True,
             early=True).tag() == "wg-n64-k64-s8-c1-pw-h-e"
    assert C(block_n=64, block_k=64, stages=8, split_k=1, early_w=False).tag() == "wg-n64-k64-s8-c1-nw"
    assert C(block_n=64, block_k=64, stages=8, split_k=1, producer_warp=True,
             mma_trigger=True).tag() == "wg-n64-k64-s8-c1-pw-tm"
    assert C(block_n=64, block_k=128, stages=6, split_k=1, evict_hints=True,
             trigger_first=True).tag() == "wg-n64-k128-s6-c1-h-tf"
    assert C(block_n=64, block_k=128, stages=6, split_k=8, producer_warp=True, evict_hints=True,
             push_partials=True).tag() == "wg-n64-k128-s6-c8-pw-h-pp"
    assert C(block_n=64, block_k=64, stages=7, split_k=16, push_partials=True,
             owners=4).tag() == "wg-n64-k64-s7-c16-pp-o4"
    assert C(block_n=64, block_k=128, stages=4, split_k=8, producer_warp=True, push_partials=True,
             reg_stages=3).tag() == "wg-n64-k128-s4-c8-pw-pp-r3"
    variants = [(64, 64, 8, 1), (128, 64, 8, 1), (64, 128, 8, 1), (64, 64, 4, 1), (64, 64, 8, 2),
                (64, 64, 8, 1, True), (64, 64, 8, 1, False, True), (64, 64, 8, 1, False, False, True),
                (64, 64, 8, 1, False, False, False, True), (64, 64, 8, 1, False, False, False, False, False),
                (64, 64, 8, 1, False, False, False, False, True, True),
                (64, 64, 8, 2, False, False, False, False, True, False, True),
                (64, 64, 8, 2, False, False, False, False, True, False, True, 1),
                (64, 64, 8, 2, True, False, False, False, True, False, True, 1, 2)]
    fields = [f.name for f in dataclasses.fields(C)]
    assert len({C(**dict(zip(fields, v))).tag() for v in variants}) == len(variants)


@pytest.mark.parametrize("cfg,why", [(C(block_n=32), "block_n"), (C(block_n=64, block_k=32), "block_k"), (C(stages=1),
                                                                                                          "stages"),
                                     (C(split_k=17), "split_k"), (C(block_n=128, block_k=128, stages=16),
                                                                  "shared memory"),
                                     (C(early=True, mma_trigger=True), "not both"),
                                     (C(split_k=1, push_partials=True), "split_k=1"),
                                     (C(split_k=4, owners=2), "owners=2"),
                                     (C(split_k=4, push_partials=True, owners=5), "owners=5"),
                                     (C(block_n=64, block_k=128, stages=4, split_k=8, reg_stages=3), "producer warp"),
                                     (C(block_n=64, block_k=128, stages=4, split_k=8, producer_warp=True,
                                        reg_stages=9), "reg_stages=9")],
                         ids=["n32", "k32", "s1", "c17", "smem", "early-and-mma-trigger", "push-without-split",
                              "owners-without-push", "more-owners-than-blocks", "reg-stages-without-producer-warp",
                              "reg-stages-9"])
def test_config_rejects_unlaunchable(cfg, why):
    assert why in cfg.invalid()


def test_smem_budget_counts_ring_and_partial_tile():
    c = C(block_n=64, block_k=64, stages=8, split_k=1)
    assert c.smem_bytes(16) == 1024 + 8 * (64 + 16) * 64 * 2 + 1024 + 64 * 17 * 4 + 1024
    assert c.smem_bytes(8) < c.smem_bytes(9) == c.smem_bytes(16)
    # push_partials: no partial tile (a 4-float stub), but the other blocks' fragments of our outputs,
    # [split_k, threads of an owner group (⌈128 / split_k⌉), block_n · M padded / 128] fp32
    pushed, read = C(block_n=64, block_k=64, stages=8, split_k=8, producer_warp=True,
                     push_partials=True), C(block_n=64, block_k=64, stages=8, split_k=8, producer_warp=True)
    assert pushed.smem_bytes(16) - read.smem_bytes(16) == (4 - 64 * 17 + 8 * 16 * 8) * 4
    assert pushed.smem_bytes(1) - read.smem_bytes(1) == (4 - 64 * 9 + 8 * 16 * 4) * 4
    assert C(block_n=128, block_k=64, stages=4, split_k=3, push_partials=True).push_slots(16) == 3 * 43 * 16
    assert C(block_n=64, block_k=64, stages=7, split_k=16, push_partials=True).push_slots(16) == 16 * 8 * 8
    # owners: R owner groups of ⌈128 / R⌉ threads; owners=split_k is the default's layout
    assert C(block_n=64, block_k=128, stages=7, split_k=8, push_partials=True, owners=1).push_slots(16) == 8 * 128 * 8
    every = C(block_n=64, block_k=64, stages=7, split_k=16, push_partials=True)
    assert dataclasses.replace(every, owners=16).push_slots(8) == every.push_slots(8)
    # reg_stages: A leaves the ring for resident tiles of its own, one per tile of the share (stages + reg_stages),
    # each with its barrier
    ring = C(block_n=64, block_k=128, stages=4, split_k=8, producer_warp=True, push_partials=True, owners=2)
    reg = dataclasses.replace(ring, reg_stages=3)
    assert reg.a_tiles() == 7
    assert reg.smem_bytes(16) - ring.smem_bytes(16) == 7 * (16 * 128 * 2 + 8) - 4 * 16 * 128 * 2
    assert reg.smem_bytes(1) - ring.smem_bytes(1) == 7 * (8 * 128 * 2 + 8) - 4 * 8 * 128 * 2
    # the router's M16 pick: two blocks fit an SM (228 KB, 1 KB reserved a block), where the 7-slot ring's did not
    whole_ring = dataclasses.replace(ring, stages=7)
    assert 2 * (reg.smem_bytes(16) + 1024) <= 228 * 1024 < 2 * (whole_ring.smem_bytes(16) + 1024)


@settings(max_examples=200, deadline=None)
@given(bk=st.sampled_from([64, 128]), stages=st.integers(2, 8), reg=st.integers(0, 8), split=st.integers(1, 16),
       k=st.integers(1, 4000).map(lambda x: 8 * x))
def test_share_fits_means_every_block_has_its_register_tiles_and_resident_a(bk, stages, reg, split, k):
    """share_fits(k) holds exactly when every block's K share (the kernel's split: k_lo = q·kt // KS) has at least
    reg_stages tiles (its register tiles are waited on) and at most a_tiles() (A's resident slots)."""
    cfg = C(block_n=64, block_k=bk, stages=stages, split_k=split, producer_warp=True, reg_stages=reg)
    kt = -(-k // bk)
    counts = [(q + 1) * kt // split - q * kt // split for q in range(split)]
    want = reg == 0 or all(reg <= c <= stages + reg for c in counts)
    assert cfg.share_fits(k) == want


@settings(max_examples=300, deadline=None)
@given(m=st.integers(1, 16), n=st.integers(1, 30000), k=st.integers(1, 4000).map(lambda x: 8 * x))
def test_register_tile_heuristic_only_names_configs_that_fit_two_to_an_sm(m, n, k):
    """Where it names a configuration: launchable, every block's share fits its register tiles and resident A,
    two blocks fit an SM's shared memory, at most 1.7 blocks an SM, three register tiles at most above M = 8 (four
    overflow a register sub-partition there), a weight of 4 MB or more."""
    cfg = cute_config.register_tile_heuristic(m, n, k)
    if cfg is None:
        return
    assert cfg.invalid() is None and cfg.share_fits(k) and cfg.reg_stages >= 1
    assert 2 * (cfg.smem_bytes(m) + 1024) <= 228 * 1024
    assert cfg.blocks(n) <= 1.7 * 132 and n * k * 2 >= 4e6
    assert m <= 8 or cfg.reg_stages * cfg.block_k <= 3 * 128


def test_register_tile_heuristic_gives_the_measured_forms():
    """On the shapes whose register-tile picks were measured (the H200 table's static rows), the rule lands on the
    same division of the work."""
    h = cute_config.register_tile_heuristic
    for key in [(16, 896, 7168), (8, 1536, 7168), (16, 1536, 7168), (1, 7168, 1536), (16, 7168, 1536),
                (1, 2304, 1536), (16, 7168, 768)]:
        pick = H200.get("bfloat16", *key, True).configs["cute"]
        got = h(*key)
        assert (got.block_k, got.stages, got.split_k, got.reg_stages) == \
            (pick.block_k, pick.stages, pick.split_k, pick.reg_stages), key
    assert h(16, 2112, 7168) is None      # 264 blocks in clusters of 8 lost; fewer leave shares of 10+ tiles
    assert h(1, 512, 1024) is None        # 1 MB: not measured


@settings(max_examples=300, deadline=None)
@given(m=st.integers(1, 16), n=st.integers(1, 300), k=st.integers(1, 4000).map(lambda x: 8 * x))
def test_few_rows_heuristic_only_names_launchable_splits_of_a_long_k(m, n, k):
    """Where it names a configuration: at most two row tiles, K >= 4096 split over a cluster of 8 whose every share
    fits its ring, one block's shared memory within an SM's, the next kernel let in first (a static weight)."""
    cfg = cute_config.few_rows_heuristic(m, n, k)
    if cfg is None:
        assert n > 128 or k < 4096
        return
    assert n <= 128 and k >= 4096 and cfg.split_k == 8 and cfg.trigger_first and cfg.push_partials
    assert cfg.invalid() is None and cfg.share_fits(k) and cfg.smem_bytes(m) + 1024 <= 228 * 1024


def test_few_rows_heuristic_gives_the_measured_form():
    """KDA's f_a (128 x 7168) and beta (12 x 7168) products, measured in a chain on the H200; at 576 rows the
    register tiles stay (they won there)."""
    for m, n in [(1, 128), (8, 128), (1, 12), (8, 12)]:
        assert cute_config.heuristic(m, n, 7168, True).tag() == "wg-n64-k128-s7-c8-pw-h-pp-tf"
    assert cute_config.heuristic(1, 576, 7168, True) == cute_config.register_tile_heuristic(1, 576, 7168)
    assert isinstance(cute_config.heuristic(1, 128, 7168, False), configs.MmaConfig)   # no static weight: unmeasured


def test_a_share_that_does_not_fit_is_refused_before_compiling():
    a, w = torch.randn(4, 7168, dtype=torch.bfloat16), torch.randn(896, 7168, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="share of K=7168"):   # 56 tiles over 8 blocks: 7 a block, 2 + 3 hold 5
        kc.skinny_gemm_cute(a, w, None, None, C(block_n=64, block_k=128, stages=2, split_k=8, producer_warp=True,
                                                reg_stages=3), static_weight=True)
    with pytest.raises(ValueError, match="share of K=1024"):   # 8 tiles over 8 blocks: 1 a block, 2 register tiles
        kc.skinny_gemm_cute(a[:, :1024], w[:, :1024], None, None, C(block_n=64, block_k=128, stages=2, split_k=8,
                                                                    producer_warp=True, reg_stages=2))


@settings(max_examples=60, deadline=None)
@given(block_n=st.sampled_from([64, 128]), m=st.integers(1, 16), split_k=st.integers(2, 16), data=st.data())
def test_push_slots_tile_the_receive_buffer_and_a_warps_stores_are_contiguous(block_n, m, split_k, data):
    """Every (rank, quarter, thread) 16-byte piece an owner group receives has its own place inside ``push_slots``,
    and one st.async of a warp (fixed rank and quarter, consecutive threads of a group) writes consecutive 16 bytes
    (the [rank, thread, fragment] layout wrote every other 16 bytes with 8-float fragments)."""
    cfg = C(block_n=block_n, block_k=128, stages=4, split_k=split_k, push_partials=True,
            owners=data.draw(st.integers(0, split_k), label="owners"))
    owners, frag = cfg.push_owners(), block_n * configs.m_pad(m) // 128
    group = -(-128 // owners)
    sizes = {((o + 1) * 128 + owners - 1) // owners - (o * 128 + owners - 1) // owners for o in range(owners)}
    assert max(sizes) == group   # the kernel's groups (thread t -> owner t·R // 128) are at most ⌈128 / R⌉ threads
    offsets = [configs.push_slot(r, v, t, group, frag) for r in range(split_k) for v in range(frag // 4)
               for t in range(group)]
    assert len(set(offsets)) == len(offsets)
    assert all(o % 4 == 0 and 0 <= o <= cfg.push_slots(m) - 4 for o in offsets)
    r, v = data.draw(st.integers(0, split_k - 1), label="rank"), data.draw(st.integers(0, frag // 4 - 1), label="v")
    warp = [configs.push_slot(r, v, t, group, frag) for t in range(min(group, 32))]
    assert warp == list(range(warp[0], warp[0] + 4 * len(warp), 4))


def test_table_entries_are_valid():
    assert table_picks(False) and table_picks(True)
    for static_weight in (False, True):
        for (mb, n, k), cfg in table_picks(static_weight).items():
            assert mb in (1, 2, 4, 8, 16) and cfg.invalid() is None and cfg.share_fits(k), (mb, n, k, cfg)
            assert n >= 1 and k % 8 == 0


@needs_cutlass
def test_compiles_for_sm90a_without_gpu(monkeypatch, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("GPU present: the GPU tests compile for the real device")
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    monkeypatch.setenv("K3_CUTE_CACHE_DIR", str(tmp_path))
    cc.fingerprint.cache_clear()
    try:
        fn = cc.compile_kernel(torch.bfloat16, 12, C(block_n=64, block_k=64, stages=4, split_k=2, producer_warp=True,
                                                     evict_hints=True), True, True, True)
    finally:
        cc.fingerprint.cache_clear()
    assert fn is not None
    assert any(p.suffix == ".so" for p in tmp_path.rglob("*"))


@settings(deadline=None, max_examples=200)
@given(bn=st.sampled_from([64, 128]), bk=st.sampled_from([64, 128]), stages=st.integers(2, 16),
       split=st.integers(1, 8), m=st.integers(1, 16))
def test_fused_tail_budget_fits_shared_memory(bn, bk, stages, split, m):
    """The fused tail's layout (ring of weight tiles, resident A tiles with their g and barriers) fits wherever the
    plain kernel's does, with room for at least one A tile, and never more than 64."""
    c = C(block_n=bn, block_k=bk, stages=stages, split_k=split)
    if c.invalid() is not None:
        return
    assert 1 <= c.norm_a_tiles(m) <= 64
    assert c.smem_bytes(m, norm=True) <= configs.SMEM_LIMIT
    assert c.smem_bytes(m, norm=True) + c._norm_per_tile(m) > configs.SMEM_LIMIT or c.norm_a_tiles(m) == 64


def test_fused_tail_variant_name_spells_the_exact_eps():
    key = (torch.bfloat16, 4, C(), False, True, False)
    plain, norm5, norm6 = (cc.variant_name(key + (e, False)) for e in (None, 1e-5, 1e-6))
    assert "_norm" not in plain and len({plain, norm5, norm6}) == 3


def test_fp32_output_is_its_own_variant():
    bf16 = cc.variant(torch.bfloat16, 4, C(), False, False)
    fp32 = cc.variant(torch.bfloat16, 4, C(), False, False, out_fp32=True)
    assert bf16 != fp32 and cc.variant_name(fp32) == cc.variant_name(bf16) + "_o32"


# ---------------------------------------------------------------------------------------- GPU tests

# a fp32 output holds the fp32 sums unrounded: a 16-bit rounding anywhere would miss this by ~100x
FP32_OUT_TOL = 2e-5


def _run(m, n, k, dtype, bias, residual, cfg=None, static_weight=False, out_shift=0, out_dtype=None):
    """One product against the float64 reference, into a NaN-poisoned ``out`` (contiguous, its start ``out_shift``
    elements past a 256-byte aligned one); ``out_dtype=float32``: out and residual fp32."""
    torch.manual_seed(m * 7 + n + k)
    out_dtype = out_dtype or dtype
    a = torch.randn(m, k, device="cuda", dtype=dtype)
    w = torch.randn(n, k, device="cuda", dtype=dtype) * k ** -0.5
    b = torch.randn(n, device="cuda", dtype=dtype) if bias else None
    r = torch.randn(m, n, device="cuda", dtype=out_dtype) if residual else None
    assert cute_can_run_on(a, w, b, r) is None and kc.supports(a, w, b, r, out_dtype) is None
    out = torch.full((m * n + 8,), float("nan"), device="cuda", dtype=out_dtype)[out_shift:out_shift + m * n]
    kc.skinny_gemm_cute(a, w, b, r, cfg or op_config(m, n, k, static_weight), out=out.view(m, n),
                        static_weight=static_weight, out_dtype=out_dtype)
    torch.cuda.synchronize()
    ref = skinny_gemm_reference(a.double(), w.double(), None if b is None else b.double(),
                                None if r is None else r.double())
    assert not out.isnan().any(), "unwritten or NaN outputs"
    e = rel_err(out.view(m, n), ref)
    assert e < (FP32_OUT_TOL if out_dtype == torch.float32 and dtype != out_dtype else tol(dtype)), f"rel={e:.2e}"


GPU_CONFIGS = [C(block_n=64, block_k=64, stages=4, split_k=1),
               C(block_n=64, block_k=64, stages=8, split_k=3),
               C(block_n=128, block_k=64, stages=6, split_k=2),
               C(block_n=64, block_k=128, stages=4, split_k=4),
               C(block_n=128, block_k=128, stages=3, split_k=1),
               C(block_n=64, block_k=64, stages=4, split_k=1, producer_warp=True),
               C(block_n=128, block_k=64, stages=6, split_k=3, producer_warp=True, evict_hints=True, early=True),
               C(block_n=64, block_k=64, stages=6, split_k=2, producer_warp=True, mma_trigger=True),
               C(block_n=64, block_k=128, stages=6, split_k=1, evict_hints=True, trigger_first=True),
               C(block_n=64, block_k=64, stages=6, split_k=3, producer_warp=True, evict_hints=True, trigger_first=True),
               C(block_n=64, block_k=64, stages=6, split_k=3, producer_warp=True, evict_hints=True, push_partials=True),
               C(block_n=128, block_k=64, stages=4, split_k=2, push_partials=True),
               C(block_n=64, block_k=128, stages=4, split_k=8, producer_warp=True, evict_hints=True, trigger_first=True,
                 push_partials=True),
               C(block_n=64, block_k=64, stages=3, split_k=16, producer_warp=True, evict_hints=True, trigger_first=True,
                 push_partials=True, owners=4),
               C(block_n=64, block_k=64, stages=6, split_k=3, producer_warp=True, evict_hints=True, push_partials=True,
                 owners=1),
               # register tiles: K 2056 gives shares of 2-3 tiles of 128 (a block with no ring MMAs, and one with)
               # and of 4-5 tiles of 64; block_n 128 (two m64 tiles) with the partial tiles read, not pushed
               C(block_n=64, block_k=128, stages=2, split_k=8, producer_warp=True, evict_hints=True, trigger_first=True,
                 push_partials=True, owners=2, reg_stages=2),
               C(block_n=64, block_k=64, stages=3, split_k=8, producer_warp=True, evict_hints=True, push_partials=True,
                 reg_stages=2),
               C(block_n=128, block_k=64, stages=3, split_k=8, producer_warp=True, evict_hints=True, reg_stages=2)]


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", GPU_CONFIGS, ids=lambda c: c.tag())
@pytest.mark.parametrize("m", [1, 5, 8, 12, 16], ids=lambda m: f"M{m}")
@pytest.mark.parametrize("static_weight", [False, True], ids=["dynamic_w", "static_w"])
def test_every_config_matches_reference(cfg, m, static_weight):
    # N = 1000: not a multiple of 64/128 rows; K = 2056: a partial last K tile
    _run(m, 1000, 2056, torch.bfloat16, True, True, cfg=cfg, static_weight=static_weight)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [C(block_n=128, block_k=64, stages=4, split_k=2, push_partials=True),
                                 C(block_n=64, block_k=64, stages=3, split_k=16, producer_warp=True, evict_hints=True,
                                   trigger_first=True, push_partials=True, owners=4),
                                 C(block_n=64, block_k=64, stages=6, split_k=3, producer_warp=True, evict_hints=True,
                                   push_partials=True, owners=1)], ids=lambda c: c.tag())
@pytest.mark.parametrize("n,out_shift", [(1000, 0), (1000, 1), (1003, 0)], ids=["N1000", "N1000-C+2B", "N1003"])
@pytest.mark.parametrize("m", [5, 16], ids=lambda m: f"M{m}")
def test_owner_stores_any_c_alignment(cfg, n, out_shift, m):
    """Owner groups of whole warps store C in 16-byte pieces: where C's start or row stride (N = 1003) is not
    16-byte aligned, and at the N tail, they take 2-byte stores; every element written (NaN-poisoned)."""
    _run(m, n, 2056, torch.bfloat16, True, True, cfg=cfg, out_shift=out_shift)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("bias,residual", [(False, False), (True, False), (False, True), (True, True)],
                         ids=["plain", "bias", "res", "bias-res"])
@pytest.mark.parametrize("m", [8, 16], ids=lambda m: f"M{m}")
def test_dtypes_and_epilogues(dtype, bias, residual, m):
    _run(m, 300, 520, dtype, bias, residual, cfg=C(block_n=64, block_k=64, stages=4, split_k=2))


FP32_OUT_CONFIGS = [C(block_n=64, block_k=64, stages=4, split_k=1),                       # one block, read tile
                    C(block_n=128, block_k=64, stages=6, split_k=3, producer_warp=True),   # partial tiles read
                    C(block_n=128, block_k=64, stages=4, split_k=2, push_partials=True),   # owners: 16-byte pieces
                    C(block_n=64, block_k=64, stages=6, split_k=3, producer_warp=True, evict_hints=True,
                      push_partials=True, owners=3),                                      # owners sharing warps
                    C(block_n=64, block_k=128, stages=2, split_k=8, producer_warp=True, evict_hints=True,
                      trigger_first=True, push_partials=True, owners=2, reg_stages=2)]


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", FP32_OUT_CONFIGS, ids=lambda c: c.tag())
@pytest.mark.parametrize("n,out_shift", [(1000, 0), (1000, 1), (1003, 0)], ids=["N1000", "N1000-C+4B", "N1003"])
@pytest.mark.parametrize("m", [1, 5, 16], ids=lambda m: f"M{m}")
def test_fp32_output_every_store_path(cfg, n, out_shift, m):
    """bf16 operands, fp32 C and residual (the upcast product): each epilogue's stores (read partial tiles, owners'
    16-byte pieces of 4 floats, owners sharing warps, a misaligned C or row stride, the N tail) write every
    element (NaN-poisoned), unrounded."""
    _run(m, n, 2056, torch.bfloat16, True, True, cfg=cfg, out_shift=out_shift, static_weight=True,
         out_dtype=torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, 4, 8, 16], ids=lambda m: f"M{m}")
@pytest.mark.parametrize("static_weight", [False, True], ids=["dynamic_w", "static_w"])
def test_fp32_output_router_table_picks(m, static_weight):
    """K3's router (896 x 7168, fp32 logits) at the table's picks for its 16-bit shape, as the op runs it."""
    _run(m, 896, 7168, torch.bfloat16, False, False, static_weight=static_weight, out_dtype=torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [12, 128, 100], ids=lambda n: f"N{n}")
@pytest.mark.parametrize("m", [1, 8, 16], ids=lambda m: f"M{m}")
def test_few_rows_heuristic_matches_reference(n, m):
    """The few-rows split (eight blocks over K = 7168, partials pushed) at KDA's f_a / beta widths and a ragged one:
    every element written (NaN-poisoned), as the dispatch runs it for a static weight."""
    cfg = cute_config.heuristic(m, n, 7168, True)
    assert cfg == cute_config.few_rows_heuristic(m, n, 7168)
    _run(m, n, 7168, torch.bfloat16, True, True, cfg=cfg, static_weight=True)


REGISTER_TILES = C(block_n=64, block_k=128, stages=2, split_k=8, producer_warp=True, evict_hints=True,
                   trigger_first=True, push_partials=True, owners=2, reg_stages=2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("m", [5, 16], ids=lambda m: f"M{m}")
def test_register_tiles_in_either_dtype(dtype, m):
    """The register tiles' path (ldmatrix, then the weight from registers in RS wgmma) in fp16 as in bf16."""
    _run(m, 1000, 2056, dtype, True, True, cfg=REGISTER_TILES, static_weight=True)


@pytest.mark.gpu
@settings(deadline=None)
@given(n=st.integers(1, 5000), k=st.integers(1, 1200).map(lambda x: 8 * x), residual=st.booleans())
@example(n=7168, k=3584, residual=True)
@example(n=896, k=7168, residual=False)
def test_random_shapes_table_config(n, k, residual):
    _run(16, n, k, torch.bfloat16, False, residual, cfg=C(block_n=64, block_k=64, stages=8, split_k=3))


UNLISTED = [(1024, 7168), (384, 7168), (3000, 1000)]   # 3000x1000: a partial row tile and a partial K tile of 64


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", UNLISTED, ids=lambda nk: f"{nk}")
@pytest.mark.parametrize("m", [1, 9, 16], ids=lambda m: f"M{m}")
def test_unlisted_static_shapes_take_register_tiles(n, k, m):
    """Shapes no table lists, with a static weight: the register-tile heuristic's configuration, end to end."""
    cfg = op_config(m, n, k, static_weight=True)
    assert cfg.reg_stages and cfg == cute_config.register_tile_heuristic(m, n, k)
    _run(m, n, k, torch.bfloat16, True, True, static_weight=True)


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(16, 7168, 3584), (8, 3584, 7168), (16, 896, 7168), (12, 4608, 7168)],
                         ids=["M16-N7168-K3584", "M8-N3584-K7168", "M16-N896-K7168", "M12-N4608-K7168"])
def test_decode_shapes_chosen_config(m, n, k):
    _run(m, n, k, torch.bfloat16, False, True)


CHAINED_CONFIGS = [C(block_n=64, block_k=64, stages=8, split_k=2),
                   C(block_n=64, block_k=128, stages=6, split_k=2, producer_warp=True, evict_hints=True,
                     trigger_first=True),
                   C(block_n=64, block_k=128, stages=4, split_k=8, producer_warp=True, evict_hints=True,
                     trigger_first=True, push_partials=True),
                   C(block_n=64, block_k=64, stages=2, split_k=16, producer_warp=True, evict_hints=True,
                     trigger_first=True, push_partials=True, owners=2),
                   C(block_n=64, block_k=128, stages=2, split_k=8, producer_warp=True, evict_hints=True,
                     trigger_first=True, push_partials=True, owners=4, reg_stages=1)]


def compiled_variants():
    """Every (dtype, M, config, bias?, residual?, static?) the GPU tests run, so that a CPU host can compile them
    for sm_90a into the disk cache the GPU run then loads (``CUTE_DSL_ARCH=sm_90a``, ``K3_CUTE_CACHE_DIR``)."""
    bf, out = torch.bfloat16, []
    out += [(bf, m, c, True, True, st) for c in GPU_CONFIGS for m in (1, 5, 8, 12, 16) for st in (False, True)]
    out += [(dt, m, C(block_n=64, block_k=64, stages=4, split_k=2), b, r, False) for dt in (bf, torch.float16)
            for b, r in ((False, False), (True, False), (False, True), (True, True)) for m in (8, 16)]
    out += [(bf, 16, C(block_n=64, block_k=64, stages=8, split_k=3), False, r, False) for r in (False, True)]
    out += [(dt, m, REGISTER_TILES, True, True, True) for dt in (bf, torch.float16) for m in (5, 16)]
    out += [(bf, m, op_config(m, n, k, True), True, True, True) for n, k in UNLISTED for m in (1, 9, 16)]
    out += [(bf, m, op_config(m, n, k), False, True, False)
            for m, n, k in [(16, 7168, 3584), (8, 3584, 7168), (16, 896, 7168), (12, 4608, 7168)]]
    out += [(bf, 16, c, False, False, st) for c in CHAINED_CONFIGS for st in (False, True)]
    out += [(bf, mb, cfg, False, True, st) for st in (False, True) for (mb, n, k), cfg in table_picks(st).items()]
    return list(dict.fromkeys(out))


@pytest.mark.gpu
@pytest.mark.parametrize("static_weight", [False, True], ids=["dynamic_w", "static_w"])
def test_table_picks_match_reference(static_weight):
    """Every measured pick, at its M bucket and real shape, with a residual (what the table hands the op)."""
    for (mb, n, k), cfg in table_picks(static_weight).items():
        _run(mb, n, k, torch.bfloat16, False, True, cfg=cfg, static_weight=static_weight)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", CHAINED_CONFIGS, ids=lambda c: c.tag())
@pytest.mark.parametrize("static_weight", [False, True], ids=["dynamic_w", "static_w"])
def test_cuda_graph_chained_products(cfg, static_weight):
    """Each product reads the one before (PDL: the wait must hold A's loads, however early the trigger), captured
    once, replayed on fresh data."""
    dtype, m, d = torch.bfloat16, 16, 2048
    ws = [torch.randn(d, d, device="cuda", dtype=dtype) * d ** -0.5 for _ in range(3)]
    x = torch.randn(m, d, device="cuda", dtype=dtype)
    kc.warmup(dtype, m, cfg, static_weight=static_weight)

    def chain():
        h = x
        for w in ws:
            h = kc.skinny_gemm_cute(h, w, None, None, cfg, static_weight=static_weight)
        return h

    chain()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        with torch.cuda.graph(g):
            out = chain()
    torch.cuda.current_stream().wait_stream(s)
    check_chain_replays(g, x, out, ws, 2 * tol(dtype))
