"""The w4a8 loader's fuzz: every header field of the fixed tiny Q4_K_M file (each count,
length, type, dimension, offset and scalar value) set to each boundary value of its width - 0,
1, 2^31, 2^32 - 1 (-1), and for 8-byte fields 2^63 and 2^64 - 1; 0, -1, NaN and inf for floats -
one edit a file, about 800 in all (tests/support/gguf_fuzz.py). Every start is refused in one
line or serves the intact file's tokens: no signal (the edits run in a child process), no other
exception, no non-finite row. The control: the fuzz's own check flags a file whose norm reads the
embedding's bytes once the loader's overlap check is taken away."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from shared.engines.w4a8 import gguf_file
from tests.support import gguf_fuzz
from tests.support.fixed_gguf import write_fixed_gguf

# fields the engine reads but may take any of these values of and still serve the same model
SERVED = {"kv llama.context_length: value"}  # the training context: the verifier's own limit


def test_every_edited_header_is_refused_in_one_line_or_serves_the_intact_tokens(
        tmp_path: Path) -> None:
    source = write_fixed_gguf(tmp_path / "fixed.gguf")
    out = tmp_path / "fuzz.jsonl"
    run = subprocess.run([sys.executable, "-m", "tests.support.gguf_fuzz", str(source),
                          str(out)], capture_output=True, timeout=600, check=False)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    started = [line for line in lines if "start" in line]
    assert run.returncode == 0, (run.returncode, started[-1:], run.stderr[-2000:])
    results = [line for line in lines if "edit" in line]
    assert len(results) == len(started) > 700
    outcomes = Counter(r["outcome"] for r in results)
    assert set(outcomes) <= {"refused", "same", "no-op"}, [
        r for r in results if r["outcome"] not in ("refused", "same", "no-op")][:5]
    assert all("\n" not in r["detail"] for r in results)
    served = {r["field"] for r in results if r["outcome"] == "same"}
    assert served <= SERVED, served
    assert outcomes["refused"] > 0.9 * len(results)


def test_control_the_fuzz_flags_a_norm_read_from_the_embeddings_bytes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = write_fixed_gguf(tmp_path / "fixed.gguf")
    data = source.read_bytes()
    field = next(f for f in gguf_fuzz.fields(data)
                 if f.name == "tensor output_norm.weight: offset")
    aliased = tmp_path / "aliased.gguf"
    aliased.write_bytes(gguf_fuzz.edited(data, field, 0))
    with pytest.raises(Exception, match="overlap"):
        gguf_fuzz.greedy(aliased)
    monkeypatch.setattr(gguf_file, "no_overlaps", lambda tensors: None)
    assert gguf_fuzz.greedy(aliased) is None  # non-finite: what the fuzz would report
