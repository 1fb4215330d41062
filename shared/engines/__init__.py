"""Engines as plug-ins: what runs the target on the verifier and the drafter model on the client.

An engine is a package here with a :class:`Backend` that it registers when imported, and one
line in :data:`BUILT_IN`. The backend owns everything about the engine: its options (a pydantic
model whose fields become the verifier's flags and ``SPECDEC_*`` variables), their checks, its
part in ``--engine auto`` (:meth:`Backend.claims`, :meth:`Backend.challenges`,
:meth:`Backend.placement`) and any process hooks (:meth:`Backend.preflight`,
:meth:`Backend.serve`). Nothing outside ``shared/engines`` names an engine::

    settings = Settings(model="qwen2.5-coder-1.5b")                           # verifier
    target = load_target("auto", settings.target_options(), settings.engine_options())
    model = resolve("auto", "qwen2.5-coder-0.5b", "cpu", drafter=True).load_drafter(...)
    drafter = model.new_drafter(vocab_size, context_tokens)                   # client

Importing this module loads no engine; the client imports only engines that draft.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from pydantic import BaseModel

from shared.models import ModelSpecError

if TYPE_CHECKING:
    from shared.engines.drafter import LMDrafter
    from shared.engines.target import Engine, TargetOptions

T = TypeVar("T")


@dataclass(frozen=True)
class Plugin:
    name: str
    package: str  # imported on first use; registers the backend
    drafts: bool  # loads drafter models too (the client imports only these)


# The built-in engines, in the order ``auto`` asks them (the first that claims a model wins;
# transformers claims everything, so it is last). Adding an engine is adding its package and
# one line here.
BUILT_IN = (
    Plugin("w4a8", "shared.engines.w4a8", drafts=False),
    Plugin("llama-cpp", "shared.engines.llama_cpp", drafts=True),
    Plugin("int8", "shared.engines.int8", drafts=False),
    Plugin("transformers", "shared.engines.transformers", drafts=True),
)
DEFAULT_KV_BUDGET = 65536  # KV tokens where the cache is not sized from free device memory
# The fewest tokens a session may hold: each start writes 16 tokens into a slot and times verify
# blocks after them (``target.BatchForward.warm_up_and_time``; the transformers engine's warm-up
# writes 16 + 5)
MIN_CONTEXT = 32
ENGINES = ("auto", *(plugin.name for plugin in BUILT_IN))
DRAFTING_ENGINES = ("auto", *(plugin.name for plugin in BUILT_IN if plugin.drafts))


class NoOptions(BaseModel):
    """An engine without options of its own."""


class DrafterModel(Protocol):
    """A drafter model loaded once; every concurrent generation drafts with a drafter of its
    own over the same weights."""

    spec: str
    dtype: str  # what it runs in, as the client reports it
    encoder_decoder: bool

    def new_drafter(self, vocab_size: int, context_tokens: int, min_prob: float = 0.0,
                    tree_width: int = 1) -> LMDrafter:
        """A drafter with its own cache of up to ``context_tokens`` tokens."""


class Backend:
    """One engine. The defaults describe an engine without options that serves targets on any
    device and never drafts; a package overrides what differs."""

    name = ""
    summary = ""  # what it runs, for the ``engine`` setting's help
    options: type[BaseModel] = NoOptions  # its own settings: flags, SPECDEC_* variables
    cpu_only = False  # refuses other devices; records its verify costs for ``auto``

    def claims(self, spec: str, device: str) -> bool:
        """``auto`` picks this engine for ``spec`` on ``device``."""
        return False

    def claims_drafter(self, spec: str, device: str, cuda_graphs: bool) -> bool:
        """``auto`` drafts ``spec`` on this engine."""
        return self.claims(spec, device) and not cuda_graphs

    def challenges(self, claimant: str, spec: str) -> bool:
        """``auto`` prices this engine against ``claimant`` (the engine that claimed ``spec``)
        by their recorded verify costs (``shared/engines/choice.py``)."""
        return False

    def placement(self, options: Any) -> list[str]:
        """The options set in ``options`` that only this engine honours: ``auto`` then picks
        it, and another engine named explicitly refuses them."""
        return []

    def check(self, target: TargetOptions) -> None:
        """Refuse common settings this engine cannot honour (ValueError)."""
        if self.cpu_only and target.device not in ("auto", "cpu"):
            raise ValueError(f"device {target.device!r}: the {self.name} engine runs on the "
                             "CPU")

    def passed_over(self, spec: str, device: str) -> str:
        """Why ``auto`` could not pick this engine for ``spec`` although it computes it (its
        kernels cannot be had here, say); "" where that is not so."""
        return ""

    def runs_gguf(self) -> bool:
        """Whether it can run a GGUF file on this machine (``specdec-fetch`` keeps the files
        where one can)."""
        return False

    def tokenizer_spec(self, spec: str) -> str:
        """Where the tokenizer of ``spec`` loads from."""
        return spec

    def preflight(self, options: Any) -> None:
        """Before anything loads: refuse a process this engine cannot run in
        (ModelSpecError)."""

    def serve(self, engine: Engine, serve: Callable[[], None],
              call: Callable[..., Any]) -> None:
        """Run ``serve`` (the HTTP server) for ``engine``; ``call`` runs a function on the
        model thread."""
        serve()

    def load_target(self, target: TargetOptions) -> Engine:
        """The target, loaded, warmed up and ready to serve (the verifier's engine);
        ``target.engine_options`` is an instance of :attr:`options`."""
        raise ModelSpecError(f"the {self.name} engine serves no targets")

    def load_drafter(self, spec: str, dtype: str = "auto", device: str = "auto",
                     threads: int = 0, cuda_graphs: bool = False) -> DrafterModel:
        """A drafter model for the client."""
        drafting = ", ".join(name for name in DRAFTING_ENGINES if name != "auto")
        raise ModelSpecError(f"the {self.name} engine serves targets; draft with {drafting}")


_registered: dict[str, Backend] = {}


def register(backend: Backend) -> None:
    """Make ``backend`` one of the engines ``resolve`` knows by its name."""
    _registered[backend.name] = backend


def backend(name: str) -> Backend:
    """The engine called ``name`` (a built-in one is imported on first use)."""
    plugin = next((p for p in BUILT_IN if p.name == name), None)
    if name not in _registered and plugin is not None:
        importlib.import_module(plugin.package)
    if name not in _registered:
        raise ModelSpecError(f"engine must be one of {', '.join(ENGINES)}; got {name!r}")
    return _registered[name]


def backends() -> list[Backend]:
    """Every built-in engine, in ``auto``'s order."""
    return [backend(plugin.name) for plugin in BUILT_IN]


def resolve(engine: str, spec: str, device: str = "auto", drafter: bool = False,
            cuda_graphs: bool = False) -> Backend:
    """The backend of an ``engine`` setting: itself, or for ``auto`` the first built-in engine
    that claims ``spec`` on ``device`` (for a ``drafter``, the first of those that draft)."""
    if engine != "auto":
        return backend(engine)
    for plugin in BUILT_IN:
        if drafter and plugin.drafts:
            if backend(plugin.name).claims_drafter(spec, device, cuda_graphs):
                return backend(plugin.name)
        elif not drafter and backend(plugin.name).claims(spec, device):
            return backend(plugin.name)
    raise ModelSpecError(f"no engine runs {spec!r} on {device!r}")


def runs_gguf() -> bool:
    """Whether an engine here runs GGUF files itself (not converted to another format)."""
    return any(each.runs_gguf() for each in backends())


# -- the verifier's side: options, checks, the choice, the load ------------------------------


def option_models() -> dict[str, type[BaseModel]]:
    """Each engine's options model, and ``auto``'s own (``shared/engines/choice.py``)."""
    from shared.engines.choice import AutoOptions

    return {"auto": AutoOptions, **{b.name: b.options for b in backends()}}


def check(engine: str, target: TargetOptions, options: Mapping[str, Any]) -> None:
    """Refuse settings that do not fit together (ValueError naming the flags): an engine named
    explicitly, with options that only another engine honours, or a device it cannot use."""
    if engine == "auto":
        pinned = [b for b in backends() if b.placement(options[b.name])]
        if len(pinned) > 1:
            raise ValueError(f"{_flags(pinned[0], options)} and {_flags(pinned[1], options)} "
                             "need two different engines")
        if pinned:
            pinned[0].check(target)
        return
    for other in backends():
        if other.name != engine and other.placement(options[other.name]):
            raise ValueError(f"{_flags(other, options)}: the {other.name} engine's; "
                             f"--engine {engine} cannot honour it")
    backend(engine).check(target)


def _flags(owner: Backend, options: Mapping[str, Any]) -> str:
    return ", ".join(f"--{name.replace('_', '-')}"
                     for name in owner.placement(options[owner.name]))


def preflight(options: Mapping[str, Any]) -> None:
    """Each engine's check of the process, before anything loads (ModelSpecError)."""
    for each in backends():
        each.preflight(options[each.name])


def choose(engine: str, target: TargetOptions, options: Mapping[str, Any]) -> tuple[str, str]:
    """The engine an ``engine`` setting loads, and why ``auto`` chose it where it weighed
    more than one."""
    from shared.engines.choice import Workload, price, recorded_costs

    if engine != "auto":
        return engine, ""
    pinned = [b for b in backends() if b.placement(options[b.name])]
    if pinned:
        return pinned[0].name, f"{_flags(pinned[0], options)} need the {pinned[0].name} engine"
    claimant = resolve("auto", target.model, target.device).name
    passed = "; ".join(why for b in backends() if b.name != claimant
                       and (why := b.passed_over(target.model, target.device)))
    challengers = [b.name for b in backends() if b.challenges(claimant, target.model)]
    if not challengers:
        return claimant, passed
    auto = options["auto"]
    candidates = [claimant, *challengers]
    choice = price(candidates, recorded_costs(target, options, candidates),
                   Workload(auto.expected_sessions, auto.expected_acceptance))
    return choice.engine, choice.why


def load_target(engine: str, target: TargetOptions, options: Mapping[str, Any]) -> Engine:
    """The target on the engine an ``engine`` setting resolves to, loaded, warmed up and ready
    to serve; a CPU engine's verify costs are kept for ``auto``'s later choices."""
    from shared.engines.choice import record_costs

    name, why = choose(engine, target, options)
    chosen = backend(name)
    try:
        chosen.check(target)
    except ValueError as exc:
        raise ModelSpecError(str(exc)) from None
    loaded = chosen.load_target(replace(target, engine_options=options[name]))
    if chosen.cpu_only:
        record_costs(target, name, options[name], loaded.info.verify_ms)
    loaded.info = replace(loaded.info, engine=name, engine_choice=why)
    if why:
        logging.getLogger(__name__).info("engine %s: %s", name, why)
    return loaded


def serve(engine: Engine, run: Callable[[], None], call: Callable[..., T]) -> None:
    """Serve ``engine`` through its backend's process hook (``Backend.serve``)."""
    backend(engine.info.engine).serve(engine, run, call)
