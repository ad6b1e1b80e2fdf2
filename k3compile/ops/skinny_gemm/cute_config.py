"""The CuTe skinny GEMM's configuration for a shape no table lists: per-kernel heuristics read off the H200 sweeps
(``docs/tuning/skinny_gemm.md``). The measured picks are in ``tables/<gpu>.json``; ``dispatch.py`` chooses."""
from __future__ import annotations

import functools
from typing import Optional

from k3compile.kernels.cute.configs import K_STEP, SMEM_PER_SM, MmaConfig, WgmmaConfig


def mma_heuristic(m: int, n: int, k: int) -> MmaConfig:
    """The mma.sync kernel, one 8-row group per warp.

    Long K: the weight through a cp.async ring (8 K-warps x 2 steps x 3 stages) with the first 2 KB of each row
    pulled into L2 before the PDL wait; where N is small, split over a cluster of 2 blocks (few row blocks must still
    fill the SMs) that prefetch their whole share into L2 and let the next kernel in early. Short K: straight to
    registers, 4 K-warps x 4 steps; a small weight (<= 12 MB) is prefetched whole into L2 with the early trigger, so
    the next product's weight streams while this one finishes. K-warps are halved while a warp would get no chunk.
    """
    row_kb = k * 2 * 8 // 1024  # one 8-row group's whole K, in KB
    split_k, early, l2_kb = 1, False, 0
    if k >= 4096:
        warps_k, unroll, stages, l2_kb = 8, 2, 3, 16
        if n <= 1024:
            split_k, early, l2_kb = 2, True, row_kb // 2
    else:
        warps_k, unroll, stages = 4, 4, 1
        if n * k * 2 <= 12e6:
            early, l2_kb = True, row_kb
    chunks = k // (K_STEP * unroll)
    while warps_k > 1 and chunks < warps_k * split_k:
        warps_k //= 2
    return MmaConfig(row_groups=1, warps_n=1, warps_k=warps_k, unroll=unroll, stages=stages, split_k=split_k,
                     early=early, l2_kb=l2_kb)


@functools.lru_cache(maxsize=4096)   # the dispatch asks on every call of an unlisted static shape
def register_tile_heuristic(m: int, n: int, k: int, sms: int = 132) -> Optional[WgmmaConfig]:
    """(static weight) The wgmma kernel with register tiles, where a block can hold its whole K share with two
    blocks to an SM; None elsewhere.

    - row tiles of 64; the most split-K blocks (a cluster of 1, 2, 4 or 8) that keep at most 1.7 blocks an SM
      (more left the next product nowhere to go) and a share of 3 to 8 tiles of 128;
    - a share of 5-8 tiles of 128: share - 2 register tiles, at most 4 (3 above M = 8: four need 176 registers
      there, too many for two blocks); a share of 3-4: tiles of 64, half of them in registers;
    - the partials pushed to 2 owners in clusters of 4-8 (every block owns in clusters of 2-3);
    - weights of 4 MB or more (nothing smaller was measured), and only where two blocks fit an SM.
    """
    if n * k * 2 < 4e6:
        return None
    rows, kt = -(-n // 64), -(-k // 128)
    splits = [s for s in (1, 2, 4, 8) if rows * s <= 1.7 * sms and 3 <= -(-kt // s) <= 8]
    if not splits:
        return None
    split = max(splits)
    share = -(-kt // split)
    if share >= 5:
        bk, reg = 128, min(share - 2, 4 if m <= 8 else 3)
    else:
        bk, share = 64, -(-(-(-k // 64)) // split)
        reg = share // 2
    cfg = WgmmaConfig(block_n=64, block_k=bk, stages=share - reg, split_k=split, producer_warp=True, evict_hints=True,
                      trigger_first=True, push_partials=split > 1, owners=2 if split >= 4 else 0, reg_stages=reg)
    two_fit = cfg.smem_bytes(m) + 1024 <= SMEM_PER_SM // 2   # 1 KB of every block's shared memory is the system's
    return cfg if cfg.invalid() is None and cfg.share_fits(k) and two_fit else None


def heuristic(m: int, n: int, k: int, static_weight: bool) -> MmaConfig | WgmmaConfig:
    """The configuration for a shape no table lists: with a static weight the register tiles where they fit, or K
    split eight ways where the weight has few rows, else the mma.sync kernel."""
    if static_weight:
        cfg = register_tile_heuristic(m, n, k) or few_rows_heuristic(m, n, k)
        if cfg is not None:
            return cfg
    return mma_heuristic(m, n, k)


@functools.lru_cache(maxsize=4096)   # the dispatch asks on every call of an unlisted static shape
def few_rows_heuristic(m: int, n: int, k: int) -> Optional[WgmmaConfig]:
    """(static weight) At most two row tiles of 64 over a long K (KDA's 128 x 7168 and 12 x 7168 products): the
    wgmma kernel with K split over a cluster of 8 blocks, each share through its own ring, the partials pushed, the
    next kernel let in first. The mma.sync kernel runs such a weight in 2-32 blocks, each streaming a long slice
    alone: 5.6 against 1.3 µs at 128 x 7168 and M 1, 3.2 against 1.1 at 12 x 7168, in a chain behind the product
    that makes the input (the H200; ``docs/tuning/skinny_gemm.md``). None elsewhere: at 576 and 768 rows the
    register tiles or the mma.sync kernel win."""
    if -(-n // 64) > 2 or k < 4096:
        return None
    tiles = -(-k // 128)
    share = -(-tiles // 8)      # K tiles a block; a longer share cycles a ring of 8
    cfg = WgmmaConfig(block_n=64, block_k=128, stages=min(8, share), split_k=8, producer_warp=True, evict_hints=True,
                      trigger_first=True, push_partials=True)
    fits = cfg.smem_bytes(m) + 1024 <= SMEM_PER_SM
    return cfg if cfg.invalid() is None and cfg.share_fits(k) and fits else None
