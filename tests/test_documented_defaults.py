"""Every default written once: what the docs and compose say equals what the objects hold.

The verifier's table in docs/configuration.md is generated from its settings
(tests/test_settings.py), and so are the client's and the gateway's (their flags come from the
client's settings fields: drafter_client/apps/flags.py); this file checks the client's tables,
any default still written in prose against the parser that reads it, and the values more than
one object starts from against their one source."""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import pytest

from drafter_client.apps.cli import build_parser, configuration_tables
from drafter_client.settings import DEFAULTS, GATEWAY
from shared.http.limits import HTTP_LIMITS
from shared.protocol import GREEDY_TEMPERATURE, NO_TOP_K, NO_TOP_P
from shared.protocol.sampling import SamplingConfig
from shared.protocol.schema import SamplingParams
from verifier_service.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
# "`--max-concurrency` (8)", "`--retry-budget-s` (60; how long ...)", "`--port` (8080)"
DOCUMENTED = re.compile(r"`(--[a-z0-9-]+)` \(([0-9][0-9.]*)[;:)]")


def parser_defaults() -> dict[str, object]:
    """Each flag of every ``specdec`` command, and its default."""
    defaults: dict[str, object] = {}
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for sub in commands.choices.values():
        for action in sub._actions:
            for flag in action.option_strings:
                defaults[flag] = action.default
    return defaults


def documented(text: str) -> dict[str, str]:
    return dict(DOCUMENTED.findall(" ".join(text.split())))


def same(said: str, default: object) -> bool:
    """A documented value equals a default: as numbers where both are, else as text."""
    try:
        return float(said) == float(default)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return said == str(default)


def client_docs() -> str:
    text = (ROOT / "docs" / "configuration.md").read_text()
    return text[text.index("## Client"):text.index("## Drafters")]


def test_the_client_docs_hold_the_tables_generated_from_the_settings() -> None:
    assert configuration_tables() in client_docs(), (
        "docs/configuration.md is out of date: paste `python -m drafter_client.apps.flags`")


def test_a_changed_default_changes_the_table() -> None:
    """Negative control: the tables are read from the settings' values, so the docs check
    sees a default that is not the documented one."""
    other = dataclasses.replace(DEFAULTS, gateway=dataclasses.replace(GATEWAY,
                                                                      max_concurrency=9))
    tables = configuration_tables(other)
    assert "| `--max-concurrency` | `9` |" in tables
    assert tables not in client_docs()


def test_the_client_docs_state_the_parsers_defaults() -> None:
    said = documented(client_docs())
    flags = parser_defaults()
    wrong = {flag: (value, flags.get(flag)) for flag, value in said.items()
             if flag not in flags or not same(value, flags[flag])}
    assert wrong == {}


def test_a_wrong_documented_default_is_caught() -> None:
    """Negative control: the parser's own default, written wrong."""
    flags = parser_defaults()
    said = documented("`--max-concurrency` (9), `--port` (8080)")
    assert not same(said["--max-concurrency"], flags["--max-concurrency"])
    assert same(said["--port"], flags["--port"])


@pytest.mark.parametrize("name", ["max_body_bytes", "body_timeout_s", "header_timeout_s",
                                  "keep_alive_s"])
def test_both_servers_start_from_the_same_http_limits(name: str) -> None:
    one = getattr(HTTP_LIMITS, name)
    assert Settings.model_fields[name].default == one
    assert getattr(DEFAULTS.gateway, name) == one


def test_neutral_sampling_is_written_once() -> None:
    neutral = (GREEDY_TEMPERATURE, NO_TOP_K, NO_TOP_P)
    wire = SamplingParams()
    assert (wire.temperature, wire.top_k, wire.top_p) == neutral
    config = SamplingConfig()
    assert (config.temperature, config.top_k, config.top_p) == neutral
    client = DEFAULTS.sampling
    assert (client.temperature, client.top_k, client.top_p) == neutral
