"""Compile-time knobs of the Triton routed experts (``triton.py``) and how they are chosen: the measured picks of
this GPU (``tables/<gpu>.json``, written by ``benchmarks/moe_experts.py --table``), else the defaults below.
Nothing here launches a kernel."""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

DECODE_MAX_M = 16   # the decode kernels take a row per token: every token in one tile
MXFP4_GROUP = 32
TABLES = Path(__file__).resolve().parent / "tables"


@dataclass(frozen=True)
class MoeConfig:
    """Tiles and launch knobs of the kernels (gate/up: ``block_i`` rows of w1/w3 by ``block_l`` columns a step;
    down: ``block_n`` rows of w2 by ``block_k`` columns a step; ``block_m`` pairs a row chunk, sorted form)."""
    block_m: int = 16
    block_i: int = 32
    block_l: int = 128
    warps_up: int = 4
    stages_up: int = 4
    block_n: int = 64
    block_k: int = 128
    warps_down: int = 4
    stages_down: int = 3
    preload: bool = True     # the down kernel's first w2 tile loaded before its PDL wait
    mxfp4_halves: bool = False   # MXFP4: even and odd columns as two products (no interleaving of the codes)
    # bf16 on a GPU, with mxfp4_halves: the codes looked up in PTX (triton_tiles.E2M1_BF16_PTX); with weight_rows:
    # converted by bit moves in PTX (triton_tiles.E2M1_BF16_BITS_PTX)
    mxfp4_asm: bool = False
    mxfp4_dot_scaled: bool = False   # MXFP4 with bf16 / fp16 z on a GPU: the codes straight to tl.dot_scaled
    # the weights as the products' rows (acc [weight rows, tokens] = w @ zᵀ, a wgmma from 64 rows; gate/up: w1 and
    # w3 rows stacked in one tile), z loaded contiguous (MXFP4: split into even/odd columns in registers) so every
    # load of the K loop pipelines; MXFP4 always as even/odd halves (tl.dot_scaled is not used with it)
    weight_rows: bool = False
    # PDL: each kernel lets the next launch right after its own wait instead of after its K loop, so the next
    # kernel's programs are resident and stream their static weights (preload) while this one still runs
    trigger_early: bool = False
    # decode form: the down product and the combine in one kernel, a program per (token, block_n columns) looping
    # over the token's slots in order (no partials, no combine launch; an expert two tokens chose is read twice)
    down_by_token: bool = False
    # decode form: the gate/up programs of an (expert, i-tile) split L into this many slices (more programs, more
    # bytes in flight at a few tokens); each writes fp32 partial sums of gate and up, and the last of them to arrive
    # (an arrival counter, ``k3compile/ops/arrival_counters.py``) sums them in slice order and applies SiTU-GLU
    split_l: int = 1
    # decode form: the products as broadcast multiplies summed on the CUDA cores (no tl.dot), the tokens padded to a
    # power of two from 1 instead of tl.dot's 16 rows (a GEMV at one token); both products, not the by-token down
    gemv: bool = False
    # ptxas register caps a thread (Triton's ``maxnreg``, NVIDIA only; 0: none) of the gate/up and the down kernels:
    # more resident programs, so more loads in flight, at the price of spills
    maxnreg_up: int = 0
    maxnreg_down: int = 0

    def __post_init__(self):
        for name in ("block_m", "block_i", "block_l", "block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"MoeConfig.{name}={v}: a power of two >= 16")
        if self.block_l < MXFP4_GROUP or self.block_k < MXFP4_GROUP:
            raise ValueError("MoeConfig: block_l and block_k must cover whole MXFP4 groups (>= 32)")
        if self.split_l < 1:
            raise ValueError(f"MoeConfig.split_l={self.split_l}: >= 1")
        for name in ("maxnreg_up", "maxnreg_down"):
            v = getattr(self, name)
            if v and not 24 <= v <= 255:
                raise ValueError(f"MoeConfig.{name}={v}: 0 (no cap) or 24..255 registers")

    def tag(self) -> str:
        return (f"m{self.block_m}-i{self.block_i}-l{self.block_l}-w{self.warps_up}s{self.stages_up}"
                f"-n{self.block_n}-k{self.block_k}-w{self.warps_down}s{self.stages_down}"
                f"{'-pre' if self.preload else ''}{'-halves' if self.mxfp4_halves else ''}"
                f"{'-asm' if self.mxfp4_asm else ''}{'-dots' if self.mxfp4_dot_scaled else ''}"
                f"{'-rows' if self.weight_rows else ''}{'-early' if self.trigger_early else ''}"
                f"{'-bytoken' if self.down_by_token else ''}{f'-split{self.split_l}' if self.split_l > 1 else ''}"
                f"{'-gemv' if self.gemv else ''}{f'-r{self.maxnreg_up}' if self.maxnreg_up else ''}"
                f"{f'-rd{self.maxnreg_down}' if self.maxnreg_down else ''}")


def tuned_config(table: dict, m: int, dtype: torch.dtype, mxfp4: bool, i: int, l: int) -> Optional[MoeConfig]:
    """The measured pick of ``table`` (``tables/<gpu>.json`` "configs", written by ``benchmarks/moe_experts.py
    --table``) for this dtype, weight format and widths: the entry of the smallest measured M >= m, else of the
    largest, among the entries of m's side of ``DECODE_MAX_M`` (a pick measured on the decode kernels is never
    carried to the sorted form's Ms, nor the reverse); None where nothing was measured there."""
    fmt = "mxfp4" if mxfp4 else "float"
    decode = m <= DECODE_MAX_M
    entries = sorted((e for e in table.get("configs", []) if (e["dtype"], e["format"], e["I"], e["L"]) ==
                      (str(dtype).removeprefix("torch."), fmt, i, l) and (e["m"] <= DECODE_MAX_M) == decode),
                     key=lambda e: e["m"])
    if not entries:
        return None
    pick = next((e for e in entries if e["m"] >= m), entries[-1])
    return MoeConfig(**pick["config"])


def default_config(m: int, dtype: torch.dtype, mxfp4: bool, on_gpu: bool) -> MoeConfig:
    """Interpreter: large tiles (fewer, cheaper interpreted programs). GPU: the defaults above (fp32: half the
    columns a step, the tiles are twice the bytes); MXFP4 with bf16 z: even/odd halves through the PTX lookup
    (H200, TP=8 shapes: 1.27x the interleaved tile at M = 1, 1.23x at M = 16; docs/tuning/moe_experts.md)."""
    if not on_gpu:
        return MoeConfig(block_i=64, block_l=64, block_n=64, block_k=64, stages_up=1, stages_down=1)
    if dtype == torch.float32:
        return MoeConfig(block_l=64, block_k=64)
    if mxfp4 and dtype == torch.bfloat16:
        return MoeConfig(mxfp4_halves=True, mxfp4_asm=True)
    return MoeConfig()


def decode_form(m: int, a: int, small_m_limit: int) -> bool:
    """The decode kernels (programs find their tokens themselves, a row per token) up to the small-M limit and
    ``DECODE_MAX_M``; else the sorted form."""
    return m <= min(small_m_limit, DECODE_MAX_M)


@functools.cache
def _table_for(gpu: str) -> dict:
    path = TABLES / f"{gpu}.json"
    return json.loads(path.read_text()) if path.exists() else {}


def gpu_name(device: torch.device) -> Optional[str]:
    """The table name of a CUDA device ("h200"), None elsewhere or for a GPU without a table name."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device).lower()
    return "h200" if "h200" in name else None


def table(device: torch.device) -> dict:
    gpu = gpu_name(device)
    return _table_for(gpu) if gpu else {}


