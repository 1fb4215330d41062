"""Engines are closed plug-ins: no engine is named outside ``shared/engines``, each owns its
options, and the client never imports an engine that only serves targets."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
from pydantic import BaseModel, Field, ValidationError

from shared import engines
from shared.engines import BUILT_IN, Backend, Plugin, option_models
from verifier_service.settings import CommonSettings, Settings, _with_engine_options

ROOT = Path(__file__).resolve().parents[1]
NAMES = [plugin.name for plugin in BUILT_IN]
PACKAGES = [plugin.package for plugin in BUILT_IN]
# "--engine int8", "the int8 engine", "engine == 'w4a8'": an engine named in code or text
ALTERNATIVES = "|".join(re.escape(name) for name in NAMES)
NAMED = re.compile(rf"(?<![\w.-])({ALTERNATIVES})(?![\w-])")


def engine_mentions(source: str) -> list[str]:
    """Where ``source`` imports an engine's package or names an engine: a string that is an
    engine's name, or says "engine NAME" / "NAME engine"."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom | ast.Import):
            modules = [node.module or ""] if isinstance(node, ast.ImportFrom) \
                else [alias.name for alias in node.names]
            found += [f"{node.lineno}: imports {m}" for m in modules
                      if any(m == p or m.startswith(p + ".") for p in PACKAGES)]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = " ".join(node.value.split())
            if text in NAMES or re.search(rf"engine[ =]+[\"']?({ALTERNATIVES})\b", text) \
                    or re.search(NAMED.pattern + r" engine", text):
                found.append(f"{node.lineno}: {text[:80]!r}")
    return found


def test_no_engine_is_named_outside_the_engines_packages() -> None:
    outside = [path for root in ("verifier_service", "drafter_client", "shared")
               for path in sorted((ROOT / root).rglob("*.py"))
               if not path.is_relative_to(ROOT / "shared" / "engines")]
    assert len(outside) > 40
    found = {str(path.relative_to(ROOT)): hits for path in outside
             if (hits := engine_mentions(path.read_text()))}
    assert found == {}


def test_the_check_finds_an_engine_named_in_the_service() -> None:
    """Negative control: the code this issue removed from the verifier's settings."""
    old = '''
from shared.engines.int8 import can_serve
def load_engine(settings):
    if name == "llama-cpp" and can_serve(settings.model):
        choice = choose(["llama-cpp", "int8"], costs, work)
    raise ValueError(f"the {settings.engine} engine runs on the CPU; --engine w4a8 cannot")
'''
    hits = engine_mentions(old)
    assert len(hits) == 5 and "imports shared.engines.int8" in hits[0]


def test_every_engine_option_is_a_verifier_setting_written_once() -> None:
    owned = {name: owner for owner, model in option_models().items()
             for name in model.model_fields}
    common = set(CommonSettings.model_fields)
    assert set(Settings.model_fields) == common | set(owned)
    assert not common & set(owned)
    assert owned["kernels"] == "llama-cpp" and owned["device_map"] == "transformers"
    assert owned["int8_outliers"] == "int8" and owned["expected_sessions"] == "auto"
    for name, field in Settings.model_fields.items():  # the defaults are the owners'
        if name in owned:
            assert field.default == option_models()[owned[name]].model_fields[name].default


def test_an_engine_refuses_another_engines_placement_by_flag() -> None:
    with pytest.raises(ValidationError, match="--device-map: the transformers engine's; "
                       "--engine llama-cpp cannot honour it"):
        Settings(model="m.gguf", engine="llama-cpp", device_map="auto")  # type: ignore[call-arg]
    with pytest.raises(ValidationError, match="device 'cuda': the int8 engine runs on the CPU"):
        Settings(model="m", engine="int8", device="cuda")
    with pytest.raises(ValidationError, match="tp_plan and device_map"):
        Settings(model="m", tp_plan="auto", device_map="auto")  # type: ignore[call-arg]
    with pytest.raises(ValidationError, match="engine must be one of auto, w4a8"):
        Settings(model="m", engine="vllm")


def test_auto_takes_the_engine_whose_own_options_are_set() -> None:
    settings = Settings(model="m.gguf", cuda_graphs=True)  # type: ignore[call-arg]
    name, why = engines.choose("auto", settings.target_options(), settings.engine_options())
    assert (name, why) == ("transformers", "--cuda-graphs need the transformers engine")


def test_a_new_engine_is_one_package_and_one_registry_line(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A package registering a backend with options of its own: its flag is a verifier
    setting, read into its own options model, with no other change."""

    class EchoOptions(BaseModel):
        echo_depth: int = Field(3, ge=1, description="how deep the echo engine echoes")

    class EchoBackend(Backend):
        name = "echo"
        options = EchoOptions

    package = types.ModuleType("tests.echo_engine")
    package.__dict__["__file__"] = __file__
    monkeypatch.setitem(sys.modules, "tests.echo_engine", package)
    monkeypatch.setattr(engines, "BUILT_IN", (*BUILT_IN, Plugin("echo", "tests.echo_engine",
                                                                 drafts=False)))
    engines.register(EchoBackend())
    try:
        settings_class = _with_engine_options()
        settings = settings_class(_cli_parse_args=["--model", "m", "--echo-depth", "5"])
        assert settings.engine_options()["echo"] == EchoOptions(echo_depth=5)
    finally:
        engines._registered.pop("echo")


CLIENT_IMPORTS = """
import sys
from shared.engines import resolve
resolve("auto", sys.argv[1], "cpu", drafter=sys.argv[2] == "drafter")
print(sorted(m for m in sys.modules if m in {p} ))
"""


@pytest.mark.parametrize("side", ["drafter", "target"])
def test_the_client_imports_no_engine_that_only_serves_targets(side: str,
                                                               tmp_path: Path) -> None:
    """A drafter resolved by ``auto`` imports only the engines that draft; the negative
    control (a target) asks every engine in order and imports them all."""
    target_only = {p.package for p in BUILT_IN if not p.drafts}
    code = CLIENT_IMPORTS.replace("{p}", repr(target_only))
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "a-folder"), side],
                         capture_output=True, text=True, cwd=ROOT, check=True).stdout
    imported = set(ast.literal_eval(out.strip().splitlines()[-1]))
    assert imported == (set() if side == "drafter" else target_only)
