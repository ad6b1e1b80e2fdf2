"""Reading a checkpoint one tensor slice at a time: the table of contents of a directory in the published layout
(``model.safetensors.index.json`` + the safetensors headers, checked before any data is read), this rank's slice of
a tensor through ``safe_open(...).get_slice``, and progress over files and bytes.

Host memory: safetensors maps each file and hands out slices of the map; the pages a read touches stay resident
until the file is closed, so :class:`FileSource` closes and reopens a file after every :data:`REOPEN_BYTES` of
tensors read. A load therefore holds at most about REOPEN_BYTES + the largest tensor of mapped file pages, plus the
slice being converted, besides what it loads onto the host.
"""
from __future__ import annotations

import json
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Union

import torch

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
STATE_DICT = "<state dict>"            # the "file" of tensors handed over in memory
REOPEN_BYTES = 128 * 2 ** 20

SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "U8": torch.uint8, "I8": torch.int8,
    "I16": torch.int16, "I32": torch.int32, "I64": torch.int64, "BOOL": torch.bool,
}


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as it is; the message names the file and the tensor."""


@dataclass(frozen=True)
class Entry:
    """One tensor of the checkpoint: where it is, its full shape and dtype (a safetensors name if torch lacks it)."""
    name: str
    file: str
    shape: tuple[int, ...]
    dtype: Union[torch.dtype, str]

    @property
    def nbytes(self) -> int:
        size = self.dtype.itemsize if isinstance(self.dtype, torch.dtype) else 1
        n = 1
        for s in self.shape:
            n *= s
        return n * size


def _index_file(path: Path, index: Path) -> dict[str, list[str]]:
    """file name -> the tensor names the index places in it; every named file must exist."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        by_file: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            by_file.setdefault(file, []).append(name)
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{index}: not a safetensors index with a weight_map ({e!r})") from None
    for file, names in sorted(by_file.items()):
        if not (path / file).is_file():
            raise CheckpointError(f"{index} places {len(names)} tensor(s) in {file} (e.g. {sorted(names)[0]}), "
                                  f"but {path / file} does not exist")
    return by_file


