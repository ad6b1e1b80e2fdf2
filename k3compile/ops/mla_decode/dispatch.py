"""Which implementation of ``k3::mla_decode`` runs, and how the Triton kernel is laid out: decided here only.

Order under ``backend="auto"``: Triton on any GPU (CPU tensors under ``TRITON_INTERPRET=1``), else the reference.
There is no CuTe kernel yet, and no vendor path to yield to: the plain attention reads the whole allocated cache
twice, the kernel the valid prefix once, so the kernel is never the slower one where it can run.

The Triton layout (``config.TritonConfig``) is data: ``tables/<gpu>.json``, written by
``benchmarks/tune_mla_decode.py``, maps (cache dtype, query rows T*H bucket, batch bucket) to the configuration that
measured fastest there, and optionally also by length bucket; without a table, or for a key it lacks,
``config.default_config``. The length the host knows is the allocation's (the valid length is read on the device, so
a CUDA graph replays one launch for all): a pick keyed by length applies to caches allocated for at most that many
keys, whatever they hold; a larger allocation takes its batch's pick.

Nothing here imports Triton: the kernel module loads on first use (``KernelModule``; where it does not import,
``available`` says why).
"""
from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Optional

import torch

from k3compile.backends import Impl, OpImpls, Reason, register_op_impls, triton_can_run_on
from k3compile.kernel_module import KernelModule

from .config import TritonConfig, default_config, row_block
from .reference import mla_decode_ref

TABLES = Path(__file__).resolve().parent / "tables"
MAX_LATENT = 1024     # Lk: one [block_s, Lk] tile a program holds
MAX_ROPE = 256        # R
_TRITON = KernelModule(f"{__package__}.triton")   # imports Triton


def batch_bucket(batch: int) -> int:
    """The power of two at or below ``batch`` (at most 64): the tables' batch key."""
    return min(64, 1 << (max(1, batch).bit_length() - 1))


def length_bucket(length: int) -> int:
    """The power of two at or above ``length``: the tables' length key."""
    return 1 << max(0, length - 1).bit_length()


def table_key(dtype: torch.dtype, rows: int, batch: int, length: Optional[int] = None) -> str:
    key = f"{str(dtype).removeprefix('torch.')} rows={row_block(rows)} batch={batch_bucket(batch)}"
    return key if length is None else f"{key} len={length_bucket(length)}"


@functools.cache
def load_table(device_name: str) -> dict[str, TritonConfig]:
    """The picks for a GPU whose name contains a table's file name (``h200.json`` for "NVIDIA H200"); {} if none."""
    name = device_name.lower()
    for path in sorted(TABLES.glob("*.json")):
        if path.stem in name:
            picks = json.loads(path.read_text())["picks"]
            return {key: TritonConfig(**cfg) for key, cfg in picks.items()}
    return {}


def triton_config(c_kv: torch.Tensor, rows: int, batch: int) -> TritonConfig:
    """The measured pick for this GPU and shape class (by the allocation's length bucket where the table has one, else
    by batch), else ``config.default_config``."""
    if c_kv.device.type != "cuda":
        return default_config(rows, batch)
    return table_pick(load_table(torch.cuda.get_device_name(c_kv.device)), c_kv.dtype, rows, batch, c_kv.shape[1])


def table_pick(table: dict[str, TritonConfig], dtype: torch.dtype, rows: int, batch: int, alloc: int) -> TritonConfig:
    """The pick for caches of ``alloc`` keys (its length bucket), else the batch's, else ``config.default_config``."""
    by_length = table.get(table_key(dtype, rows, batch, alloc))
    return by_length or table.get(table_key(dtype, rows, batch), default_config(rows, batch))


# The predicates and implementations get the op's arguments: (q_nope, q_pe, c_kv, k_pe, w_kv_b, pos, scale, start).

def _triton_available(q_nope, q_pe, c_kv, k_pe, w_kv_b, pos, scale, start) -> Reason:
    return triton_can_run_on(q_nope, q_pe, c_kv, k_pe, w_kv_b, pos, start) or _TRITON.reason()


def _triton_supports(q_nope, q_pe, c_kv, k_pe, w_kv_b, pos, scale, start) -> Reason:
    dtypes = {t.dtype for t in (q_nope, q_pe, c_kv, k_pe, w_kv_b)}
    if len(dtypes) != 1:
        return f"mixed dtypes {sorted(map(str, dtypes))} (the kernel takes one)"
    if c_kv.shape[-1] > MAX_LATENT or k_pe.shape[-1] > MAX_ROPE:
        return f"Lk={c_kv.shape[-1]} > {MAX_LATENT} or R={k_pe.shape[-1]} > {MAX_ROPE} (one tile per program)"
    if q_nope.numel() == 0 or c_kv.shape[1] == 0:
        return "empty batch, query or cache"
    return None


def _triton(q_nope, q_pe, c_kv, k_pe, w_kv_b, pos, scale, start):
    B, T, H = q_nope.shape[:3]
    config = triton_config(c_kv, T * H, B)
    return _TRITON.mla_decode_triton(q_nope, q_pe, c_kv, k_pe, w_kv_b, pos, scale, start, config=config)


MLA_DECODE = register_op_impls(OpImpls(
    "mla_decode",
    reference=Impl(mla_decode_ref),
    triton=Impl(_triton, available=_triton_available, supports=_triton_supports),
))


def dispatch_key(q_nope, q_pe, c_kv, k_pe, w_kv_b, pos, scale, start) -> tuple:
    """(device type, details): everything the predicates read, as the report prints it."""
    B, T, H, N = q_nope.shape
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in (q_nope, q_pe, c_kv, k_pe, w_kv_b)})
    details = ("/".join(dtypes), f"T={T}", f"H={H}", f"N={N}", f"R={k_pe.shape[-1]}", f"Vd={w_kv_b.shape[1] - N}",
               f"Lk={c_kv.shape[-1]}", "start" if start is not None else "no start",
               "empty" if q_nope.numel() == 0 or c_kv.shape[1] == 0 else "")
    return (q_nope.device.type, details)
