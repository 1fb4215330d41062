"""The wire schema, imported by both the verifier and the drafter client.

JSON bodies are serialised with orjson. Vocabulary-sized rows never travel as JSON lists of floats:
:class:`EncodedRow` carries base64 of little-endian float32 probabilities, plus int32 ids when the
row is sparse (top-k / top-p left a small support).

Positions: a session's ``position`` is the number of committed tokens (prompt + generated). The
verifier's KV cache holds all of them but the last, which the next verify call feeds first.
"""

from __future__ import annotations

import base64
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, Strict, field_validator

from shared.protocol import GREEDY_TEMPERATURE, NO_TOP_K, NO_TOP_P

if TYPE_CHECKING:  # torch loads where a tensor is made, not with the schema (the CLI checks
    # its flags against these models before it loads torch)
    import torch

    from shared.protocol.acceptance import Block, Verdict
    from shared.protocol.logprobs import TokenLogprobs
    from shared.protocol.sampling import SamplingConfig

PROTOCOL_VERSION = 1
INT32_MAX = 2**31 - 1
MAX_BEAMS = 64
MAX_TOP_LOGPROBS = 20  # the most alternatives a token's logprobs report (OpenAI's limit)
MAX_GRAMMAR_CHARS = 262144  # the longest grammar /v1/generate takes
MAX_LOGIT_BIAS = 1024  # the most ids a logit_bias names
# Integers a client sends are bounded here, so an absurd one is a 422 naming its field, never a
# failure deep inside (token ids are checked against the vocabulary by the verifier itself).
TokenId = Annotated[int, Field(ge=-INT32_MAX, le=INT32_MAX)]
Count = Annotated[int, Field(ge=0, le=INT32_MAX)]
Id = Annotated[int, Field(ge=0, le=INT32_MAX)]
Positive = Annotated[int, Field(ge=1, le=INT32_MAX)]
Value = TypeVar("Value")
# [id, value] on the wire (a JSON array of two; the container alone is not strict: a list is
# read as the pair, its items strictly)
Pair = Annotated[tuple[Annotated[int, Field(ge=0, le=INT32_MAX), Strict()], Value], Strict(False)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # "1", 1.0, true are not ids


class SamplingParams(_Strict):
    temperature: float = Field(GREEDY_TEMPERATURE, ge=0.0, le=100.0, allow_inf_nan=False,
                               description="0 means greedy; any value > 0 is exact, tiny ones "
                               "tend to greedy")
    top_k: int = Field(NO_TOP_K, ge=0, le=INT32_MAX, description="0 disables top-k")
    top_p: float = Field(NO_TOP_P, gt=0.0, le=1.0, allow_inf_nan=False,
                         description="1.0 disables top-p; the best token is always kept")
    coupling_seed: int | None = Field(
        None, ge=0, le=2**63 - 1, description="reproducible sampling: each position's token is "
        "the Gumbel-max choice under noise from (this seed, position), the same for the drafter "
        "and the target, so the output equals the target alone's with this seed whatever the "
        "drafter, k or timing; null: the client's uniforms decide")
    presence_penalty: float = Field(
        0.0, ge=-2.0, le=2.0, allow_inf_nan=False, description="subtracted from the logit of "
        "every token generated before (OpenAI's presence_penalty)")
    frequency_penalty: float = Field(
        0.0, ge=-2.0, le=2.0, allow_inf_nan=False, description="times a token's count among "
        "the tokens generated before, subtracted from its logit (OpenAI's frequency_penalty)")
    logit_bias: list[Pair[Annotated[float, Field(ge=-100.0, le=100.0, allow_inf_nan=False),
                                    Strict()]]] = Field(
        default_factory=list, max_length=MAX_LOGIT_BIAS, description="[id, bias] pairs added "
        "to those ids' logits (OpenAI's logit_bias); each id once")

    @field_validator("logit_bias")
    @classmethod
    def _once(cls, pairs: list[tuple[int, float]]) -> list[tuple[int, float]]:
        if len({i for i, _ in pairs}) != len(pairs):
            raise ValueError("an id appears more than once")
        return pairs

    def to_config(self) -> SamplingConfig:
        from shared.protocol.sampling import SamplingConfig

        return SamplingConfig(self.temperature, self.top_k, self.top_p, self.coupling_seed,
                              self.presence_penalty, self.frequency_penalty,
                              tuple((i, b) for i, b in self.logit_bias))


# Bounds on what a verifier answers: a client checks them before using a reply (relations to
# the request, such as next_token < vocab_size, are checked by the client's loop).


class InfoResponse(_Strict):
    protocol_version: int
    model: str
    vocab_size: Positive
    tokenizer_fingerprint: str
    eos_token_ids: list[Id]
    max_context: Positive
    max_draft_tokens: Count
    max_new_tokens: Positive
    dtype: str
    device: str
    # An encoder-decoder target: sessions take the source as encoder_ids, and the decoder
    # starts from decoder_start_token_id.
    is_encoder_decoder: bool = False
    decoder_start_token_id: Id | None = None
    # [k, ms]: a verify forward of k drafts (k + 1 new tokens) on a short cache in this
    # verifier's engine, measured at start; a client's `-k auto` starts from these costs.
    verify_ms: list[tuple[Count, float]] | None = None
    # How the target computes a block's rows: "exact" (as one-token steps: greedy speculation
    # equals the target alone's), "fast" (llama.cpp's multi-row kernels), or "inexact: <why>".
    kernels: str | None = None
    # The engine that runs the target (its name in shared/engines) and, under --engine
    # auto, why it was chosen.
    engine: str | None = None
    engine_choice: str | None = None


SESSION_ID_PATTERN = r"^[A-Za-z0-9_-]{8,64}$"
SESSION_HEADER = "X-Session-Id"  # sent with every session call, so a balancer can route by it
# set by an inference router (llm-d's session affinity) on an answer; the client echoes it on
# the session's later calls, so the router keeps the session on the replica that holds its KV
AFFINITY_HEADER = "x-session-token"
REPLICA_HEADER = "X-Verifier-Replica"  # which verifier answered


class CreateSessionRequest(_Strict):
    protocol_version: Count = PROTOCOL_VERSION
    prompt_ids: list[TokenId] = Field(min_length=1)
    sampling: SamplingParams = SamplingParams()
    session_id: str | None = Field(None, pattern=SESSION_ID_PATTERN,
                                   description="client-chosen id (lets a load balancer route the "
                                   "session's first call by it); the verifier picks one if null")
    encoder_ids: list[TokenId] | None = Field(
        None, min_length=1, description="encoder-decoder targets only (required there): the "
        "encoder's input; prompt_ids is then the decoder's prompt")
    prompt_length: Positive | None = Field(
        None, description="a reopened session (its first lost to eviction, expiry, a restart "
        "or a failover): how many of prompt_ids were the generation's prompt; the rest it "
        "generated, and an engine whose prompts round otherwise than its steps writes them as "
        "its steps did, so the session continues exactly as the lost one would have")


class CreateSessionResponse(_Strict):
    session_id: str
    position: Positive
    prefill_ms: float


class RowMask(_Strict):
    """The tokens a grammar allows at one row (structured output), in whichever form is the
    shortest: the ``allowed`` ids, every id but the ``forbidden`` ones (base64 of
    little-endian int32 ids), or ``bits``, base64 of the whole vocabulary's bitmask (bit i of
    byte i // 8, least significant first, is id i; ceil(vocab / 8) bytes: 19 KB a row for a
    151,936-id vocabulary, where a free-text pattern's ids took 170 KB)."""

    allowed: str | None = None
    forbidden: str | None = None
    bits: str | None = None

    @classmethod
    def of(cls, allowed: Any) -> RowMask:
        """From a [vocab] boolean array (numpy)."""
        import numpy as np

        ids = np.flatnonzero(allowed)
        others = len(allowed) - len(ids)
        if 4 * min(len(ids), others) <= (len(allowed) + 7) // 8:
            if len(ids) <= others:
                return cls(allowed=_b64(ids, "<i4"))
            return cls(forbidden=_b64(np.flatnonzero(~allowed), "<i4"))
        packed = np.packbits(np.asarray(allowed, dtype=bool), bitorder="little")
        return cls(bits=base64.b64encode(packed.tobytes()).decode())

    def keep(self, vocab_size: int) -> torch.Tensor:
        """[vocab_size] bool; ValueError for a mask that is not one (not exactly one form, ids
        outside the vocabulary, a bitmask of another length or with bits past the vocabulary,
        nothing allowed). Vectorised: a row of any form decodes in well under a millisecond."""
        import numpy as np
        import torch

        given = [f for f in (self.allowed, self.forbidden, self.bits) if f is not None]
        if len(given) != 1:
            raise ValueError("a row mask has exactly one of allowed, forbidden or bits")
        try:
            raw = base64.b64decode(given[0], validate=True)
        except ValueError:
            raise ValueError("a row mask is not base64") from None
        if self.bits is not None:
            if len(raw) != (vocab_size + 7) // 8:
                raise ValueError(f"a row mask's bits are {len(raw)} bytes; a vocabulary of "
                                 f"{vocab_size} takes {(vocab_size + 7) // 8}")
            bits = np.unpackbits(np.frombuffer(raw, dtype=np.uint8), bitorder="little")
            if bits[vocab_size:].any():
                raise ValueError(f"a row mask's bits allow ids past the vocabulary ({vocab_size})")
            keep = torch.from_numpy(bits[:vocab_size].astype(bool))
        else:
            if len(raw) % 4:
                raise ValueError("a row mask's ids are not whole int32 values")
            ids = np.frombuffer(raw, dtype="<i4")
            if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
                raise ValueError(f"a row mask names ids outside [0, {vocab_size})")
            keep = torch.zeros(vocab_size, dtype=torch.bool)
            keep[torch.from_numpy(ids.astype(np.int64))] = True
            if self.forbidden is not None:
                keep = ~keep
        if not bool(keep.any()):
            raise ValueError("a row mask allows no token")
        return keep


class VerifyRequest(_Strict):
    position: int = Field(ge=1, le=INT32_MAX,
                          description="committed tokens so far; must equal the session's")
    last_token: int = Field(ge=0, le=INT32_MAX,
                            description="the last committed token, not yet in the KV cache")
    draft_ids: list[TokenId] = Field(default_factory=list)
    draft_logprobs: list[float] | None = Field(
        None, description="log q_i(x_i) of each draft; null for a deterministic (one-hot) draft"
    )
    log_uniforms: list[float] = Field(default_factory=list, description="log u_i, one per draft")
    final_uniform: float = Field(ge=0.0, lt=1.0, description="uniform for the recovered/bonus draw")
    return_top_ids: int = Field(0, ge=0, le=64, description="also return the target's top-n ids "
                                "at each scored position (n-gram filler)")
    tree_parents: list[Annotated[int, Field(ge=-1, le=INT32_MAX)]] | None = Field(
        None, description="a token tree instead of a chain: the parent of each draft (-1: the "
        "last token; else an earlier draft's index); drafts are one-hot (draft_logprobs null)")
    more_uniforms: list[Annotated[float, Field(ge=0.0, lt=1.0)]] = Field(
        default_factory=list, description="a plain run (no drafts only): after the step that "
        "draws next_token, one more plain step per uniform, each drawing its token with it, "
        "stopping after an EOS id or at the context's end; their tokens come back in "
        "more_tokens (one round trip for several tokens)")
    logprobs: int | None = Field(
        None, ge=0, le=MAX_TOP_LOGPROBS, description="also return the target's raw "
        "log-probabilities (before temperature, top-k, top-p) of the output tokens and of "
        "this many best alternatives at each (0: the tokens' alone); null: none")
    history: list[Pair[Annotated[int, Field(ge=1, le=INT32_MAX), Strict()]]] = Field(
        default_factory=list, max_length=INT32_MAX, description="with presence or frequency "
        "penalties: [id, count] of every token generated so far (last_token included), each "
        "id once; the drafts before a row add theirs")
    masks: list[RowMask] | None = Field(
        None, description="structured output: the tokens the grammar allows at each scored "
        "row (k + 1: row 0 after last_token, row i after the first i drafts); the target's "
        "rows are masked to them before anything is decided")

    @field_validator("log_uniforms")
    @classmethod
    def _non_positive(cls, values: list[float]) -> list[float]:
        if any(not v <= 0.0 for v in values):
            raise ValueError("log uniforms must be <= 0")
        return values

    @classmethod
    def of(cls, block: Block, last_token: int, more_uniforms: list[float]) -> VerifyRequest:
        """The wire form of ``block`` (the sampling config travels once, at the session's
        create)."""
        return cls(position=block.position, last_token=last_token, draft_ids=block.draft_ids,
                   draft_logprobs=block.draft_logprobs, log_uniforms=block.log_uniforms,
                   final_uniform=block.final_uniform, return_top_ids=block.top_ids,
                   tree_parents=block.tree_parents, more_uniforms=more_uniforms,
                   logprobs=block.logprobs,
                   history=[(i, c) for i, c in block.history],
                   masks=list(block.masks) if block.masks is not None else None)

    def block(self, config: SamplingConfig, keep: torch.Tensor | None = None) -> Block:
        """The block this request carries, under its session's sampling ``config``; ``keep``:
        its masks, decoded already."""
        from shared.protocol.acceptance import Block

        return Block(self.draft_ids, self.draft_logprobs, self.log_uniforms, self.final_uniform,
                     config, self.position, self.tree_parents, self.return_top_ids,
                     self.logprobs, tuple((i, c) for i, c in self.history),
                     tuple(self.masks) if self.masks is not None else None, keep)


class EncodedRow(_Strict):
    """A probability row: dense (ids is None, probs has vocab entries) or sparse."""

    ids: str | None = None  # base64 of little-endian int32 ids
    probs: str  # base64 of little-endian float32 probabilities

    @classmethod
    def encode(cls, probs: torch.Tensor, sparse_below: float = 0.5) -> EncodedRow:
        """Send only the support when it covers less than ``sparse_below`` of the vocabulary."""
        import torch

        probs = probs.float().cpu()  # [vocab]
        support = torch.nonzero(probs > 0).flatten()
        if len(support) < sparse_below * len(probs):
            ids = support.numpy().astype("<i4")
            values = probs[support].numpy().astype("<f4")
            return cls(ids=base64.b64encode(ids.tobytes()).decode(),
                       probs=base64.b64encode(values.tobytes()).decode())
        return cls(probs=base64.b64encode(probs.numpy().astype("<f4").tobytes()).decode())

    def decode(self, vocab_size: int) -> torch.Tensor:
        """[vocab_size] float32 probabilities; ValueError for anything that is not a valid row
        (bad base64, wrong length, ids outside the vocabulary, negative, NaN or all zero)."""
        import numpy as np
        import torch

        values = np.frombuffer(base64.b64decode(self.probs, validate=True), dtype="<f4")
        if self.ids is None:
            if len(values) != vocab_size:
                raise ValueError(f"dense row has {len(values)} entries, expected {vocab_size}")
            row = torch.from_numpy(values.astype(np.float32))
        else:
            ids = np.frombuffer(base64.b64decode(self.ids, validate=True), dtype="<i4")
            if len(ids) != len(values) or not ((ids >= 0) & (ids < vocab_size)).all():
                raise ValueError(f"sparse row ids do not match its values or leave [0, "
                                 f"{vocab_size})")
            row = torch.zeros(vocab_size, dtype=torch.float32)
            row[torch.from_numpy(ids.astype(np.int64))] = torch.from_numpy(
                values.astype(np.float32))
        if not bool(torch.isfinite(row).all()) or bool((row < 0).any()) or not row.sum() > 0:
            raise ValueError("row is not a distribution (negative, NaN or all zero)")
        return row


def encode_logprobs(logprobs: torch.Tensor) -> list[float | None]:
    """JSON has no -inf: a zero probability travels as null."""
    return [None if v == float("-inf") else v for v in logprobs.tolist()]


def decode_logprobs(values: list[float | None]) -> torch.Tensor:
    import torch

    return torch.tensor([float("-inf") if v is None else v for v in values], dtype=torch.float64)


def _b64(values: Any, dtype: str) -> str:  # a list or an array
    import numpy as np

    return base64.b64encode(np.asarray(values, dtype=dtype).tobytes()).decode()


def _unb64(text: str, dtype: str) -> list[Any]:
    import numpy as np

    return np.frombuffer(base64.b64decode(text, validate=True), dtype=dtype).tolist()  # type: ignore[no-any-return]


class LogprobsEntry(_Strict):
    """One output token's raw log-probabilities (``logprobs.TokenLogprobs``); -inf travels
    as null. ``support_*``: base64 of little-endian int32 ids and float32 log-probabilities
    of every id a token the client draws can be."""

    logprob: float | None
    top_ids: list[Id]
    top_logprobs: list[float | None]
    support_ids: str | None = None
    support_logprobs: str | None = None

    @classmethod
    def of(cls, entry: TokenLogprobs) -> LogprobsEntry:
        support = entry.support
        return cls(logprob=_finite(entry.logprob), top_ids=[i for i, _ in entry.top],
                   top_logprobs=[_finite(v) for _, v in entry.top],
                   support_ids=_b64(support[0], "<i4") if support else None,
                   support_logprobs=_b64(support[1], "<f4") if support else None)

    def entry(self) -> TokenLogprobs:
        """The inverse of :meth:`of`; ValueError for a support that does not decode."""
        from shared.protocol.logprobs import TokenLogprobs

        support = None
        if self.support_ids is not None or self.support_logprobs is not None:
            if self.support_ids is None or self.support_logprobs is None:
                raise ValueError("support_ids and support_logprobs come together")
            ids, values = (_unb64(self.support_ids, "<i4"),
                           _unb64(self.support_logprobs, "<f4"))
            if len(ids) != len(values):
                raise ValueError("support_ids and support_logprobs differ in length")
            support = (ids, values)
        if len(self.top_ids) != len(self.top_logprobs):
            raise ValueError("top_ids and top_logprobs differ in length")
        # null with a support: a token the client draws (looked up there); else -inf
        logprob = None if support is not None else _from_wire(self.logprob)
        return TokenLogprobs(logprob,
                             [(i, _from_wire(v)) for i, v in zip(self.top_ids,
                                                                  self.top_logprobs,
                                                                  strict=True)],
                             support)


def _finite(value: float | None) -> float | None:
    return None if value is None or value == float("-inf") else value


def _from_wire(value: float | None) -> float:
    return float("-inf") if value is None else value


class StepLoad(_Strict):
    """The batched forward a verify call rode in, and what its drafts cost the others there
    (load-aware speculation, after SmartSpec: Liu et al. 2024, "Optimizing Speculative
    Decoding for Serving Large Language Models Using Goodput"). One more row in a forward
    delays every other session in it by ``row_ms``; a block's k drafts therefore cost the
    others ``k * draft_price_ms``, which a client's cost model adds to its own round trip."""

    sessions: Count  # sessions whose tokens this forward wrote
    rows: Count  # tokens it wrote (prompts included)
    step_ms: float = Field(ge=0.0, allow_inf_nan=False)  # its wall time on the verifier
    row_ms: float = Field(ge=0.0, allow_inf_nan=False)  # the verifier's estimate of one row's
    # marginal cost in a forward (fitted over its recent forwards)
    draft_price_ms: float = Field(ge=0.0, allow_inf_nan=False)  # (sessions - 1) * row_ms


class VerifyResponse(_Strict):
    num_accepted: Count
    # [k] processed log p_i(x_i), null in greedy mode; an entry is null where p_i(x_i) = 0 (-inf)
    target_logprobs: list[float | None] | None
    target_argmax: list[Id] | None  # [k + 1]; greedy mode only
    next_token: Id | None  # recovered / bonus token when the verifier could draw it
    row: EncodedRow | None  # target probs at the rejected position, when next_token is null
    position: Positive  # the session's position once the client commits next_token
    forward_ms: float
    top_ids: list[list[Id]] | None = None  # [k + 1][n] when return_top_ids = n > 0
    # A tree: the accepted drafts' indices, root's child first (num_accepted = its length);
    # target_logprobs then holds log p_parent(node) per node, target_argmax one id per row.
    accepted_path: list[Id] | None = None
    # A plain run: the tokens drawn after next_token, one per more_uniforms entry used.
    more_tokens: list[Id] | None = None
    # The batched forward that decided this block (a plain run: its last step's).
    load: StepLoad | None = None
    # With logprobs asked: one entry per output token (accepted drafts, next_token, then
    # more_tokens).
    logprobs: list[LogprobsEntry] | None = None

    @classmethod
    def of(cls, verdict: Verdict, position: int, forward_ms: float,
           load: StepLoad | None = None) -> VerifyResponse:
        """The wire form of ``verdict``; ``position``: the session's once it is committed."""
        return cls(load=load,
            num_accepted=verdict.num_accepted,
            target_logprobs=(encode_logprobs(verdict.target_logprobs)
                             if verdict.target_logprobs is not None else None),
            target_argmax=(verdict.target_argmax.tolist()
                           if verdict.target_argmax is not None else None),
            next_token=verdict.next_token,
            row=EncodedRow.encode(verdict.row) if verdict.row is not None else None,
            position=position, forward_ms=forward_ms, top_ids=verdict.top_ids,
            accepted_path=verdict.path,
            logprobs=([LogprobsEntry.of(e) for e in verdict.logprobs]
                      if verdict.logprobs is not None else None))

    def verdict(self, vocab_size: int) -> Verdict:
        """The verdict this reply carries (the inverse of :meth:`of`); ValueError for a row that
        is not a distribution over ``vocab_size`` ids."""
        import torch

        from shared.protocol.acceptance import Verdict

        return Verdict(
            self.num_accepted,
            decode_logprobs(self.target_logprobs) if self.target_logprobs is not None else None,
            (torch.tensor(self.target_argmax, dtype=torch.long)
             if self.target_argmax is not None else None),
            self.next_token,
            self.row.decode(vocab_size) if self.row is not None else None,
            self.accepted_path, self.top_ids)


class GenerateRequest(_Strict):
    protocol_version: Count = PROTOCOL_VERSION
    prompt_ids: list[TokenId] = Field(min_length=1)
    sampling: SamplingParams = SamplingParams()
    max_new_tokens: int = Field(128, ge=1, le=INT32_MAX)
    seed: int = Field(0, ge=0, le=2**63 - 1)
    stop_at_eos: bool = True
    encoder_ids: list[TokenId] | None = Field(
        None, min_length=1, description="encoder-decoder targets only (required there): the "
        "encoder's input; prompt_ids is then the decoder's prompt")
    # Beam search (greedy sampling only), as transformers' generate(num_beams=N, ...).
    num_beams: int = Field(1, ge=1, le=MAX_BEAMS, description="1: no beam search")
    length_penalty: float = Field(1.0, ge=-100.0, le=100.0, allow_inf_nan=False,
                                  description="beam score = sum of log-probs / length ** this")
    early_stopping: bool | Literal["never"] = Field(
        False, description="beam search: true, false or \"never\", as in transformers")
    no_repeat_ngram_size: int = Field(0, ge=0, le=INT32_MAX,
                                      description="beam search: never repeat an n-gram this long")
    logprobs: int | None = Field(
        None, ge=0, le=MAX_TOP_LOGPROBS, description="also return each token's raw "
        "log-probability and this many best alternatives (not with beam search)")
    grammar: str | None = Field(
        None, min_length=1, max_length=MAX_GRAMMAR_CHARS, description="structured output: an "
        "llguidance grammar every generated token keeps (shared.protocol.grammar; not with "
        "beam search)")


class GenerateResponse(_Strict):
    token_ids: list[Id]
    forward_ms: float
    forward_calls: int
    logprobs: list[LogprobsEntry] | None = None  # one per token, when asked


class ErrorBody(_Strict):
    code: str
    message: str
    field: str | None = None
    position: int | None = Field(None, description="with 409: the session's current position")


class ErrorResponse(_Strict):
    error: ErrorBody
