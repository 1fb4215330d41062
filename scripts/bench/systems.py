"""The systems both benchmark harnesses (``client``, ``suite``) run: a system string parsed into
settings, and one runner that holds the verifier clients and transformers' models and runs a
system on a prompt.

A system is a name plus settings: ``hf`` (transformers' target alone), ``hf assisted k=4`` (a
constant 4-token draft; without k transformers' default schedule), ``hf lookup k=10``;
``specdec alone`` (the verifier's ``/v1/generate``), ``specdec beam beams=4`` (its beam search);
``specdec model k=4``, ``specdec model k=auto lookup tree=2 overlap``, ``specdec ngram k=auto``
... (``min_prob=0.4``, ``reproducible`` also parse). ``specdec default`` is the client's default
setting.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from drafter_client import SpecDecClient
from drafter_client.settings import (
    DEFAULTS,
    MODEL_FREE_DRAFTERS,
    ClientSettings,
    DrafterOptions,
    Sampling,
)
from scripts.bench.common import assistant_defaults, hf_generate
from shared.models.catalog import load_causal_lm, pick_device, pick_dtype


@dataclass(frozen=True)
class System:
    """One parsed system string."""

    text: str
    kind: str  # "hf" or "specdec"
    method: str  # hf: alone / assisted / lookup; specdec: alone / model / a model-free drafter
    k: str | None = None
    options: DrafterOptions = field(default_factory=DrafterOptions)
    reproducible: bool = False
    beams: int = 1  # specdec beam: the number of beams

    @classmethod
    def parse(cls, text: str) -> System:
        words = text.split()
        kind, method, rest = words[0], words[1] if len(words) > 1 else "alone", words[2:]
        if kind not in ("hf", "specdec"):
            raise SystemExit(f"system {text!r}: starts with hf or specdec")
        k, reproducible, beams = None, False, 1
        opts: dict[str, Any] = {"lookup": False}  # a named method alone unless it says lookup
        if method == "default":
            method, k, opts = ("model", DEFAULTS.num_draft_tokens,
                               dataclasses.asdict(DEFAULTS.options))
        for word in rest:
            key, _, value = word.partition("=")
            if key == "k":
                k = value
            elif key in ("lookup", "overlap"):
                opts[key] = True
            elif key == "no-lookup":
                opts["lookup"] = False
            elif key == "tree":
                opts["tree_width"] = int(value)
            elif key == "min_prob":
                opts["draft_min_prob"] = float(value)
            elif key == "reproducible":
                reproducible = True
            elif key == "beams":
                beams = int(value)
            else:
                raise SystemExit(f"system {text!r}: unknown setting {word!r}")
        return cls(text, kind, method, k, DrafterOptions(**opts), reproducible, beams)

    def drafter_options(self, engine: str) -> DrafterOptions:
        """The system's drafter options, its drafter model run by ``engine``."""
        return dataclasses.replace(self.options, engine=engine)

    def client_settings(self, dtype: str, engine: str = "transformers") -> ClientSettings:
        """The client settings of a specdec system: the client's defaults where it is silent;
        ``engine``: what runs the drafter model."""
        return dataclasses.replace(DEFAULTS, num_draft_tokens=self.k or DEFAULTS.num_draft_tokens,
                                   options=self.drafter_options(engine), dtype=dtype)


@dataclass
class Run:
    tokens: list[int]
    wall_s: float
    metrics: dict[str, Any] = field(default_factory=dict)  # the generation's, for specdec
    text: str | None = None  # the verifier's own decoding (alone, beam): its text


class Runner:
    """The verifier clients and transformers' models of a run; runs a system on a prompt.
    ``hf``: load transformers' target and drafter (on ``device``) for the ``hf`` systems."""

    def __init__(self, url: str, target: str, drafter: str, dtype: str,
                 systems: list[System], hf: bool = True, device: str = "cpu",
                 engine: str = "transformers") -> None:
        self.clients: dict[str, SpecDecClient] = {}
        self.base = SpecDecClient(url, None, tokenizer=drafter)
        model_client: SpecDecClient | None = None  # one drafter model for every setting
        for s in systems:
            if s.kind != "specdec" or s.method in ("alone", "beam"):
                continue
            if s.method in MODEL_FREE_DRAFTERS:
                self.clients[s.text] = SpecDecClient(url, s.method, tokenizer=drafter,
                                                     settings=s.client_settings(dtype, engine))
            elif model_client is None:
                model_client = self.clients[s.text] = SpecDecClient(
                    url, drafter, settings=s.client_settings(dtype, engine))
            else:
                self.clients[s.text] = model_client.with_options(s.drafter_options(engine))
        self.hf_target: Any = None
        self.hf_drafter: Any = None
        self.hf_defaults: dict[str, Any] = {}
        if hf:
            torch_device = pick_device(device)
            torch_dtype = pick_dtype(dtype, torch_device)
            self.hf_target = load_causal_lm(target, torch_dtype, torch_device)
            self.hf_drafter = load_causal_lm(drafter, torch_dtype, torch_device)
            self.hf_defaults = assistant_defaults(self.hf_drafter)

    def encode(self, text: str, chat: bool) -> list[int]:
        chat = chat and getattr(self.base.tokenizer, "chat_template", None) is not None
        return self.base.encode(text, chat=chat)

    def set_rtt(self, rtt_ms: float) -> None:
        for client in (self.base, *self.clients.values()):
            client.verifier.simulated_rtt_s = rtt_ms / 1e3

    def warm(self, systems: list[System]) -> None:
        """Every system once on a short prompt, so no measured run pays for a first call."""
        ids = self.encode("def f(x):", chat=False)
        for s in {s.text: s for s in systems}.values():
            self.run(s, ids, Sampling(), max_new=4)

    def run(self, s: System, ids: list[int], sampling: Sampling, max_new: int) -> Run:
        kw = {"temperature": sampling.temperature, "top_p": sampling.top_p,
              "seed": sampling.seed}
        if s.kind == "hf":
            return self._hf(s, ids, sampling, max_new)
        if s.method in ("alone", "beam"):
            result = self.base.baseline(ids, max_new_tokens=max_new, num_beams=s.beams,
                                        reproducible=s.reproducible, **kw)  # type: ignore[arg-type]
            return Run(result.token_ids, result.metrics.wall_s, result.metrics.to_dict(),
                       result.text)
        result = self.clients[s.text].generate(
            ids, num_draft_tokens=s.k or DEFAULTS.num_draft_tokens, max_new_tokens=max_new,
            reproducible=s.reproducible, **kw)  # type: ignore[arg-type]
        return Run(result.token_ids, result.metrics.wall_s, result.metrics.to_dict())

    def _hf(self, s: System, ids: list[int], sampling: Sampling, max_new: int) -> Run:
        if self.hf_target is None:
            raise SystemExit(f"system {s.text!r} needs transformers' models (not loaded)")
        tokens, wall = hf_generate(
            self.hf_target, ids, max_new, self.base.info.eos_token_ids, method=s.method,
            k=int(s.k) if s.k is not None else None, drafter=self.hf_drafter,
            defaults=self.hf_defaults, temperature=sampling.temperature, top_p=sampling.top_p,
            seed=sampling.seed)
        return Run(tokens, wall, {"new_tokens": len(tokens),
                                  "tokens_per_s": round(len(tokens) / wall, 3)})
