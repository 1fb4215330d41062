"""The client's settings: one object, one set of defaults, each field declared once.

The Python API (``SpecDecClient(..., settings=)``), ``specdec generate`` / ``chat`` / ``serve``,
the demo and the benchmarks all build a client from a :class:`ClientSettings`. Each field is a
pydantic field, as the verifier's are (verifier_service/settings.py): its default, its bounds
and its description are written here once, pydantic checks every value however it arrives, and
the command line's flags (drafter_client/apps/flags.py) and the table in docs/configuration.md
are generated from these fields. The defaults were chosen by ``python -m scripts.bench client``
(docs/benchmarks.md): the cost model picks k per block (0 where drafting does not pay, then
plain steps), the model drafter is hybrid with prompt lookup, dtype ``auto`` is measured on this
machine, greedy, 128 new tokens.

This module imports nothing heavy (pydantic, no torch), so the command line can parse and check
its flags (and print ``--help``) before it loads torch and transformers.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from pydantic import Field, field_validator, model_validator
from pydantic.dataclasses import dataclass

from shared.engines import DRAFTING_ENGINES
from shared.http.limits import HTTP_LIMITS

if TYPE_CHECKING:
    from shared.protocol.schema import SamplingParams

MODEL_FREE_DRAFTERS = ("ngram", "prompt-lookup", "bigram")

T = TypeVar("T")


def replaced(settings: T, **values: Any) -> T:
    """``settings`` with the fields given a value (not None) replaced: a call's own values over
    the client's (checked again, as every settings object is when it is made)."""
    given = {k: v for k, v in values.items() if v is not None}
    return dataclasses.replace(settings, **given)  # type: ignore[type-var]


def cli(flag: str | None = None, *, short: str | None = None, env: str | None = None,
        metavar: str | None = None) -> dict[str, Any]:
    """A field's command-line spelling where it is not ``--field-name``: ``flag`` (``""``: no
    flag), a ``short`` alias, the ``env`` variable its default comes from, a ``metavar``."""
    spelled = {"flag": flag, "short": short, "env": env, "metavar": metavar}
    return {key: value for key, value in spelled.items() if value is not None}


@dataclass(frozen=True)
class DrafterOptions:
    """Options of the built-in drafters (drafter_client/model_free.py) and of a model drafter."""

    ngram_n: int = Field(default=3, ge=2, description="ngram: the order n")
    ngram_kind: Literal["simple", "multi"] = Field(
        default="multi", description="ngram: fixed n (SimpleDynaGram) or all orders 2..n longest "
        "first (MultiDynaGram)")
    ngram_top_k_filler: int = Field(
        default=0, ge=0, description="ngram: also learn the target's top-K ids at each scored "
        "position", json_schema_extra=cli(metavar="K"))
    ngram_stop_if_unknown: bool = Field(
        default=False, description="ngram: stop a draft at an unknown context instead of padding "
        "it")
    lookup_min_ngram: int = Field(default=1, ge=1, description="prompt-lookup: shortest match")
    lookup_max_ngram: int = Field(default=12, ge=1, description="prompt-lookup: longest match (the "
                                  "longest match wins; a long one is trusted by its own record)")
    draft_min_prob: float = Field(
        default=0.0, ge=0.0, le=1.0, description="model drafter: stop a block when its top "
        "probability drops below P", json_schema_extra=cli(metavar="P"))
    tree_width: int = Field(
        default=1, ge=1, description="model drafter: draft a token tree - the drafter's best "
        "chain and, at each position, up to W-1 runner-up tokens as leaves (1: a chain)",
        json_schema_extra=cli(metavar="W"))
    lookup: bool = Field(
        default=True, description="model drafter: hybrid with prompt lookup - a trusted match in "
        "the context drafts for free, the model drafts where there is none "
        "(drafter_client/hybrid.py; --no-lookup: the model alone)")
    lookup_tokens: int = Field(
        default=0, ge=0, description="hybrid: the longest prompt-lookup draft (0: the block's k)",
        json_schema_extra=cli(metavar="N"))
    overlap: bool = Field(
        default=False, description="model drafter: draft the next block while this one is verified "
        "(pays off when the verifier runs on other cores or another host)")
    cuda_graphs: bool = Field(
        default=False, description="model drafter: keep its KV cache in a preallocated slot and "
        "replay its one-token steps as captured CUDA graphs (a GPU client; on a CPU the same "
        "static steps run eagerly; shared/engines/transformers/pooled_drafter.py)")
    engine: str = Field(
        default="auto", description="what runs a model drafter (shared/engines); auto: the first "
        "engine that claims the model (on a CPU with the [llama] extra, llama.cpp for a .gguf "
        "file or a short name whose GGUF is kept; else transformers)",
        json_schema_extra=cli("--drafter-engine"))
    threads: int = Field(
        default=0, ge=0, description="CPU threads of the drafter (torch's intra-op threads for "
        "the process, or llama.cpp's); 0: the engine's default")

    @field_validator("engine")
    @classmethod
    def _drafting_engine(cls, engine: str) -> str:
        if engine not in DRAFTING_ENGINES:
            raise ValueError(f"must be one of {', '.join(DRAFTING_ENGINES)}")
        return engine

    @model_validator(mode="after")
    def _lookup_range(self) -> DrafterOptions:
        if self.lookup_min_ngram > self.lookup_max_ngram:
            raise ValueError(f"lookup_min_ngram (--lookup-min-ngram) {self.lookup_min_ngram} "
                             f"is above lookup_max_ngram (--lookup-max-ngram) "
                             f"{self.lookup_max_ngram}")
        return self


