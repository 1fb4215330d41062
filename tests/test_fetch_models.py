"""``shared/models/fetch.py``: which GGUF files it keeps (what ``--engine auto`` then runs on a
CPU), without downloading anything: the converted folder is faked, the GGUF fetch recorded."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from shared.models import fetch as fetch_models
from shared.models.catalog import offline_model_dir

NAME = "qwen2.5-coder-1.5b"


@pytest.fixture
def fetched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """A home where NAME's converted folder is ready; returns the GGUF fetches made."""
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    folder = offline_model_dir(NAME)
    folder.mkdir(parents=True)
    (folder / fetch_models.MARKER).write_text("{}")
    calls: list[str] = []
    monkeypatch.setattr(fetch_models, "fetch_gguf", lambda name: calls.append(name))
    return calls


@pytest.mark.parametrize("installed", [True, False])
def test_the_gguf_is_kept_where_llama_cpp_is_installed(
        fetched: list[str], monkeypatch: pytest.MonkeyPatch, installed: bool) -> None:
    monkeypatch.setattr(fetch_models, "runs_gguf", lambda: installed)
    assert fetch_models.fetch(NAME) == offline_model_dir(NAME)
    assert fetched == ([NAME] if installed else [])


@pytest.mark.parametrize(("flag", "installed", "kept"), [
    ("--keep-gguf", False, True),  # asked for: kept even where llama.cpp is not installed
    ("--drop-gguf", True, False),
    (None, True, True),
])
def test_the_flags_decide_over_the_default(fetched: list[str], monkeypatch: pytest.MonkeyPatch,
                                           flag: str | None, installed: bool,
                                           kept: bool) -> None:
    monkeypatch.setattr(fetch_models, "runs_gguf", lambda: installed)
    argv = ["fetch_models.py", "--models", NAME, *([flag] if flag else [])]
    monkeypatch.setattr(sys, "argv", argv)
    fetch_models.main()
    assert fetched == ([NAME] if kept else [])


def test_keep_and_drop_together_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["fetch_models.py", "--keep-gguf", "--drop-gguf"])
    with pytest.raises(SystemExit) as exc:
        fetch_models.main()
    assert exc.value.code == 2


def test_no_convert_keeps_the_gguf_and_only_its_tokenizer(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_models: dict[str, Path]) -> None:
    """``convert=False`` (the demo on llama.cpp): the folder holds the GGUF's tokenizer and no
    weights; the llama.cpp engine's tokenizer loads from it, transformers is told to fetch
    fully, and the full fetch later converts over it."""
    from shared.engines.llama_cpp.runtime import resolve_gguf
    from shared.models.catalog import (
        ModelSpecError,
        load_tokenizer,
        offline_gguf_path,
        resolve_model_spec,
    )
    from tests.support.tiny_gguf import write_llama_gguf

    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    gguf = offline_gguf_path(NAME)
    gguf.parent.mkdir(parents=True)
    write_llama_gguf(tiny_models["llama-target"], gguf)
    monkeypatch.setattr(fetch_models, "fetch_gguf", lambda name: gguf)
    converted: list[str] = []
    monkeypatch.setattr(fetch_models, "convert_to_safetensors",
                        lambda model, path, out: converted.append(model.short_name))
    folder = fetch_models.fetch(NAME, keep_gguf=True, convert=False)
    assert (folder / "tokenizer.json").is_file() and not (folder / "config.json").exists()
    assert converted == []
    assert resolve_gguf(NAME) == (str(gguf), NAME)
    assert load_tokenizer(NAME).get_vocab() == load_tokenizer(str(gguf)).get_vocab()
    with pytest.raises(ModelSpecError, match="fetched as its GGUF file and tokenizer only"):
        resolve_model_spec(NAME)
    fetch_models.fetch(NAME, keep_gguf=True)  # the full fetch converts
    assert converted == [NAME]


def test_a_tokenizer_folder_without_weights_loads_by_its_path(tmp_path: Path) -> None:
    """What `make demo` leaves in $SPECDEC_HOME/models/<name> (a tokenizer, no config.json)
    works wherever a tokenizer is asked for by its path, as the short name does; the control: a
    folder with neither is still refused."""
    from shared.models.catalog import ModelSpecError, load_tokenizer
    from tests.support.tiny_models import build_tokenizer

    folder = tmp_path / "qwen-like"
    build_tokenizer(64).save_pretrained(folder)
    assert not (folder / "config.json").exists()
    assert load_tokenizer(str(folder)).encode("the cat") == build_tokenizer(64).encode("the cat")
    with pytest.raises(ModelSpecError, match="no config.json"):
        load_tokenizer(str(tmp_path))
