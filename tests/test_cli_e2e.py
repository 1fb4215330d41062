"""End to end across processes: `specdec-verifier` and the `specdec` CLI as subprocesses. The
runs whose output is checked share one client process (``tests.support.cli_runs``: torch and
transformers imported once); the runs that must fail with one line each have their own."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from tests.support.cli_runs import CliRunner
from tests.support.tiny_models import hf_greedy
from verifier_service.launch import VerifierProcess, free_port

BIN = Path(sys.executable).parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


@pytest.fixture(scope="module")
def verifier_url(tiny_models: dict[str, Path]) -> Iterator[str]:
    with VerifierProcess(["--model", str(tiny_models["gpt2-target"]), "--dtype", "float32",
                          "--device", "cpu"], env=ENV) as verifier:
        yield verifier.url


@pytest.fixture(scope="module")
def cli() -> Iterator[CliRunner]:
    """``specdec`` runs in one client process."""
    runner = CliRunner(env=ENV)
    yield runner
    runner.close()


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """``specdec`` in a process of its own."""
    return subprocess.run([str(BIN / "specdec"), *args], env=ENV, capture_output=True, text=True,
                          timeout=300)


def test_generate_json_matches_target_greedy(verifier_url, tiny_models, cli):  # type: ignore[no-untyped-def]
    out = cli("generate", "--verifier-url", verifier_url, "--drafter",
                  str(tiny_models["gpt2-drafter"]), "--prompt", "the cat sat on", "-k", "4",
                  "--max-new-tokens", "20", "--dtype", "float32", "--json")
    assert out.returncode == 0, out.stderr
    result = orjson.loads(out.stdout)
    assert result["prompt_token_ids"] == [2, 3, 5, 6]
    expected = hf_greedy(tiny_models["gpt2-target"], result["prompt_token_ids"], 20)
    cut = next((i + 1 for i, t in enumerate(expected) if t == 1), len(expected))
    assert result["token_ids"] == expected[:cut]
    metrics = result["metrics"]
    assert metrics["new_tokens"] == len(result["token_ids"])
    assert metrics["verify_calls"] >= 1 and metrics["bytes_sent"] > 0
    assert isinstance(result["text"], str)


def test_generate_streams_text_then_summary(verifier_url, tiny_models, cli):  # type: ignore[no-untyped-def]
    out = cli("generate", "--verifier-url", verifier_url, "--drafter",
                  str(tiny_models["gpt2-drafter"]), "--prompt", "a big red dog",
                  "--num-draft-tokens", "3", "--max-new-tokens", "12", "--temperature", "0.8",
                  "--top-k", "10", "--seed", "3", "--dtype", "float32")
    assert out.returncode == 0, out.stderr
    assert "--- generate:" in out.stdout and "per-position acceptance" in out.stdout


def test_baseline_cli_and_prompt_file(verifier_url, tiny_models, tmp_path, cli):  # type: ignore[no-untyped-def]
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("the cat sat on")
    out = cli("baseline", "--verifier-url", verifier_url, "--prompt-file", str(prompt),
                  "--tokenizer", str(tiny_models["gpt2-target"]), "--max-new-tokens", "20",
                  "--json")
    assert out.returncode == 0, out.stderr
    result = orjson.loads(out.stdout)
    expected = hf_greedy(tiny_models["gpt2-target"], result["prompt_token_ids"], 20)
    cut = next((i + 1 for i, t in enumerate(expected) if t == 1), len(expected))
    assert result["token_ids"] == expected[:cut]


def test_tokenizer_mismatch_is_one_clear_line(verifier_url, tiny_models):  # type: ignore[no-untyped-def]
    out = run_cli("generate", "--verifier-url", verifier_url, "--drafter",
                  str(tiny_models["other-vocab"]), "--prompt", "the cat")
    assert out.returncode == 2
    line = out.stderr.strip().splitlines()[-1]
    assert line.startswith("specdec: error: tokenizer mismatch")
    assert str(tiny_models["other-vocab"]) in line and str(tiny_models["gpt2-target"]) in line


def test_unreachable_verifier_is_one_clear_line(tiny_models):  # type: ignore[no-untyped-def]
    out = run_cli("baseline", "--verifier-url", f"http://127.0.0.1:{free_port()}",
                  "--prompt", "x", "--tokenizer", str(tiny_models["gpt2-target"]),
                  "--retry-budget-s", "1")
    assert out.returncode == 2
    assert "cannot reach the verifier" in out.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize(("flags", "named"), [
    (["--tree-width", "0"], "--tree-width"),
    (["--lookup-tokens", "-1"], "--lookup-tokens"),
    (["--reproducible", "--seed", "-3", "--temperature", "1"], "--seed"),
])
def test_bad_drafting_flags_are_one_clear_line(flags, named, verifier_url, tiny_models):  # type: ignore[no-untyped-def]
    out = run_cli("generate", "--verifier-url", verifier_url, "--drafter",
                  str(tiny_models["gpt2-drafter"]), "--prompt", "the cat", *flags)
    assert out.returncode == 2
    line = out.stderr.strip().splitlines()[-1]
    assert line.startswith("specdec: error: ") and named in line


def test_generate_with_tree_overlap_and_reproducible_flags(verifier_url, tiny_models, cli):  # type: ignore[no-untyped-def]
    """The drafting flags the docs show run end to end; --reproducible sampling equals the
    target alone's with the same seed."""
    common = ["--verifier-url", verifier_url, "--prompt", "the cat sat on", "--max-new-tokens",
              "16", "--temperature", "1", "--seed", "5", "--reproducible", "--json"]
    spec = cli("generate", *common, "--drafter", str(tiny_models["gpt2-drafter"]),
                   "--tree-width", "2", "--overlap", "--no-lookup", "-k", "3")
    alone = cli("baseline", *common, "--tokenizer", str(tiny_models["gpt2-target"]))
    assert spec.returncode == 0 and alone.returncode == 0, spec.stderr + alone.stderr
    assert orjson.loads(spec.stdout)["token_ids"] == orjson.loads(alone.stdout)["token_ids"]