def _wire(name: str, description: str, default: Any = None) -> Any:
    """A sampling field with the bounds of the wire's (shared/protocol/schema.py), which the
    verifier checks again: the bounds are written there once."""
    from shared.protocol.schema import SamplingParams

    wire = SamplingParams.model_fields[name]
    bounds = {key: getattr(bound, key) for bound in wire.metadata
              for key in ("ge", "gt", "le", "lt") if hasattr(bound, key)}
    return Field(default=wire.default if default is None else default, description=description,
                 allow_inf_nan=False, **bounds)


@dataclass(frozen=True)
class Sampling:
    """A generation's sampling and length."""

    max_new_tokens: int = Field(default=128, ge=1, description="new tokens at most")
    temperature: float = _wire("temperature", "0 means greedy")
    top_k: int = _wire("top_k", "0 disables top-k")
    top_p: float = _wire("top_p", "1.0 disables top-p")
    seed: int = _wire("coupling_seed", "the seed of the client's draws (with --reproducible: "
                     "of the noise both sides draw by)", default=0)
    reproducible: bool = Field(
        default=False, description="sampled output identical to the target alone's with the same "
        "--seed, whatever the drafter, -k or timing (Gumbel-max with noise shared by drafter "
        "and target; costs some acceptance)")

    def params(self) -> SamplingParams:
        """The wire form both sides process logits by (``reproducible``: its coupling seed)."""
        from shared.protocol.schema import SamplingParams

        return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                              coupling_seed=self.seed if self.reproducible else None)


