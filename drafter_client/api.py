"""Python API of the drafter client.

    from drafter_client import SpecDecClient
    client = SpecDecClient("http://127.0.0.1:8000", drafter="qwen2.5-coder-0.5b")
    result = client.generate("def fib(n):", max_new_tokens=64)  # -k auto, lookup + model
    print(result.text, result.metrics.to_dict())
    baseline = client.baseline("def fib(n):", max_new_tokens=64)  # target alone, same sampling
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import httpx
import torch

from drafter_client.draft_length import make_draft_length
from drafter_client.hybrid import HybridDrafter
from drafter_client.metrics import GenerationMetrics
from drafter_client.model_free import (
    BigramDrafter,
    NGramDrafter,
    PromptLookupDrafter,
    special_ids,
)
from drafter_client.outcome import BlockOutcome
from drafter_client.prediction import PredictionDrafter
from drafter_client.settings import (
    MODEL_FREE_DRAFTERS,
    ClientSettings,
    DrafterOptions,
    Sampling,
    replaced,
)
from drafter_client.speculative import (
    GenerationResult,
    GenerationSettings,
    finish_reason,
    read_logprobs,
    speculative_generate,
)
from drafter_client.transport import HttpVerifier, SpecDecError, Verifier
from shared.engines import Backend, DrafterModel, resolve
from shared.engines.drafter import Drafter
from shared.models.catalog import (
    ModelSpecError,
    load_tokenizer,
    tokenizer_fingerprint,
)
from shared.protocol.grammar import Constraint, GrammarError
from shared.protocol.schema import (
    PROTOCOL_VERSION,
    GenerateRequest,
    InfoResponse,
    SamplingParams,
)

log = logging.getLogger(__name__)

def build_model_free(name: str, options: DrafterOptions,
                     stop_ids: frozenset[int] = frozenset()) -> Drafter:
    if name == "ngram":
        return NGramDrafter.from_options(options)
    if name == "prompt-lookup":
        return PromptLookupDrafter(options.lookup_min_ngram, options.lookup_max_ngram,
                                   stop_ids)
    return BigramDrafter()


@dataclasses.dataclass(frozen=True)
class Penalties:
    """OpenAI's ``presence_penalty``, ``frequency_penalty`` and ``logit_bias`` ({id: bias})."""

    presence: float = 0.0
    frequency: float = 0.0
    logit_bias: dict[int, float] = dataclasses.field(default_factory=dict)


def with_penalties(params: SamplingParams, penalties: Penalties | None) -> SamplingParams:
    """``params`` with ``penalties`` in (checked against their bounds: SpecDecError)."""
    if penalties is None:
        return params
    try:
        return SamplingParams(**{**params.model_dump(), "presence_penalty": penalties.presence,
                                 "frequency_penalty": penalties.frequency,
                                 "logit_bias": sorted(penalties.logit_bias.items())})
    except ValueError as exc:
        raise SpecDecError(f"penalties: {exc}") from None


def _block_callback(on_tokens: Callable[[list[int]], None] | None,
                    on_block: Callable[[BlockOutcome], bool | None] | None,
                    ) -> Callable[[BlockOutcome], bool | None] | None:
    if on_tokens is None:
        return on_block

    def both(outcome: BlockOutcome) -> bool | None:
        on_tokens(outcome.tokens)
        return on_block(outcome) if on_block is not None else None

    return both


