"""The client's settings: one object, one set of defaults.

The Python API (``SpecDecClient(..., settings=)``), ``specdec generate`` / ``chat`` / ``serve``
(their flags default to these fields), the demo and the benchmarks all build a client from a
:class:`ClientSettings`. The defaults were chosen by ``python -m scripts.bench client``
(docs/benchmarks.md): the cost model picks k per block (0 where drafting does not pay, then
plain steps), the model drafter is hybrid with prompt lookup, dtype ``auto`` is measured on this
machine, greedy, 128 new tokens.

This module imports nothing heavy, so the command line can parse and check its flags (and print
``--help``) before it loads torch and transformers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from shared.http.limits import HTTP_LIMITS
from shared.protocol import GREEDY_TEMPERATURE, NO_TOP_K, NO_TOP_P

if TYPE_CHECKING:
    from shared.protocol.schema import SamplingParams

MODEL_FREE_DRAFTERS = ("ngram", "prompt-lookup", "bigram")

T = TypeVar("T")


def replaced(settings: T, **values: Any) -> T:
    """``settings`` with the fields given a value (not None) replaced: a call's own values over
    the client's."""
    given = {k: v for k, v in values.items() if v is not None}
    return dataclasses.replace(settings, **given)  # type: ignore[type-var]


@dataclass(frozen=True)
class DrafterOptions:
    """Options of the built-in drafters (see drafter_client/model_free.py)."""

    ngram_n: int = 3
    ngram_kind: str = "multi"  # "simple" (SimpleDynaGram) or "multi" (MultiDynaGram)
    ngram_top_k_filler: int = 0
    ngram_stop_if_unknown: bool = False
    lookup_min_ngram: int = 1
    lookup_max_ngram: int = 12  # the longest match wins; a long one is trusted by its own record
    draft_min_prob: float = 0.0  # model drafter: stop a block below this top probability
    tree_width: int = 1  # model drafter: > 1 drafts a token tree (runner-ups as leaves)
    lookup: bool = True  # model drafter: hybrid with prompt lookup (drafter_client/hybrid.py)
    lookup_tokens: int = 0  # hybrid: longest lookup draft; 0: the block's k
    overlap: bool = False  # model drafter: draft the next block while this one is verified
    # model drafter: KV in a slot, one-token steps as CUDA graphs
    # (shared/engines/transformers/pooled_drafter.py)
    cuda_graphs: bool = False
    # model drafter: what runs it - transformers, or llama.cpp for a GGUF (shared/llama_runtime)
    engine: str = "auto"
    # the drafter's CPU threads: torch's intra-op threads (set for the process) or llama.cpp's;
    # 0: the engine's default (every core this process may use)
    threads: int = 0


@dataclass(frozen=True)
class Sampling:
    """A generation's sampling and length (the verifier checks them again:
    shared/protocol/schema.py)."""

    max_new_tokens: int = 128
    temperature: float = GREEDY_TEMPERATURE  # 0: greedy
    top_k: int = NO_TOP_K  # 0: off
    top_p: float = NO_TOP_P  # 1: off
    seed: int = 0
    # sampled output identical to the target alone's with the same seed (Gumbel-max noise
    # shared by drafter and target), whatever the drafter, k or timing
    reproducible: bool = False

    def params(self) -> SamplingParams:
        """The wire form both sides process logits by (``reproducible``: its coupling seed)."""
        from shared.protocol.schema import SamplingParams

        return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                              coupling_seed=self.seed if self.reproducible else None)


