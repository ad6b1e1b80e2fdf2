"""The skinny GEMM's Triton configuration (``ops/skinny_gemm/triton_config.py``): the heuristic's rules on GPUs of
several SM counts, the H200 table's picks where it lists one, and where the dispatch takes Triton over cuBLAS. CPU
only: nothing here launches a kernel."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from k3compile.ops.skinny_gemm import dispatch
from k3compile.ops.skinny_gemm.triton_config import TritonConfig, heuristic


def test_config_heuristic_splits_k_only_on_gpu():
    assert heuristic(4, 2112, 7168, 0).split_k == 1
    cfg = heuristic(4, 2112, 7168, 132)
    assert cfg.split_k > 1 and cfg.block_m == 16 and cfg.one_launch
    assert heuristic(40, 7168, 2048, 132).block_m == 64


@pytest.mark.parametrize("n,k", [(896, 7168), (2112, 7168), (4608, 7168), (7168, 1536), (163840, 7168), (64, 7168)],
                         ids=lambda v: str(v))
def test_config_heuristic_fills_the_gpu_without_starving_splits(n, k):
    """About four programs per SM where K allows, never fewer than 7 K blocks per split."""
    for sms in (132, 114, 78):
        cfg = heuristic(1, n, k, sms)
        grid = -(-n // cfg.block_n) * cfg.split_k
        assert cfg.split_k == 1 or -(-k // cfg.block_k) // cfg.split_k >= 7
        assert grid >= min(sms, -(-n // cfg.block_n) * (-(-k // cfg.block_k) // 7))


@pytest.mark.parametrize("n,k", [(4608, 7168), (3584, 7168), (7168, 3584), (2112, 7168), (7168, 2048)],
                         ids=lambda v: str(v))
def test_config_heuristic_fits_two_products_per_sm_with_few_splits(n, k):
    """TMA, M <= 16: PDL (split grids: ``POLLED_TAIL``, else the early trigger), in the grid with the fewest K
    splits that has
    ``MIN_PER_SM`` programs per SM and fits beside the next product's grid (2 x per-SM count <= residency),
    pipelined deep enough for ``IN_FLIGHT_PER_SM`` of weight tiles per SM (or as deep as the loop /
    MAX_STAGES allow). (GPUs of 114 and 78 SMs too: the rule, not the H200's table.)"""
    from k3compile.ops.skinny_gemm.triton_config import (IN_FLIGHT_PER_SM, MAX_STAGES, MIN_PER_SM, _dot_heuristic,
                                                         resident_per_sm)

    for sms in (132, 114, 78):
        for m in (1, 8, 16):
            if (sms, n, k) == (132, 2112, 7168):
                continue  # the H200's table lists another pick, and the rule lands elsewhere
            cfg = _dot_heuristic(m, n, k, sms)  # (one row may take FMA_ROW instead: the next test)
            tiles = -(-n // cfg.block_n)
            grid = tiles * cfg.split_k
            k_blocks = -(-k // cfg.block_k)
            flavour = (True, False, 2, 0, True, True) if cfg.split_k > 1 else (True, True, 0, 0, True, False)
            assert (cfg.pdl, cfg.early_trigger, cfg.prefetch_lines, cfg.preload, cfg.tma, cfg.poll) == flavour
            assert grid >= MIN_PER_SM[cfg.split_k > 1] * sms and 2 * -(-grid // sms) <= resident_per_sm(cfg)
            in_flight = grid / sms * (cfg.num_stages - 1) * cfg.block_n * cfg.block_k * 2
            assert in_flight >= IN_FLIGHT_PER_SM or cfg.num_stages in (MAX_STAGES, k_blocks // cfg.split_k)
            for s in range(1, cfg.split_k):  # no smaller split with enough programs fits twice at depth 3
                if tiles * s >= MIN_PER_SM[s > 1] * sms and -(-k_blocks // -(-k_blocks // s)) == s:
                    shallow = dataclasses.replace(cfg, split_k=s, num_stages=3)
                    assert 2 * -(-tiles * s // sms) > resident_per_sm(shallow) or \
                        tiles * s / sms * 2 * cfg.block_n * cfg.block_k * 2 < IN_FLIGHT_PER_SM


@pytest.mark.parametrize("n,k,split,stages,fma_stages", [(4608, 7168, 3, 3, 4), (3584, 7168, 3, 4, 5),
                                                         (7168, 3584, 1, 5, None), (7168, 2048, 1, 5, None),
                                                         (2112, 7168, 4, 4, None)], ids=lambda v: str(v))
def test_config_heuristic_picks_the_h200_winners(n, k, split, stages, fma_stages):
    from k3compile.ops.skinny_gemm.triton_config import FMA_ROW

    h200 = dispatch.Gpu(dispatch.table_for("NVIDIA H200"), 132)
    for m in (1, 2, 4, 8, 16):
        cfg = dispatch.triton_config_for(torch.bfloat16, m, n, k, h200)   # the table's pick, else the rule's
        if m == 1 and fma_stages:
            assert cfg == dataclasses.replace(FMA_ROW, block_m=m, num_stages=fma_stages)
        else:
            assert (cfg.split_k, cfg.num_stages, cfg.num_warps, cfg.block_n) == (split, stages, 2, 32)
            assert cfg.poll == (split > 1 and n != 2112)


@pytest.mark.parametrize("n,k,sms,fma_row", [
    pytest.param(4608, 7168, 132, True, id="4608x7168-132SM-fits"),
    pytest.param(4608, 7168, 78, False, id="4608x7168-78SM-twice-past-residency"),
    pytest.param(7168, 3584, 132, False, id="7168x3584-unsplit-dot"),
    pytest.param(2560, 7168, 132, False, id="2560x7168-thin-grid"),
    pytest.param(20480, 7168, 132, False, id="20480x7168-unsplit-dot"),
])
def test_config_one_row_takes_fma_row_only_where_the_dot_grid_splits_and_both_fit(n, k, sms, fma_row):
    """FMA_ROW (no K split, block_m = M) replaces a split tensor-core grid for one row where its grid holds >= 3
    programs per SM and fits beside the next product's (2 x per-SM count <= FMA_ROW_RESIDENT); two rows and
    more keep the tensor cores."""
    from k3compile.ops.skinny_gemm.triton_config import FMA_ROW, FMA_ROW_MIN_PER_SM, FMA_ROW_RESIDENT

    cfg = heuristic(1, n, k, sms)
    assert (cfg == dataclasses.replace(FMA_ROW, block_m=1, num_stages=cfg.num_stages)) == fma_row
    programs = -(-n // FMA_ROW.block_n)
    if fma_row:
        assert programs >= FMA_ROW_MIN_PER_SM * sms and 2 * -(-programs // sms) <= FMA_ROW_RESIDENT
    assert not any(heuristic(m, n, k, sms).fma for m in (2, 3, 16))


def test_config_heuristic_triggers_late_where_two_grids_do_not_fit():
    big = heuristic(1, 20480, 7168, 132)          # 640 column tiles: 5 per SM, twice is past residency
    assert big.pdl and not big.early_trigger and big.split_k == 1
    assert not heuristic(32, 4608, 7168, 132).pdl and not heuristic(1, 896, 7168, 132).pdl


@pytest.mark.parametrize("block_n,stages,resident", [(32, 3, 9), (32, 4, 6), (32, 5, 4), (64, 3, 5), (64, 4, 3)],
                         ids=lambda v: str(v))
def test_resident_per_sm_matches_the_h200_occupancy_calculator(block_n, stages, resident):
    """The driver's counts for these bf16 configs on the H200 (cuOccupancyMaxActiveBlocksPerMultiprocessor): shared
    memory bounds them."""
    from k3compile.ops.skinny_gemm.triton_config import resident_per_sm

    assert resident_per_sm(TritonConfig(block_m=16, block_n=block_n, block_k=128, split_k=1,
                                        num_stages=stages)) == resident


def test_config_table_applies_only_to_a_gpu_of_its_sm_count():
    """The table's Triton picks are grids sized for its GPU's SMs: another GPU's SM count takes the heuristic."""
    table = dispatch.table_for("NVIDIA H200")
    (dt, m, n, k, static), pick = next((key, p) for key, p in table.picks.items() if "triton" in p.configs)
    dtype = getattr(torch, dt)
    assert dispatch.triton_config_for(dtype, m, n, k, dispatch.Gpu(table, table.sms)) == pick.configs["triton"]
    assert dispatch.triton_config_for(dtype, m, n, k, dispatch.Gpu(table, table.sms - 18)) == \
        heuristic(m, n, k, table.sms - 18)


@pytest.mark.parametrize("m,n,k,wins", [
    pytest.param(1, 4608, 7168, True, id="M1-4608x7168-triton"),
    pytest.param(16, 20480, 7168, True, id="M16-20480x7168-triton"),
    pytest.param(4, 7168, 3584, True, id="M4-7168x3584-triton"),
    pytest.param(8, 7168, 3584, True, id="M8-7168x3584-triton"),
    pytest.param(16, 3584, 7168, True, id="M16-3584x7168-triton"),
    pytest.param(16, 7168, 3584, True, id="M16-7168x3584-triton"),
    pytest.param(1, 7168, 2048, True, id="M1-7168x2048-triton"),
    pytest.param(32, 7168, 3584, False, id="M32-7168x3584-cublas"),
    pytest.param(1, 7168, 1536, False, id="M1-7168x1536-cublas"),
    pytest.param(1, 896, 7168, False, id="M1-896x7168-cublas"),
])
def test_triton_beats_cublas_follows_the_h200_figures(m, n, k, wins):
    assert dispatch.triton_beats_cublas(m, n, k) == wins
