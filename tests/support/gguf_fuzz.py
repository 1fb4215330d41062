"""The w4a8 loader's fuzz (tests/test_w4a8_fuzz.py): every header field of the fixed tiny
Q4_K_M file (tests/support/fixed_gguf.py) set to each boundary value of its width, one edit a
file, and the engine started on each; what happened, a line per edit.

Run as ``python -m tests.support.gguf_fuzz FILE OUT``: the edits run in this process, so a
signal ends it and the last ``start`` line in OUT names the edit that did it. Each line is JSON:
``{"start": i}`` before edit ``i``, then ``{"edit": i, "field", "value", "outcome", "detail"}``
with outcome ``refused`` (a ModelSpecError, its message in ``detail``), ``same`` (the intact
file's greedy tokens), ``other`` (other finite tokens), ``non-finite``, ``error`` (any other
exception: a traceback's worth, a defect) or ``no-op`` (the value was the field's own).
"""

from __future__ import annotations

import json
import math
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

# GGUF value types: (struct format, size); 8 string, 9 array
SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
           11: "<q", 12: "<d"}
WIDE = [0, 1, 1 << 31, (1 << 32) - 1, 1 << 63, (1 << 64) - 1]  # -1 is all ones
NARROW = [0, 1, 1 << 31, (1 << 32) - 1]
FLOATS = [0.0, -1.0, math.nan, math.inf]


@dataclass(frozen=True)
class Field:
    name: str  # e.g. "kv llama.head_count: value", "tensor blk.0.attn_q.weight: dim 1"
    offset: int
    fmt: str  # struct format of the stored field


def fields(data: bytes) -> list[Field]:
    """Every count, length, type, dimension, offset and scalar value of a GGUF v3 header."""
    found: list[Field] = [Field("version", 4, "<I"), Field("tensor count", 8, "<Q"),
                          Field("kv count", 16, "<Q")]
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)
    at = 24

    def string(label: str) -> str:
        nonlocal at
        found.append(Field(f"{label}: length", at, "<Q"))
        (size,) = struct.unpack_from("<Q", data, at)
        text = data[at + 8:at + 8 + size].decode()
        at += 8 + size
        return text

    for _ in range(n_kv):
        key = string("kv key")
        found.append(Field(f"kv {key}: type", at, "<I"))
        (kind,) = struct.unpack_from("<I", data, at)
        at += 4
        if kind == 8:
            string(f"kv {key}")
        elif kind == 9:
            raise ValueError("the fixed file has no arrays")
        else:
            found.append(Field(f"kv {key}: value", at, SCALARS[kind]))
            at += struct.calcsize(SCALARS[kind])
    for _ in range(n_tensors):
        name = string("tensor name")
        found.append(Field(f"tensor {name}: n_dims", at, "<I"))
        (n_dims,) = struct.unpack_from("<I", data, at)
        at += 4
        for d in range(n_dims):
            found.append(Field(f"tensor {name}: dim {d}", at + 8 * d, "<Q"))
        at += 8 * n_dims
        found.append(Field(f"tensor {name}: type", at, "<I"))
        found.append(Field(f"tensor {name}: offset", at + 4, "<Q"))
        at += 12
    return found


def values(field: Field) -> list[float]:
    if field.fmt in ("<f", "<d"):
        return FLOATS
    if field.fmt == "<Q" or field.fmt == "<q":
        return list(WIDE)
    if field.fmt in ("<I", "<i"):
        return list(NARROW)
    return [0, 1, (1 << (8 * struct.calcsize(field.fmt))) - 1]


def edited(data: bytes, field: Field, value: float) -> bytes:
    out = bytearray(data)
    if field.fmt in ("<f", "<d"):
        struct.pack_into(field.fmt, out, field.offset, value)
    else:
        size = struct.calcsize(field.fmt)
        out[field.offset:field.offset + size] = int(value).to_bytes(size, "little")
    return bytes(out)


def greedy(path: Path) -> list[int] | None:
    """The engine's greedy next tokens after each of 8 fixed ids; None: a row not finite."""
    import torch

    from shared.engines.int8.model import Rows
    from shared.engines.w4a8.model import GGUFFile, W4A8Decoder

    decoder = W4A8Decoder(GGUFFile(path), num_slots=1, slot_tokens=16)
    ids = [(29 * i + 5) % 256 for i in range(8)]
    logits = decoder.forward(Rows(torch.tensor(ids), [0] * 8, list(range(8))), torch.arange(8))
    if not torch.isfinite(logits).all():
        return None
    return [int(t) for t in logits.argmax(-1)]


class _NoOp(Exception):
    """The value is the field's own: nothing to try."""


def main(source: Path, out: Path) -> None:
    from shared.models import ModelSpecError

    data = source.read_bytes()
    intact = greedy(source)
    edits = [(f, v) for f in fields(data) for v in values(f)]
    work = source.with_name("edited.gguf")
    with out.open("w") as log:
        for i, (field, value) in enumerate(edits):
            log.write(json.dumps({"start": i, "field": field.name}) + "\n")
            log.flush()
            changed = edited(data, field, value)
            work.write_bytes(changed)
            detail = ""
            try:
                if changed == data:
                    raise _NoOp
                tokens = greedy(work)
                outcome = ("non-finite" if tokens is None else
                           "same" if tokens == intact else "other")
            except _NoOp:
                outcome = "no-op"
            except ModelSpecError as exc:
                outcome, detail = "refused", str(exc)
            except Exception as exc:  # noqa: BLE001 - recorded: the test fails on it
                outcome, detail = "error", f"{type(exc).__name__}: {exc}"
            log.write(json.dumps({"edit": i, "field": field.name, "value": repr(value),
                                  "outcome": outcome, "detail": detail}) + "\n")
            log.flush()


def kind(field: str) -> str:
    """The field's kind: ``version``, ``kv value``, ``tensor dim``, ..."""
    if ": " not in field:
        return field
    head, tail = field.split(": ", 1)
    return f"{head.split(' ')[0]} {tail.split(' ')[0]}" if head not in (
        "kv key", "tensor name") else f"{head} {tail}"


def table(out: Path) -> str:
    """The run's outcomes by kind of field, as a markdown table."""
    results = [json.loads(line) for line in out.read_text().splitlines() if '"edit"' in line]
    columns = ["refused", "same", "no-op", "other", "non-finite", "error"]
    rows: dict[str, dict[str, int]] = {}
    for result in results:
        counts = rows.setdefault(kind(result["field"]), dict.fromkeys(columns, 0))
        counts[result["outcome"]] += 1
    lines = ["| field | edits | refused in one line | served the intact tokens | no-op | "
             "other tokens | non-finite | other error |", "|---" * 8 + "|"]
    for name, counts in rows.items():
        lines.append(f"| {name} | {sum(counts.values())} | " +
                     " | ".join(str(counts[c]) for c in columns) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) > 3 and sys.argv[3] == "--table":
        print(table(Path(sys.argv[2])))
    else:
        main(Path(sys.argv[1]), Path(sys.argv[2]))