class SpecDecClient:
    """A drafter next to the user, a verifier behind ``verifier_url``.

    ``verifier_url``: the verifier's URL, or a ready :class:`Verifier` (e.g. an
    :class:`HttpVerifier` with its own settings). ``drafter``: a model spec (short name, folder,
    .gguf, hub id), one of the model-free drafters ``ngram``, ``prompt-lookup``, ``bigram``, a
    ready :class:`Drafter`, or None for baseline-only use. ``tokenizer``: a spec or a tokenizer
    object; defaults to the drafter's, else to the verifier's model spec when it resolves on this
    machine.
    """

    def __init__(self, verifier_url: str | Verifier, drafter: str | Drafter | None = None,
                 tokenizer: Any = None, dtype: str | None = None, device: str | None = None,
                 http_client: httpx.Client | None = None, timeout_s: float | None = None,
                 options: DrafterOptions | None = None,
                 simulated_rtt_ms: float | None = None, api_key: str | None = None,
                 retry_budget_s: float | None = None,
                 settings: ClientSettings | None = None) -> None:
        # One settings object (drafter_client/settings.py); the keywords are shorthands that
        # replace its fields.
        self.settings = replaced(settings or ClientSettings(), dtype=dtype, device=device,
                                 timeout_s=timeout_s, options=options,
                                 simulated_rtt_ms=simulated_rtt_ms,
                                 retry_budget_s=retry_budget_s)
        if self.options.threads:
            torch.set_num_threads(self.options.threads)
        self.verifier, self.info = self._connect(verifier_url, http_client, api_key)
        model_spec = (drafter if isinstance(drafter, str) and drafter not in MODEL_FREE_DRAFTERS
                      else None)
        backend = self._drafter_backend(model_spec, self.options, self.settings.device) \
            if model_spec else None
        self.tokenizer = self._tokenizer(tokenizer, backend, model_spec)
        self.drafter_name = (drafter if isinstance(drafter, str) or drafter is None
                             else getattr(drafter, "name", None))
        self._check_tokenizer()
        # How to build one more drafter of the same kind (fork): None for a ready Drafter.
        self._new_drafter: Callable[[], Drafter] | None = None
        self._drafter_model: DrafterModel | None = None  # a model drafter's, loaded once
        self.drafter_dtype: str | None = None  # a model drafter's dtype, and why
        self.drafter: Drafter | None = self._first_drafter(drafter, backend, model_spec)

    def _connect(self, verifier_url: str | Verifier, http_client: httpx.Client | None,
                 api_key: str | None) -> tuple[Verifier, InfoResponse]:
        """The verifier (over HTTP for a URL) and its ``/v1/info``, checked."""
        s = self.settings
        verifier: Verifier = verifier_url if not isinstance(verifier_url, str) else HttpVerifier(
            verifier_url, s.timeout_s, http_client, s.simulated_rtt_ms / 1e3,
            retry_budget_s=s.retry_budget_s,
            api_key=api_key if api_key is not None else os.environ.get("SPECDEC_API_KEY") or None)
        # The first contact gives up sooner: a wrong URL should not take the whole budget.
        info = verifier.info(budget_s=min(s.retry_budget_s, 10.0))
        if info.protocol_version != PROTOCOL_VERSION:
            raise SpecDecError(f"verifier speaks protocol {info.protocol_version}, this "
                               f"client {PROTOCOL_VERSION}")
        if any(t >= info.vocab_size for t in info.eos_token_ids):
            raise SpecDecError("the verifier sent an invalid reply: eos_token_ids outside its "
                               f"vocabulary of {info.vocab_size}")
        return verifier, info

    def _tokenizer(self, tokenizer: Any, backend: Backend | None, model_spec: str | None) -> Any:
        """The tokenizer given (an object, or a spec to load), else the drafter model's, else
        the verifier's model's."""
        try:
            if isinstance(tokenizer, str):
                return load_tokenizer(tokenizer)
            if tokenizer is None:
                return load_tokenizer(backend.tokenizer_spec(model_spec)
                                      if backend is not None and model_spec is not None
                                      else self.info.model)
        except (ModelSpecError, OSError) as exc:
            raise SpecDecError(f"cannot load a tokenizer: {exc}") from exc
        return tokenizer

    def _first_drafter(self, drafter: str | Drafter | None, backend: Backend | None,
                       model_spec: str | None) -> Drafter | None:
        """The drafter this client starts with: a model-free one by name, a model drafter on
        its engine (loaded once, warmed up), or the ready Drafter given."""
        options = self.options
        if isinstance(drafter, str) and drafter in MODEL_FREE_DRAFTERS:
            name = drafter
            self._new_drafter = lambda: build_model_free(name, options,
                                                         special_ids(self.tokenizer))
            try:
                return self._new_drafter()
            except ValueError as exc:
                raise SpecDecError(f"drafter {drafter}: {exc}") from exc
        if backend is not None and model_spec is not None:
            try:
                model = backend.load_drafter(model_spec, self.settings.dtype,
                                             self.settings.device, options.threads,
                                             options.cuda_graphs)
            except ModelSpecError as exc:
                raise SpecDecError(str(exc)) from exc
            log.info("drafter dtype: %s", model.dtype)
            self._check_drafter_model(model, options)
            self._drafter_model, self.drafter_dtype = model, model.dtype
            made = self._build_model_drafter(options)
            made.warm_up()  # type: ignore[attr-defined]  # LMDrafter or HybridDrafter
            return made
        if drafter is not None and not isinstance(drafter, Drafter):
            raise SpecDecError(f"drafter must be a model, a model-free drafter's name or a "
                               f"drafter_client.Drafter (got {type(drafter).__name__}: "
                               "subclass Drafter)")
        return drafter

    @property
    def options(self) -> DrafterOptions:
        return self.settings.options

    @staticmethod
    def _drafter_backend(spec: str, options: DrafterOptions, device: str) -> Backend:
        """The engine the drafter model runs on (``options.engine``)."""
        try:
            return resolve(options.engine, spec, device, drafter=True,
                           cuda_graphs=options.cuda_graphs)
        except ModelSpecError as exc:
            raise SpecDecError(f"drafter engine: {exc}") from exc

    def _check_drafter_model(self, model: DrafterModel, options: DrafterOptions) -> None:
        """The drafter must be the target's kind of model, and drafts what the target checks."""
        if model.encoder_decoder != self.info.is_encoder_decoder:
            kinds = ("an encoder-decoder", "a decoder-only")
            raise SpecDecError(
                f"drafter {model.spec} is {kinds[0] if model.encoder_decoder else kinds[1]} "
                f"model and the verifier's target {self.info.model} is "
                f"{kinds[0] if self.info.is_encoder_decoder else kinds[1]} one: use a "
                "drafter of the same kind, or a model-free drafter")
        if model.encoder_decoder and options.tree_width > 1:
            raise SpecDecError("token trees are verified for decoder-only targets only: "
                               "use tree_width 1 with an encoder-decoder pair")

    def _build_model_drafter(self, options: DrafterOptions) -> Drafter:
        """A drafter on the loaded drafter model with these options (its weights shared)."""
        model = self._drafter_model
        assert model is not None
        # A drafter's context: the verifier's longest, plus a block drafted ahead of it and
        # one more drafted while that block is in flight (--overlap).
        context_tokens = self.info.max_context + 2 * self.info.max_draft_tokens + 2

        def new_drafter() -> Drafter:
            made = model.new_drafter(self.info.vocab_size, context_tokens,
                                     options.draft_min_prob, options.tree_width)
            if options.lookup and not model.encoder_decoder:
                return HybridDrafter(made, PromptLookupDrafter(
                    options.lookup_min_ngram, options.lookup_max_ngram,
                    special_ids(self.tokenizer)), options.lookup_tokens)
            return made

        try:
            made = new_drafter()
        except ValueError as exc:
            raise SpecDecError(f"drafter {model.spec}: {exc}") from exc
        self._new_drafter = new_drafter
        return made

    def with_options(self, options: DrafterOptions) -> SpecDecClient:
        """A client like this one (same verifier connection, tokenizer and drafter model, its
        weights shared) drafting with other options; model drafters only."""
        if self._drafter_model is None:
            raise SpecDecError("with_options() needs a model drafter given by name")
        if (options.cuda_graphs, options.engine) != (self.options.cuda_graphs,
                                                     self.options.engine):
            # cuda_graphs sets the shared model's attention to the slot pool's, for good
            raise SpecDecError("with_options() cannot change cuda_graphs or engine: the "
                               "drafter model is shared")
        twin = self._twin()
        twin.settings = dataclasses.replace(self.settings, options=options)
        twin.drafter = twin._build_model_drafter(options)
        return twin

    def fork(self) -> SpecDecClient:
        """A client for one more concurrent generation: the same verifier, tokenizer and drafter
        model (its weights shared, not copied), with its own drafter state and, over HTTP, its
        own counters on the same connection pool. A client generates one sequence at a time;
        run concurrent generations on forks."""
        if self.drafter is not None and self._new_drafter is None:
            raise SpecDecError("fork() needs a drafter given by name (a ready Drafter object "
                               "cannot be copied)")
        twin = self._twin()
        twin.drafter = self._new_drafter() if self._new_drafter is not None else None
        return twin

    def _twin(self) -> SpecDecClient:
        """A shallow copy with its own verifier counters (over HTTP: on the same pool)."""
        twin = copy.copy(self)
        if isinstance(self.verifier, HttpVerifier):
            twin.verifier = self.verifier.clone()
        return twin

    def _check_tokenizer(self) -> None:
        ours = tokenizer_fingerprint(self.tokenizer)
        if ours != self.info.tokenizer_fingerprint:
            raise SpecDecError(
                f"tokenizer mismatch: drafter {self.drafter_name or 'tokenizer'!s} "
                f"(fingerprint {ours}) and verifier model {self.info.model} (fingerprint "
                f"{self.info.tokenizer_fingerprint}) map ids to different tokens"
            )

    def encode(self, prompt: str | list[int], chat: bool = False) -> list[int]:
        """Token ids of a prompt. For an encoder-decoder target the prompt is the encoder's
        input, encoded as the tokenizer does for it (with its special tokens, e.g. T5's </s>)."""
        if isinstance(prompt, list):
            return prompt
        if chat:
            return self.encode_chat([{"role": "user", "content": prompt}])
        special = self.info.is_encoder_decoder
        return list(self.tokenizer.encode(prompt, add_special_tokens=special)) or [
            self.info.eos_token_ids[0]
        ]

    def inputs(self, prompt: str | list[int], chat: bool = False
               ) -> tuple[list[int], list[int] | None]:
        """(decoder prompt, encoder ids): the prompt's ids and None for a decoder-only target;
        [decoder start token] and the prompt's ids for an encoder-decoder one."""
        ids = self.encode(prompt, chat)
        if not self.info.is_encoder_decoder:
            return ids, None
        return [self.info.decoder_start_token_id or 0], ids

    def constraint(self, grammar: str | None) -> Constraint | None:
        """A generation's grammar state (None: unconstrained)."""
        if grammar is None:
            return None
        try:
            return Constraint.of(grammar, self.tokenizer, self.info.vocab_size,
                                 self.info.eos_token_ids)
        except GrammarError as exc:
            raise SpecDecError(str(exc)) from None

    def prediction_ids(self, prediction: str | list[int]) -> list[int]:
        """A prediction's ids: the text as it would appear inside an answer (no special
        tokens), or ids as given."""
        if isinstance(prediction, list):
            return prediction
        return list(self.tokenizer.encode(prediction, add_special_tokens=False))

    def encode_chat(self, messages: list[dict[str, str]],
                    chat_template: str | None = None) -> list[int]:
        """A conversation in the model's chat template (or ``chat_template``), ready for the
        assistant's answer."""
        if chat_template is None and not getattr(self.tokenizer, "chat_template", None):
            raise SpecDecError("the tokenizer has no chat template (give one with "
                               "--chat-template FILE)")
        ids = self.tokenizer.apply_chat_template(
            messages, chat_template=chat_template, add_generation_prompt=True, tokenize=True,
            return_dict=False)
        return list(ids)

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def generate(self, prompt: str | list[int], *, num_draft_tokens: int | str | None = None,
                 max_new_tokens: int | None = None, temperature: float | None = None,
                 top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                 chat: bool = False,
                 on_tokens: Callable[[list[int]], None] | None = None,
                 on_block: Callable[[BlockOutcome], bool | None] | None = None,
                 overlap: bool | None = None, reproducible: bool | None = None,
                 sampling: Sampling | None = None,
                 prediction: str | list[int] | None = None,
                 logprobs: int | None = None,
                 penalties: Penalties | None = None,
                 grammar: str | None = None) -> GenerationResult:
        """Speculative generation; exactly the target's distribution for these settings.

        An argument left out (None) is ``sampling``'s, else the client's ``settings``'
        (``settings.sampling``, ``settings.num_draft_tokens``, ``settings.options.overlap``).
        ``num_draft_tokens``: k, or ``"auto"`` (cost model) or ``"heuristic"`` (grow/shrink).
        ``on_tokens`` gets each block's new ids; ``on_block`` each :class:`BlockOutcome`
        (drafts, how many were accepted, the new ids) and ends the generation by returning True
        (finish_reason "stop"). ``overlap``: draft the next block while this one is verified
        (default: the client's ``DrafterOptions.overlap``). ``reproducible``: sampled output
        identical to ``baseline(..., reproducible=True)`` with the same seed, whatever the
        drafter, k or timing (Gumbel-max with noise shared by drafter and target).
        ``prediction``: text (or ids) the answer will mostly repeat, drafted from first
        (Predicted Outputs: ``drafter_client/prediction.py``; counts in ``result.prediction``).
        ``logprobs``: ``result.logprobs`` holds the target's raw log-probability of every token
        and of this many best alternatives (0: the tokens' alone), as ``baseline`` reports.
        ``penalties``: OpenAI's presence / frequency penalties and logit bias, applied to the
        target's rows as a plain decode applies them. ``grammar``: structured output, an
        llguidance grammar (``grammar.json_schema_grammar``, ``lark_grammar``) that every
        generated token keeps; the output follows the target constrained to it."""
        if self.drafter is None:
            raise SpecDecError("this client has no drafter; use baseline() or pass drafter=")
        s = self._sampling(sampling, max_new_tokens, temperature, top_k, top_p, seed,
                           reproducible)
        if num_draft_tokens is None:
            num_draft_tokens = self.settings.num_draft_tokens
        try:
            draft_length = make_draft_length(str(num_draft_tokens), self.info.max_draft_tokens,
                                             self.info.verify_ms, self.settings.load_aware)
        except ValueError as exc:
            raise SpecDecError(str(exc)) from exc
        try:
            prompt_ids, encoder_ids = self.inputs(prompt, chat)
            settings = GenerationSettings(
                with_penalties(s.params(), penalties), s.max_new_tokens, draft_length, s.seed,
                encoder_ids,
                overlap=self.options.overlap if overlap is None else overlap,
                logprobs=logprobs)
            drafter = (self.drafter if prediction is None
                       else PredictionDrafter(self.drafter, self.prediction_ids(prediction)))
            result = speculative_generate(self.verifier, drafter, prompt_ids, settings,
                                          self.info, _block_callback(on_tokens, on_block),
                                          self.constraint(grammar))
            if isinstance(drafter, PredictionDrafter):
                result.prediction = drafter.counts
        except SpecDecError as exc:
            if exc.partial is not None:
                exc.partial.text = self.decode(exc.partial.token_ids)
            raise
        result.text = self.decode(result.token_ids)
        return result

    def baseline(self, prompt: str | list[int], *, max_new_tokens: int | None = None,
                 temperature: float | None = None, top_k: int | None = None,
                 top_p: float | None = None, seed: int | None = None,
                 chat: bool = False, num_beams: int = 1, length_penalty: float = 1.0,
                 early_stopping: bool | str = False,
                 no_repeat_ngram_size: int = 0, reproducible: bool | None = None,
                 sampling: Sampling | None = None,
                 logprobs: int | None = None,
                 penalties: Penalties | None = None,
                 grammar: str | None = None) -> GenerationResult:
        """Target-only generation on the verifier (``/v1/generate``), same sampling settings;
        with ``num_beams`` > 1 (greedy only) beam search as transformers' ``generate`` does it,
        with ``length_penalty``, ``early_stopping`` (True, False or "never") and
        ``no_repeat_ngram_size``. Sampling left out (None) is ``sampling``'s, else the client's
        ``settings``'. ``logprobs``, ``penalties`` and ``grammar`` as in :meth:`generate` (the
        grammar's state kept on the verifier)."""
        s = self._sampling(sampling, max_new_tokens, temperature, top_k, top_p, seed,
                           reproducible)
        max_new_tokens = s.max_new_tokens
        prompt_ids, encoder_ids = self.inputs(prompt, chat)
        sent, received = self.verifier.bytes_sent, self.verifier.bytes_received
        started = time.perf_counter()
        try:
            reply = self.verifier.generate(GenerateRequest(
                prompt_ids=prompt_ids, max_new_tokens=max_new_tokens, seed=s.seed,
                sampling=with_penalties(s.params(), penalties),
                num_beams=num_beams, length_penalty=length_penalty,
                early_stopping=early_stopping,  # type: ignore[arg-type]
                no_repeat_ngram_size=no_repeat_ngram_size, encoder_ids=encoder_ids,
                logprobs=logprobs, grammar=grammar,
            ))
        except SpecDecError as exc:  # one call: nothing was generated
            exc.partial = GenerationResult(prompt_ids, [], GenerationMetrics(),
                                           finish_reason="error")
            raise
        if len(reply.token_ids) > max_new_tokens or any(
                t >= self.info.vocab_size for t in reply.token_ids):
            invalid = SpecDecError("the verifier sent an invalid reply: token_ids outside the "
                                   f"vocabulary or longer than {max_new_tokens}")
            invalid.partial = GenerationResult(prompt_ids, [], GenerationMetrics(),
                                               finish_reason="error")
            raise invalid
        metrics = GenerationMetrics(
            new_tokens=len(reply.token_ids), wall_s=time.perf_counter() - started,
            verify_forward_s=reply.forward_ms / 1e3,
            bytes_sent=self.verifier.bytes_sent - sent,
            bytes_received=self.verifier.bytes_received - received,
        )
        return GenerationResult(prompt_ids, reply.token_ids, metrics,
                                self.decode(reply.token_ids),
                                finish_reason(reply.token_ids, max_new_tokens,
                                              self.info.eos_token_ids),
                                logprobs=(None if logprobs is None else read_logprobs(
                                    reply.logprobs, reply.token_ids, self.info.vocab_size)))

    def _sampling(self, sampling: Sampling | None, max_new_tokens: int | None,
                  temperature: float | None, top_k: int | None, top_p: float | None,
                  seed: int | None, reproducible: bool | None) -> Sampling:
        """A call's sampling (else the client's) with the call's own values in place."""
        return replaced(sampling or self.settings.sampling, max_new_tokens=max_new_tokens,
                        temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                        reproducible=reproducible)

    def close(self) -> None:
        self.verifier.close()
