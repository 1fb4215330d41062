"""Request checks that need the model or the settings (the schema checks types and bounds)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.protocol.schema import PROTOCOL_VERSION, RowMask, SamplingParams, VerifyRequest
from verifier_service.errors import VerifierError
from verifier_service.scheduling.sessions import Session


@dataclass(frozen=True)
class RequestValidator:
    vocab_size: int
    max_context: int
    max_prompt: int  # tokens a prompt may hold
    max_draft_tokens: int
    max_new_tokens: int  # /v1/generate's cap
    encoder_decoder: bool = False  # the target takes encoder_ids with every new session
    trees: bool = True  # the engine verifies token trees

    def check_protocol(self, version: int) -> None:
        if version != PROTOCOL_VERSION:
            raise VerifierError(400, "protocol_mismatch", f"protocol_version {version} is not "
                                f"supported; this verifier speaks {PROTOCOL_VERSION}",
                                "protocol_version")

    def check_ids(self, ids: list[int], field: str) -> None:
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise VerifierError(422, "token_out_of_vocab", f"{field} holds ids outside "
                                f"[0, {self.vocab_size}): {bad[:5]}", field)

    def check_prompt(self, prompt_ids: list[int]) -> None:
        self.check_ids(prompt_ids, "prompt_ids")
        if len(prompt_ids) > self.max_prompt:
            raise VerifierError(413, "prompt_too_long", f"prompt_ids has {len(prompt_ids)} "
                                f"tokens; the limit is {self.max_prompt}", "prompt_ids")

    def check_create(self, protocol_version: int, prompt_ids: list[int],
                     encoder_ids: list[int] | None = None,
                     prompt_length: int | None = None,
                     sampling: SamplingParams | None = None) -> None:
        """What a create (or /v1/generate) can be refused for before it is queued."""
        self.check_protocol(protocol_version)
        self.check_prompt(prompt_ids)
        if sampling is not None:
            self.check_ids([i for i, _ in sampling.logit_bias], "sampling.logit_bias")
        if prompt_length is not None and prompt_length > len(prompt_ids):
            raise VerifierError(422, "invalid_prompt_length", f"prompt_length {prompt_length} "
                                f"is more than the {len(prompt_ids)} tokens of prompt_ids",
                                "prompt_length")
        if self.encoder_decoder and encoder_ids is None:
            raise VerifierError(422, "encoder_ids_required", "this target is an "
                                "encoder-decoder model: send the source as encoder_ids (and the "
                                "decoder's prompt as prompt_ids)", "encoder_ids")
        if not self.encoder_decoder and encoder_ids is not None:
            raise VerifierError(422, "not_encoder_decoder", "this target is a decoder-only "
                                "model: encoder_ids is not used; put everything in prompt_ids",
                                "encoder_ids")
        if encoder_ids is not None:
            self.check_ids(encoder_ids, "encoder_ids")
            if len(encoder_ids) > self.max_prompt:
                raise VerifierError(413, "prompt_too_long", f"encoder_ids has "
                                    f"{len(encoder_ids)} tokens; the limit is {self.max_prompt}",
                                    "encoder_ids")

    def check_new_tokens(self, max_new_tokens: int) -> None:
        if max_new_tokens > self.max_new_tokens:
            raise VerifierError(422, "too_many_tokens", f"max_new_tokens {max_new_tokens} "
                                f"exceeds the limit {self.max_new_tokens}", "max_new_tokens")

    def check_verify(self, session: Session, req: VerifyRequest) -> None:
        k = len(req.draft_ids)
        if k > self.max_draft_tokens:
            raise VerifierError(422, "too_many_drafts", f"draft_ids has {k} tokens; this "
                                f"verifier takes at most {self.max_draft_tokens}", "draft_ids")
        self.check_ids(req.draft_ids, "draft_ids")
        self.check_ids([req.last_token], "last_token")
        if req.history:
            self.check_ids([i for i, _ in req.history], "history")
            if len({i for i, _ in req.history}) != len(req.history):
                raise VerifierError(422, "invalid_history", "history names an id more than "
                                    "once", "history")
            counted = sum(c for _, c in req.history)
            if counted > session.position:  # generated tokens are among the committed ones
                raise VerifierError(422, "history_too_long", f"history counts {counted} "
                                    f"tokens; a session at position {session.position} has "
                                    f"generated at most {session.position}", "history")
        if len(req.log_uniforms) != k:
            raise VerifierError(422, "length_mismatch", f"log_uniforms has "
                                f"{len(req.log_uniforms)} entries for {k} drafts", "log_uniforms")
        if req.draft_logprobs is not None and len(req.draft_logprobs) != k:
            raise VerifierError(422, "length_mismatch", f"draft_logprobs has "
                                f"{len(req.draft_logprobs)} entries for {k} drafts",
                                "draft_logprobs")
        if req.tree_parents is not None:
            self.check_tree(req)
        if req.more_uniforms and (k or req.tree_parents is not None):
            raise VerifierError(422, "plain_run_with_drafts", "more_uniforms asks for a plain "
                                "run, which drafts nothing: send no draft_ids", "more_uniforms")
        if len(req.more_uniforms) > self.max_draft_tokens:
            raise VerifierError(422, "plain_run_too_long", f"more_uniforms has "
                                f"{len(req.more_uniforms)} entries; this verifier takes at most "
                                f"{self.max_draft_tokens}", "more_uniforms")
        if req.position == session.last_verify_position:
            raise VerifierError(409, "step_conflict", f"position {req.position} was already "
                                "verified with a different request; the session is at position "
                                f"{session.position}", "position", position=session.position)
        if req.position != session.position:
            raise VerifierError(409, "position_mismatch", f"position {req.position} does not "
                                f"match the session's position {session.position}", "position",
                                position=session.position)
        if session.position + k > self.max_context:
            raise VerifierError(422, "context_overflow", f"position {session.position} + {k} "
                                f"drafts exceeds max_context {self.max_context}", "draft_ids")

    def decode_masks(self, req: VerifyRequest) -> torch.Tensor:
        """The block's row masks as one [k + 1, vocab] bool tensor (True: allowed); 422 naming
        ``masks`` for masks that do not fit the block or are not masks. Needs no session, so
        it runs when the call arrives, on a worker thread (``verify_call``), not on the batch's
        model thread: the decoding is the caller's own time, not its neighbours'."""
        masks, k = req.masks or [], len(req.draft_ids)
        if len(masks) != k + 1:
            raise VerifierError(422, "length_mismatch", f"masks has {len(masks)} entries for "
                                f"{k + 1} rows", "masks")
        if req.tree_parents is not None or req.more_uniforms:
            raise VerifierError(422, "masks_unsupported", "masks go with a chain of drafts or "
                                "one plain step (no tree_parents, no more_uniforms)", "masks")
        return self.decode_rows(masks)

    def decode_rows(self, masks: list[RowMask]) -> torch.Tensor:
        try:
            return torch.stack([mask.keep(self.vocab_size) for mask in masks])
        except ValueError as exc:
            raise VerifierError(422, "invalid_mask", str(exc), "masks") from None

    def check_tree(self, req: VerifyRequest) -> None:
        parents = req.tree_parents or []
        if len(parents) != len(req.draft_ids):
            raise VerifierError(422, "length_mismatch", f"tree_parents has {len(parents)} "
                                f"entries for {len(req.draft_ids)} drafts", "tree_parents")
        if not self.trees:
            raise VerifierError(422, "tree_unsupported", "this verifier's engine does not "
                                "verify token trees (encoder-decoder targets do not); send a "
                                "chain (tree_parents null)", "tree_parents")
        bad = next((i for i, p in enumerate(parents) if not -1 <= p < i), None)
        if bad is not None:
            raise VerifierError(422, "invalid_tree", f"tree_parents[{bad}] = {parents[bad]}: a "
                                "parent must be -1 or an earlier draft's index", "tree_parents")
        if req.draft_logprobs is not None:
            raise VerifierError(422, "invalid_tree", "a tree's drafts are one-hot: send "
                                "draft_logprobs null", "draft_logprobs")
