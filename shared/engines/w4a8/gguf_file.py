"""A GGUF file, mapped: its metadata (scalars; arrays are skipped, not decoded) and its tensors
as views of the mapping.

``gguf.GGUFReader`` decodes every metadata array into numpy views, 11 s for the 1.5B's
151,936-token vocabulary on a 2-core CPU; the engine needs none of it (the tokenizer loads
elsewhere), so this reader walks the header itself (GGUF v2 / v3) in well under a second and
maps the tensor data without reading it.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from shared.models.catalog import ModelSpecError

# type id -> (values a block, bytes a block) for the types whose size this reader knows
BLOCKS = {0: (1, 4), 1: (1, 2), 12: (256, 144), 14: (256, 210), 8: (32, 22), 2: (32, 18),
          3: (32, 20), 6: (32, 22), 7: (32, 34), 10: (256, 84), 11: (256, 110), 13: (256, 176),
          30: (1, 2)}
TYPE_NAMES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0",
              10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 30: "BF16"}
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
MAX_NESTING = 4  # arrays of arrays this deep at most (GGUF's own files use 1)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # GGUF's order: the row length first
    type: int
    offset: int  # from the start of the file

    @property
    def type_name(self) -> str:
        return TYPE_NAMES.get(self.type, f"type {self.type}")


class GGUFError(ModelSpecError):
    pass


def _identity(stat: os.stat_result) -> tuple[int, int, int, int]:
    return (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)


class MappedGGUF:
    """``fields`` (scalar metadata; arrays as their length), ``tensors`` by name, and
    ``data(name)``: a tensor's bytes as a read-only uint8 view of the mapped file."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        try:
            with open(path, "rb") as handle:
                # private and read-only: nothing this process does writes the file
                self._map = mmap.mmap(handle.fileno(), 0, flags=mmap.MAP_PRIVATE,
                                      prot=mmap.PROT_READ)
                self.identity = _identity(os.fstat(handle.fileno()))
        except (OSError, ValueError) as error:
            raise GGUFError(f"cannot read {path}: {error}") from error
        try:
            self.fields, self.tensors = self._parse()
        except (struct.error, UnicodeDecodeError, IndexError, ValueError, RecursionError,
                OverflowError, MemoryError) as error:
            raise GGUFError(f"{path} is not a whole GGUF file ({error}): fetch it again") \
                from error
        self.bytes = np.frombuffer(self._map, dtype=np.uint8)

    def _parse(self) -> tuple[dict[str, Any], dict[str, TensorInfo]]:
        buf, pos = self._map, 0

        def take(fmt: str) -> Any:
            nonlocal pos
            value = struct.unpack_from(fmt, buf, pos)[0]
            pos += struct.calcsize(fmt)
            return value

        def string() -> str:
            nonlocal pos
            length = take("<Q")
            if length > len(buf) - pos:
                raise ValueError("a string runs past the end of the file")
            text = bytes(buf[pos:pos + length]).decode("utf-8")
            pos += length
            return text

        def value(kind: int, key: str, depth: int = 0) -> Any:
            nonlocal pos
            if kind in _SCALARS:
                return take(_SCALARS[kind])
            if kind == STRING:
                return string()
            if kind != ARRAY:
                raise ValueError(f"{key}: unknown metadata type {kind}")
            if depth >= MAX_NESTING:
                raise ValueError(f"{key}: arrays nested more than {MAX_NESTING} deep")
            inner, count = take("<I"), take("<Q")
            if inner in _SCALARS:
                pos += struct.calcsize(_SCALARS[inner]) * count
            else:
                if count > len(buf) - pos:  # every element takes a byte at least
                    raise ValueError(f"{key}: an array of {count} elements runs past the end")
                for _ in range(count):
                    value(inner, key, depth + 1)
            if pos > len(buf):
                raise ValueError(f"{key}: an array runs past the end of the file")
            return count

        if bytes(buf[:4]) != b"GGUF":
            raise ValueError("no GGUF magic")
        pos = 4
        version = take("<I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (this reader knows 2 and 3)")
        tensor_count, kv_count = take("<Q"), take("<Q")
        if tensor_count > len(buf) or kv_count > len(buf):
            raise ValueError(f"{tensor_count} tensors and {kv_count} keys cannot fit the file")
        fields = {}
        for _ in range(kv_count):
            key = string()
            fields[key] = value(take("<I"), key)
        infos = []
        for _ in range(tensor_count):
            name = string()
            n_dims = take("<I")
            if not 1 <= n_dims <= MAX_DIMS:
                raise ValueError(f"tensor {name}: n_dims {n_dims} (1 to {MAX_DIMS})")
            dims = tuple(take("<Q") for _ in range(n_dims))
            infos.append((name, dims, take("<I"), take("<Q")))
        alignment = fields.get("general.alignment", 32)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1) \
                or alignment > 1 << 20:
            raise ValueError(f"general.alignment {alignment!r} is not a power of two")
        start = (pos + alignment - 1) // alignment * alignment
        tensors = {}
        for name, dims, kind, offset in infos:
            info = TensorInfo(name, dims, kind, start + offset)
            if any(d <= 0 or d >= 1 << 40 for d in dims):
                raise ValueError(f"tensor {name}: a dimension of {dims} is 0 or past 2^40")
            if offset % alignment:
                raise ValueError(f"tensor {name}: offset {offset} is not aligned to {alignment}")
            if kind in BLOCKS:
                elements = 1
                for d in dims:
                    elements *= d
                    if elements > len(buf) * 256:  # no type packs 256 values in under a byte
                        raise ValueError(f"tensor {name}: {dims} holds more values than the "
                                         "file has bytes for")
                if dims[0] % BLOCKS[kind][0]:
                    raise ValueError(f"tensor {name}: a row of {dims[0]} is not whole "
                                     f"{info.type_name} blocks of {BLOCKS[kind][0]}")
            end = info.offset + self.nbytes(info) if kind in BLOCKS else info.offset
            if end > len(buf):
                raise ValueError(f"tensor {name} runs past the end of the file")
            if name in tensors:
                raise ValueError(f"tensor {name} is described twice")
            tensors[name] = info
        no_overlaps(tensors)
        return fields, tensors

    @staticmethod
    def nbytes(info: TensorInfo) -> int:
        per, size = BLOCKS[info.type]
        elements = 1
        for d in info.shape:  # Python integers: no product wraps
            elements *= d
        return elements // per * size

    def changed(self) -> str | None:
        """Why the file is no longer the one mapped (gone, another inode, another size or
        modification time), or None. A mapped page of a truncated file is a SIGBUS when
        read, and a file rewritten in place changes the weights under the engine: the engine
        asks this before each forward and stops serving instead."""
        try:
            now = _identity(os.stat(self.path))
        except OSError as error:
            return f"{self.path} is gone ({error.strerror})"
        if now != self.identity:
            return (f"{self.path} changed under the verifier (size {self.identity[2]} -> "
                    f"{now[2]} bytes, or rewritten)")
        return None

    def data(self, name: str) -> np.ndarray:
        info = self.tensors[name]
        return self.bytes[info.offset:info.offset + self.nbytes(info)]


def no_overlaps(tensors: dict[str, TensorInfo]) -> None:
    """ValueError where one tensor's bytes lie inside another's (a norm read from the
    embedding's blocks serves whatever those bytes say as floats)."""
    spans = sorted((t.offset, t.offset + MappedGGUF.nbytes(t), t.name)
                   for t in tensors.values() if t.type in BLOCKS)
    for (_, end, before), (begin, _, name) in zip(spans, spans[1:], strict=False):
        if begin < end:
            raise ValueError(f"tensor {name}: its bytes overlap tensor {before}'s")