@dataclass(frozen=True)
class GatewaySettings:
    """What ``specdec serve`` (the OpenAI gateway) is built from."""

    served_model_name: str = Field(default="", description="the model name clients send (default: "
                                   "the verifier's model)")
    host: str = Field(default="127.0.0.1", description="bind address")
    port: int = Field(default=8080, ge=1, le=65535, description="bind port")
    max_concurrency: int = Field(default=8, ge=1, description="generations running at once (the "
                                 "verifier batches them)")
    max_waiting: int = Field(default=64, ge=0, description="requests waiting for a slot beyond "
                             "--max-concurrency; more get 429")
    # the template's text: --chat-template names a file that holds it (drafter_client/apps/cli)
    chat_template: str | None = Field(
        default=None, description="a Jinja chat template to use instead of the tokenizer's",
        json_schema_extra=cli(""))
    # never a flag: ps shows a command line to every user (--serve-api-key-file or a variable)
    api_key: str | None = Field(default=None, repr=False, description="clients must send it as a "
                                "Bearer token", json_schema_extra=cli(""))
    allowed_hosts: tuple[str, ...] = Field(
        default=(), description="comma-separated Host names to answer to besides 127.0.0.1, "
        "localhost, [::1] and --host (name: any port, name:port; *: any Host); other Hosts get "
        "421 (DNS rebinding). With --host 0.0.0.0 and none set, any Host "
        "(shared/http/cross_site.py)",
        json_schema_extra=cli(env="SPECDEC_SERVE_ALLOWED_HOSTS", metavar="HOSTS"))
    cors_origins: tuple[str, ...] = Field(
        default=(), description="comma-separated origins (https://app.example.com) whose web "
        "pages may call this API; none: no CORS headers, pages on other sites cannot",
        json_schema_extra=cli(env="SPECDEC_SERVE_CORS_ORIGINS", metavar="ORIGINS"))
    completion_max_tokens: int = Field(
        default=16, ge=1, description="max_tokens of a /v1/completions request that sets none "
        "(OpenAI's default)")
    max_body_bytes: int = Field(default=HTTP_LIMITS.max_body_bytes, ge=1024, description="largest "
                                "request body; beyond it 413, before it is parsed")
    body_timeout_s: float = Field(default=HTTP_LIMITS.body_timeout_s, gt=0, description="a request "
                                  "body must arrive within this many seconds, or 408")
    header_timeout_s: float = Field(
        default=HTTP_LIMITS.header_timeout_s, gt=0, description="a request head must arrive within "
        "this many seconds of connecting or of the last response, or 408 and closed")
    keep_alive_s: float = Field(default=HTTP_LIMITS.keep_alive_s, gt=0, description="an idle "
                                "keep-alive connection is closed after this many seconds")
    # Prompts longer than INLINE_TOKENIZE_CHARS are tokenized on one worker thread; shorter
    # ones (a millisecond or two) where they arrive, so they never wait behind a long one.
    max_tokenizing: int = Field(
        default=4, ge=1, description="long prompts tokenizing or waiting to at once; more get 429")

    @field_validator("allowed_hosts", "cors_origins")
    @classmethod
    def _addresses(cls, entries: tuple[str, ...], info: Any) -> tuple[str, ...]:
        from shared.http.cross_site import check_allowed_hosts, check_cors_origins

        check = check_allowed_hosts if info.field_name == "allowed_hosts" else check_cors_origins
        problem = check(entries)
        if problem is not None:
            raise ValueError(problem.split(": ", 1)[1])
        return entries

    def serving(self, model: str) -> GatewaySettings:
        """These settings with ``model`` (the verifier's) as the served name where none is set."""
        return self if self.served_model_name else dataclasses.replace(
            self, served_model_name=model)


@dataclass(frozen=True)
class ClientSettings:
    """Everything a client is built from but the verifier's URL, the drafter and the tokenizer.

    ``sampling``: what ``generate`` and ``baseline`` use where a call does not say."""

    num_draft_tokens: str = Field(
        default="auto", description="drafts per block: an integer, 'auto' (a cost model of "
        "measured acceptance, drafting time, verify cost per block size and round trip; it "
        "drafts nothing where no k pays) or 'heuristic' (grow by 2 after a fully accepted block, "
        "shrink by 1 otherwise)", json_schema_extra=cli(short="-k"))
    load_aware: bool = Field(
        default=True, description="-k auto prices each draft by what it costs the other sessions "
        "in the verifier's forward (its replies' load); off: by this client's own round trip "
        "alone (to measure what load-awareness does: scripts.bench serving)")
    options: DrafterOptions = dataclasses.field(default_factory=lambda: DrafterOptions())
    sampling: Sampling = dataclasses.field(default_factory=lambda: Sampling())
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto", description="a model drafter's dtype; auto: measured on this machine")
    device: str = Field(
        default="auto", description="a model drafter's device: auto (CUDA when there is one), "
        "cpu, cuda or cuda:N")
    timeout_s: float = Field(default=120.0, gt=0, description="HTTP timeout per call")
    retry_budget_s: float = Field(default=60.0, ge=0, description="how long to keep retrying a "
                                  "verifier that is down or overloaded before giving up (the "
                                  "first contact: at most 10 s)")
    simulated_rtt_ms: float = Field(
        default=0.0, ge=0, description="add this delay before every call to the verifier "
        "(network studies)")
    gateway: GatewaySettings = dataclasses.field(default_factory=lambda: GatewaySettings())

    @field_validator("num_draft_tokens", mode="before")
    @classmethod
    def _k_form(cls, spec: Any) -> str:
        """The form of -k here; its bound (the verifier's max_draft_tokens) once connected."""
        from drafter_client.draft_length import parse_k

        parse_k(str(spec))
        return str(spec)

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