@dataclass(frozen=True)
class GatewaySettings:
    """What ``specdec serve`` (the OpenAI gateway) is built from; its flags default to these."""

    served_model_name: str = ""  # the name clients send; empty: the verifier's model
    host: str = "127.0.0.1"
    port: int = 8080
    max_concurrency: int = 8  # generations running at once (worker threads)
    max_waiting: int = 64  # admitted requests waiting for a worker; beyond: 429
    chat_template: str | None = None  # overrides the tokenizer's
    api_key: str | None = None  # clients must send it as a Bearer token
    # Host names served beyond the loopback names and the bind address ("name" any port,
    # "name:port"; "*": any); bound to 0.0.0.0 with none set, any Host (shared/http/cross_site.py)
    allowed_hosts: tuple[str, ...] = ()
    # Origins whose pages may call the API (CORS); none: no CORS headers at all
    cors_origins: tuple[str, ...] = ()
    completion_max_tokens: int = 16  # OpenAI's default max_tokens for /v1/completions
    # shared/http/limits.py: larger bodies get 413, slower bodies 408, slower heads 408 and
    # close, idle keep-alive connections close
    max_body_bytes: int = HTTP_LIMITS.max_body_bytes
    body_timeout_s: float = HTTP_LIMITS.body_timeout_s
    header_timeout_s: float = HTTP_LIMITS.header_timeout_s
    keep_alive_s: float = HTTP_LIMITS.keep_alive_s
    # Prompts longer than INLINE_TOKENIZE_CHARS are tokenized on one worker thread, at most
    # this many at once or waiting for it; beyond: 429. Shorter ones (a millisecond or two)
    # are tokenized where they arrive, so they never wait behind a long one.
    max_tokenizing: int = 4

    def serving(self, model: str) -> GatewaySettings:
        """These settings with ``model`` (the verifier's) as the served name where none is set."""
        return self if self.served_model_name else dataclasses.replace(
            self, served_model_name=model)


@dataclass(frozen=True)
class ClientSettings:
    """Everything a client is built from but the verifier's URL, the drafter and the tokenizer.

    ``num_draft_tokens``: the k policy - an integer, ``"auto"`` (a cost model of measured
    acceptance, drafting time, verify cost per block size and round trip; it drafts nothing
    where no k pays) or ``"heuristic"`` (grow by 2 after a fully accepted block, shrink by 1).
    ``dtype`` / ``device``: a model drafter's (``auto``: measured on this machine / CUDA when
    there is one). ``sampling``: what ``generate`` and ``baseline`` use where a call does not
    say. The connection: ``timeout_s`` per HTTP call, ``retry_budget_s`` to keep retrying a
    verifier that is down or overloaded, ``simulated_rtt_ms`` added before every call.
    ``load_aware``: ``-k auto`` prices each draft by what it costs the other sessions in the
    verifier's forward (its replies' ``load``); False judges blocks by this client's own round
    trip alone (to measure what load-awareness does: ``scripts.bench serving``)."""

    num_draft_tokens: str = "auto"
    load_aware: bool = True
    options: DrafterOptions = field(default_factory=DrafterOptions)
    sampling: Sampling = field(default_factory=Sampling)
    dtype: str = "auto"
    device: str = "auto"
    timeout_s: float = 120.0
    retry_budget_s: float = 60.0
    simulated_rtt_ms: float = 0.0
    gateway: GatewaySettings = field(default_factory=GatewaySettings)  # specdec serve's

    def describe(self, drafter: str | None) -> str:
        """One line saying what a client with these settings runs (the demo prints it)."""
        o = self.options
        if drafter is None:
            kind = "no drafter (the target alone)"
        elif drafter in MODEL_FREE_DRAFTERS:
            kind = f"{drafter} drafter"
        else:
            how = "hybrid with prompt lookup" if o.lookup else "the model alone"
            kind = f"model drafter {drafter} ({how}, engine {o.engine}, dtype {self.dtype})"
        extras = [name for name, on in (("overlap", o.overlap), ("cuda graphs", o.cuda_graphs),
                                        (f"trees of width {o.tree_width}", o.tree_width > 1))
                  if on]
        s = self.sampling
        mode = ("greedy" if s.temperature == 0 else
                f"temperature {s.temperature}, top-k {s.top_k}, top-p {s.top_p}")
        return (f"{kind}; k {self.num_draft_tokens}{''.join(', ' + e for e in extras)}; "
                f"{mode}; up to {s.max_new_tokens} new tokens")


DEFAULTS = ClientSettings()
DEFAULT_K = DEFAULTS.num_draft_tokens
DEFAULT_OPTIONS = DEFAULTS.options
GATEWAY = DEFAULTS.gateway
