"""Settings are written once: the CLI is generated from them, the docs table and the compose
file are checked against them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from verifier_service.cli import parse_settings
from verifier_service.settings import Settings, settings_table

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def test_docs_table_is_the_settings_class() -> None:
    docs = (ROOT / "docs" / "configuration.md").read_text()
    assert settings_table() in docs, (
        "docs/configuration.md is out of date: paste `python -m verifier_service.settings`")


def test_every_field_has_a_description_and_a_flag() -> None:
    help_text = subprocess.run([str(BIN / "specdec-verifier"), "--help"], capture_output=True,
                               text=True, check=True).stdout
    for name, field in Settings.model_fields.items():
        assert field.description, f"{name} has no description"
        flag = f"--{name.replace('_', '-')}"
        if name == "api_keys":
            assert flag not in help_text  # environment only
        else:
            assert flag in help_text, flag


# Not settings: where the verifier keeps what it measured (compose puts them in a volume of
# their own, /models being read-only); each is read where named.
CACHE_VARIABLES = {"SPECDEC_VERIFY_COSTS": "shared/engines/target.py",
                   "SPECDEC_DTYPE_CACHE": "shared/engines/transformers/dtype_choice.py",
                   "SPECDEC_LLAMA_AMX_CACHE": "shared/engines/llama_cpp/runtime.py"}


def test_compose_passes_only_real_settings() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    fields = {f"SPECDEC_{name.upper()}" for name in Settings.model_fields}
    for service in ("verifier", "verifier-gpu"):
        env = compose["services"][service]["environment"]
        assert set(env) <= fields | set(CACHE_VARIABLES), set(env) - fields
    for name, module in CACHE_VARIABLES.items():
        assert f'os.environ.get("{name}")' in (ROOT / module).read_text(), name


def test_flags_override_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECDEC_MAX_BATCH_SIZE", "7")
    monkeypatch.setenv("SPECDEC_PORT", "9001")
    monkeypatch.setenv("SPECDEC_API_KEYS", "k1,k2")
    settings = parse_settings(["--port", "9002", "--no-batching", "--batch-wait-ms", "2.5"])
    assert settings.port == 9002  # flag wins
    assert settings.max_batch_size == 7  # environment fills the rest
    assert settings.batching is False and settings.batch_wait_ms == 2.5
    assert settings.key_list() == ["k1", "k2"]
    assert parse_settings(["--batching"]).batching is True


def test_bad_values_and_api_key_flags_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_settings(["--max-batch-size", "0"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--max-batch-size (SPECDEC_MAX_BATCH_SIZE)" in err and "Traceback" not in err
    with pytest.raises(SystemExit) as exit_info:
        parse_settings(["--api-keys", "secret"])
    assert exit_info.value.code == 2
    assert "environment only" in capsys.readouterr().err
