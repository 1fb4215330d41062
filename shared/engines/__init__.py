"""Engines as plug-ins: what runs the target on the verifier and the drafter model on the client.

Each engine is a package here that registers a :class:`Backend` when it is imported
(``transformers/``, ``llama_cpp/``); the verifier's settings and ``SpecDecClient`` both resolve
their ``engine`` setting through :func:`resolve` and load through the backend it returns::

    backend = resolve("auto", "qwen2.5-coder-1.5b", "cpu")    # w4a8 where its GGUF is kept
    target = backend.load_target(TargetOptions("qwen2.5-coder-1.5b"))     # verifier side
    model = backend.load_drafter("qwen2.5-coder-0.5b", dtype="auto", device="cpu")  # client
    drafter = model.new_drafter(vocab_size, context_tokens)

Importing this module loads no engine; :func:`resolve` imports the one it needs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Protocol

from shared.models.catalog import ModelSpecError

if TYPE_CHECKING:
    from shared.engines.drafter import LMDrafter
    from shared.engines.target import Engine, TargetOptions

# The built-in engines, in the order ``auto`` asks them (the first that claims a model wins;
# transformers claims everything, so it is last), and the package that registers each.
BUILT_IN = {"w4a8": "shared.engines.w4a8", "llama-cpp": "shared.engines.llama_cpp",
            "int8": "shared.engines.int8",
            "transformers": "shared.engines.transformers"}
ENGINES = ("auto", *BUILT_IN)


class DrafterModel(Protocol):
    """A drafter model loaded once; every concurrent generation drafts with a drafter of its
    own over the same weights."""

    spec: str
    dtype: str  # what it runs in, as the client reports it
    encoder_decoder: bool

    def new_drafter(self, vocab_size: int, context_tokens: int, min_prob: float = 0.0,
                    tree_width: int = 1) -> LMDrafter:
        """A drafter with its own cache of up to ``context_tokens`` tokens."""


class Backend(Protocol):
    name: str
    drafts: bool  # whether it loads drafter models too (``auto`` asks only these for one)

    def claims(self, spec: str, device: str) -> bool:
        """``auto`` picks this engine for ``spec`` on ``device``."""

    def tokenizer_spec(self, spec: str) -> str:
        """Where the tokenizer of ``spec`` loads from."""

    def load_target(self, options: TargetOptions) -> Engine:
        """The target, loaded, warmed up and ready to serve (the verifier's engine)."""

    def load_drafter(self, spec: str, dtype: str = "auto", device: str = "auto",
                     threads: int = 0, cuda_graphs: bool = False) -> DrafterModel:
        """A drafter model for the client."""


_registered: dict[str, Backend] = {}


def register(backend: Backend) -> None:
    """Make ``backend`` one of the engines ``resolve`` knows by its name."""
    _registered[backend.name] = backend


def backend(name: str) -> Backend:
    """The engine called ``name`` (a built-in one is imported on first use)."""
    if name not in _registered and name in BUILT_IN:
        importlib.import_module(BUILT_IN[name])
    if name not in _registered:
        raise ModelSpecError(f"engine must be one of {', '.join(ENGINES)}; got {name!r}")
    return _registered[name]


def resolve(engine: str, spec: str, device: str = "auto", drafter: bool = False) -> Backend:
    """The backend of an ``engine`` setting: itself, or for ``auto`` the first built-in engine
    that claims ``spec`` on ``device`` (for a ``drafter``, the first of those that draft)."""
    if engine != "auto":
        return backend(engine)
    for name in BUILT_IN:
        if (backend(name).drafts or not drafter) and backend(name).claims(spec, device):
            return backend(name)
    raise AssertionError("the transformers engine claims every model")
