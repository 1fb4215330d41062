"""One client settings object (drafter_client/settings.py): the command line's flags default to
its fields, the Python API takes it and uses it for every call that does not say otherwise, and
the command line parses its flags without loading torch or transformers."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from drafter_client import ClientSettings, SpecDecClient
from drafter_client.apps.cli import build_parser, client_settings
from drafter_client.settings import DEFAULTS, DrafterOptions, Sampling
from tests.support.in_process import InProcessVerifier
from tests.support.live_server import fp32_settings

URL = ["--verifier-url", "http://127.0.0.1:9"]


@pytest.mark.parametrize("command", [
    ["generate", *URL, "--drafter", "ngram", "--prompt", "x"],
    ["chat", *URL, "--drafter", "ngram"],
    ["serve", *URL, "--drafter", "ngram"],
])
def test_every_command_starts_from_the_same_defaults(command: list[str]) -> None:
    settings = client_settings(build_parser().parse_args(command))
    assert settings == DEFAULTS


def test_baseline_keeps_the_drafting_defaults() -> None:
    args = build_parser().parse_args(["baseline", *URL, "--prompt", "x", "--temperature", "0.5"])
    assert client_settings(args) == dataclasses.replace(
        DEFAULTS, sampling=dataclasses.replace(DEFAULTS.sampling, temperature=0.5))


def test_flags_land_in_the_settings() -> None:
    args = build_parser().parse_args([
        "generate", *URL, "--drafter", "m", "--prompt", "x", "-k", "3", "--no-lookup",
        "--overlap", "--tree-width", "2", "--temperature", "0.7", "--top-k", "5", "--seed", "9",
        "--max-new-tokens", "7", "--dtype", "float32", "--threads", "1",
        "--drafter-engine", "transformers", "--timeout-s", "5"])
    settings = client_settings(args)
    assert settings.num_draft_tokens == "3" and settings.dtype == "float32"
    assert settings.options == dataclasses.replace(DrafterOptions(), lookup=False, overlap=True,
                                                   tree_width=2, threads=1,
                                                   engine="transformers")
    assert settings.sampling == Sampling(max_new_tokens=7, temperature=0.7, top_k=5, seed=9)
    assert settings.timeout_s == 5.0


def test_the_parser_and_flag_checks_load_neither_torch_nor_transformers() -> None:
    code = ("import sys; from drafter_client.apps.cli import build_parser, client_settings; "
            "client_settings(build_parser().parse_args(['generate', '--verifier-url', 'u', "
            "'--drafter', 'd', '--prompt', 'p'])); "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).resolve().parents[1])
    assert out.stdout.strip() == "[]"


def test_the_client_uses_its_settings_where_a_call_is_silent(
        tiny_models: dict[str, Path]) -> None:
    verifier = InProcessVerifier.load(fp32_settings(tiny_models["gpt2-target"],
                                                    max_draft_tokens=8))
    settings = ClientSettings(num_draft_tokens="2", dtype="float32", device="cpu",
                              sampling=Sampling(max_new_tokens=9, temperature=1.0, seed=4),
                              options=DrafterOptions(lookup=False))
    client = SpecDecClient(verifier, str(tiny_models["gpt2-drafter"]), settings=settings)
    assert client.settings == settings and client.options == settings.options
    blocks: list[int] = []
    result = client.generate("the cat sat", on_block=lambda o: blocks.append(len(o.draft_ids)))
    assert len(result.token_ids) == 9 or result.finish_reason == "stop"
    assert blocks and max(blocks) <= 2  # k = 2 from the settings
    # The same call with every value spelled out gives the same tokens.
    spelled = client.generate("the cat sat", num_draft_tokens=2, max_new_tokens=9,
                              temperature=1.0, seed=4)
    assert spelled.token_ids == result.token_ids
    # A call's own value wins over the settings'; the baseline uses them too.
    assert len(client.generate("the cat sat", max_new_tokens=3).token_ids) <= 3
    sent = []

    class Seen(Exception):
        pass

    def generate(request):  # type: ignore[no-untyped-def]
        sent.append(request)
        raise Seen

    verifier.generate = generate  # type: ignore[method-assign]
    with pytest.raises(Seen):
        client.baseline("the cat sat")
    assert sent[0].max_new_tokens == 9 and sent[0].seed == 4
    assert sent[0].sampling.temperature == 1.0
    # Keyword shorthands replace fields of the settings they are given with.
    other = SpecDecClient(verifier, "ngram", tokenizer=str(tiny_models["gpt2-target"]),
                          settings=settings, timeout_s=3.0)
    assert other.settings == dataclasses.replace(settings, timeout_s=3.0)


def test_every_field_is_a_flag_or_says_why_not() -> None:
    """The flags are generated from the settings' fields: each field of every settings object
    is a flag of some command, but the nested objects and the two a flag must not carry (the
    chat template's text: a file names it; the gateway's key: ps would show it)."""
    from drafter_client.apps.flags import flag_of
    from drafter_client.settings import GatewaySettings
    from tests.test_documented_defaults import parser_defaults

    flags = parser_defaults()
    missing = [f"{cls.__name__}.{name}" for cls in (ClientSettings, DrafterOptions, Sampling,
                                                    GatewaySettings)
               for name in cls.__pydantic_fields__  # type: ignore[attr-defined]
               if flag_of(cls, name) not in flags]
    assert missing == ["ClientSettings.options", "ClientSettings.sampling",
                       "ClientSettings.gateway", "GatewaySettings.chat_template",
                       "GatewaySettings.api_key"]


@pytest.mark.parametrize(("values", "field"), [
    ({"sampling": {"temperature": -1.0}}, "temperature"),
    ({"sampling": {"top_p": 0.0}}, "top_p"),
    ({"options": {"tree_width": 0}}, "tree_width"),
    ({"options": {"engine": "vllm"}}, "engine"),
    ({"num_draft_tokens": "many"}, "num_draft_tokens"),
    ({"gateway": {"allowed_hosts": ("http://x/",)}}, "allowed_hosts"),
])
def test_the_python_api_checks_values_as_the_flags_do(values: dict, field: str) -> None:
    """One set of checks: a value a field refuses is refused in Python as on the command line
    (pydantic's error names the field); the same value through its flag is one line naming the
    flag (tests/test_cli_e2e.py)."""
    from pydantic import ValidationError

    from drafter_client.settings import GatewaySettings

    nested = {"sampling": Sampling, "options": DrafterOptions, "gateway": GatewaySettings}
    built = {key: nested[key](**value) if key in nested else value
             for key, value in values.items() if key not in nested}
    with pytest.raises(ValidationError) as refused:
        for key, value in values.items():
            if key in nested:
                nested[key](**value)
        ClientSettings(**built)
    assert refused.value.errors()[0]["loc"][0] == field


def test_a_field_without_a_flag_is_not_read_from_a_flag_of_its_name(tmp_path: Path) -> None:
    """`--chat-template FILE` names a file; the gateway's `chat_template` field holds the text,
    read by `specdec serve` itself: the path must not land in the field."""
    template = tmp_path / "template.jinja"
    template.write_text("{{ messages }}")
    args = build_parser().parse_args(["serve", *URL, "--drafter", "ngram", "--chat-template",
                                      str(template)])
    assert client_settings(args).gateway.chat_template is None