def _diagnose(file: Path) -> str:
    """Why a file safetensors refuses is broken, naming the tensors its header places beyond its end."""
    try:
        with open(file, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        data = file.stat().st_size - 8 - n
        cut = sorted((meta["data_offsets"][1], name) for name, meta in header.items()
                     if name != "__metadata__" and meta["data_offsets"][1] > data)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return "the file is damaged (its header cannot be read)"
    if not cut:
        return "the file is truncated or damaged"
    return (f"the file is truncated: tensor {cut[0][1]}{f' and {len(cut) - 1} more' if len(cut) > 1 else ''} "
            f"end(s) past its {data} bytes of data")


class FileSource:
    """The tensors of a checkpoint directory, file by file (sorted by name)."""

    def __init__(self, path: Path):
        from safetensors import safe_open
        self.path = Path(path)
        index = self.path / INDEX_NAME
        if index.exists():
            by_file: dict[str, Optional[list[str]]] = dict(_index_file(self.path, index))
        elif (self.path / SINGLE_NAME).exists():
            by_file = {SINGLE_NAME: None}
        else:
            raise FileNotFoundError(f"no {INDEX_NAME} or {SINGLE_NAME} in {self.path}")
        self.files = sorted(by_file)
        self.entries: dict[str, Entry] = {}
        for file in self.files:
            try:
                with safe_open(str(self.path / file), framework="pt") as f:
                    held = {name: f.get_slice(name) for name in f.keys()}
                    found = {name: (tuple(s.get_shape()), s.get_dtype()) for name, s in held.items()}
            except Exception as e:      # safetensors raises its own SafetensorError (not exported stably) or OSError
                raise CheckpointError(f"{self.path / file}: cannot be read as safetensors ({e}); "
                                      f"{_diagnose(self.path / file)}") from None
            names = by_file[file] if by_file[file] is not None else sorted(found)
            for name in names:
                if name not in found:
                    raise CheckpointError(f"{index} places tensor {name} in {file}, but {self.path / file} does "
                                          f"not hold it")
                shape, dtype = found[name]
                self.entries[name] = Entry(name, file, shape, SAFETENSORS_DTYPES.get(dtype, dtype))

    def where(self, entry: Entry) -> str:
        return str(self.path / entry.file)

    @contextmanager
    def reader(self, file: str) -> Iterator["_FileReader"]:
        reader = _FileReader(self.path / file)
        try:
            yield reader
        finally:
            reader.close()


class _FileReader:
    """Slices of one file's tensors; reopens the file after REOPEN_BYTES of reads (see the module docstring)."""

    def __init__(self, file: Path):
        self.file, self.handle, self.since_open = file, None, 0

    def read(self, entry: Entry, index: Optional[tuple] = None) -> torch.Tensor:
        """The tensor, or its ``index`` (a tuple of slices), on the CPU (possibly a view of the file's map)."""
        from safetensors import safe_open
        if self.handle is None:
            self.handle = safe_open(str(self.file), framework="pt")
        try:
            sliced = self.handle.get_slice(entry.name)
            t = sliced[index] if index is not None else sliced[:]
        except Exception as e:
            raise CheckpointError(f"{self.file}: reading tensor {entry.name} failed ({e}); the file is damaged") \
                from None
        self.since_open += entry.nbytes          # a column slice touches every page of the tensor
        return t

    def done_with_tensor(self) -> None:
        """Called once nothing refers to the last slice read: release the map when enough was read."""
        if self.since_open >= REOPEN_BYTES:
            self.close()

    def close(self) -> None:
        self.handle, self.since_open = None, 0


class DictSource:
    """Tensors handed over in memory under their published names (one pseudo-file, :data:`STATE_DICT`)."""

    def __init__(self, tensors: dict):
        self.tensors = tensors
        self.files = [STATE_DICT]
        self.entries = {name: Entry(name, STATE_DICT, tuple(t.shape), t.dtype) for name, t in tensors.items()}

    def where(self, entry: Entry) -> str:
        return STATE_DICT

    @contextmanager
    def reader(self, file: str) -> Iterator["DictSource"]:
        yield self

    def read(self, entry: Entry, index: Optional[tuple] = None) -> torch.Tensor:
        t = self.tensors[entry.name]
        return t[index] if index is not None else t

    def done_with_tensor(self) -> None:
        pass


class Progress:
    """Files and bytes read: a tqdm bar on a terminal, otherwise (or without tqdm) one stderr line per file."""

    def __init__(self, total_bytes: int, files: list[str], enabled: bool):
        self.total, self.files, self.enabled = total_bytes, files, enabled
        self.done, self.start, self.bar = 0, time.perf_counter(), None
        if not enabled:
            return
        try:
            from tqdm.auto import tqdm
        except ImportError:
            tqdm = None
        if tqdm is not None and sys.stderr.isatty():
            self.bar = tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024, desc="loading",
                            file=sys.stderr, dynamic_ncols=True)

    def file(self, i: int, name: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_postfix_str(f"file {i + 1}/{len(self.files)} {name}", refresh=False)
        else:
            print(f"loading file {i + 1}/{len(self.files)} {name} ({self.done / 1e9:.2f} of "
                  f"{self.total / 1e9:.2f} GB read)", file=sys.stderr, flush=True)

    def advance(self, nbytes: int) -> None:
        self.done += nbytes
        if self.bar is not None:
            self.bar.update(nbytes)

    def close(self, ok: bool) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.enabled and ok:
            seconds = time.perf_counter() - self.start
            print(f"loaded {len(self.files)} file(s), {self.done / 1e9:.2f} GB, in {seconds:.1f} s",
                  file=sys.stderr, flush=True)
