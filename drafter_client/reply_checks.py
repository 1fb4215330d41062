"""What the loop reads from a verify reply, checked before it is used: the reply's shape against
the request (:func:`check_reply`), then the verdict it carries against the acceptance rule
(:func:`check_verdict`); :func:`read_verdict` does both. A verifier (or anything at its URL)
that answers nonsense is one clear error, never an IndexError or a silent wrong token."""

from __future__ import annotations

from drafter_client.transport import SpecDecError
from shared.protocol.acceptance import Block, Verdict, accepted_by_rule
from shared.protocol.schema import InfoResponse, VerifyRequest, VerifyResponse


def _tree_problem(reply: VerifyResponse, req: VerifyRequest) -> str | None:
    parents, path = req.tree_parents or [], reply.accepted_path
    if path is None:
        return "accepted_path is missing for a tree"
    if len(path) != reply.num_accepted:
        return f"accepted_path has {len(path)} nodes for num_accepted {reply.num_accepted}"
    here = -1
    for node in path:
        if node >= len(parents) or parents[node] != here:
            return f"accepted_path {path} is not a path down the tree"
        here = node
    return None


def _score_problem(reply: VerifyResponse, k: int, greedy: bool, vocab: int) -> str | None:
    """The target's scores: its choice at every row (greedy), or log p of every draft."""
    if reply.num_accepted > k:
        return f"num_accepted {reply.num_accepted} for {k} drafts"
    if greedy:
        if reply.target_argmax is None or len(reply.target_argmax) < k + 1:
            return f"target_argmax needs {k + 1} ids in greedy mode"
        if any(t >= vocab for t in reply.target_argmax):
            return f"target_argmax holds ids outside [0, {vocab})"
        return None
    if reply.target_logprobs is None or len(reply.target_logprobs) != k:
        return f"target_logprobs needs {k} entries when sampling"
    if any(v is not None and not v <= 0.0 for v in reply.target_logprobs):
        return "target_logprobs holds a value above 0 or NaN"
    return None


def _token_problem(reply: VerifyResponse, req: VerifyRequest, vocab: int) -> str | None:
    """The tokens it drew: the next one (or the row to draw it from) and a plain run's."""
    more = reply.more_tokens or []
    if reply.next_token is not None and reply.next_token >= vocab:
        return f"next_token {reply.next_token} is outside [0, {vocab})"
    if reply.next_token is None and reply.row is None:
        return "neither next_token nor the target row"
    if req.tree_parents is not None and reply.next_token is None:
        return "no next_token for a tree"
    if len(more) > len(req.more_uniforms):
        return f"more_tokens has {len(more)} tokens for {len(req.more_uniforms)} more_uniforms"
    if any(t >= vocab for t in more):
        return f"more_tokens holds ids outside [0, {vocab})"
    return None


def _position_problem(reply: VerifyResponse, req: VerifyRequest, k: int,
                      vocab: int) -> str | None:
    """Where the session stands now, and the top ids asked for."""
    if reply.position != req.position + reply.num_accepted + 1 + len(reply.more_tokens or []):
        return f"position {reply.position} after accepting {reply.num_accepted} at {req.position}"
    if req.return_top_ids and (reply.top_ids is None or len(reply.top_ids) < k + 1
                               or any(t >= vocab for ids in reply.top_ids for t in ids)):
        return "top_ids does not hold one row of ids per scored position"
    return None


def check_reply(reply: VerifyResponse, req: VerifyRequest, greedy: bool,
                info: InfoResponse) -> None:
    """Everything the loop reads from a reply, checked against what it asked: a verifier (or
    anything at its URL) that answers nonsense is one clear error, never an IndexError."""
    k, vocab = len(req.draft_ids), info.vocab_size
    problem = ((_tree_problem(reply, req) if req.tree_parents is not None else None)
               or _score_problem(reply, k, greedy, vocab)
               or _token_problem(reply, req, vocab)
               or _position_problem(reply, req, k, vocab))
    if problem is not None:
        raise SpecDecError(f"the verifier sent an invalid reply: {problem}")


def check_verdict(verdict: Verdict, block: Block) -> int:
    """The verdict must follow from the scores it carries by the acceptance rule
    (``shared.protocol.acceptance``): the number accepted, a tree's path, and in the
    deterministic modes the next token. Returns the number accepted."""
    # Why the client decides again: the verifier alone holds the target, so the scores it sends
    # are the client's only hold on it. A verdict that does not follow from them (a verifier on
    # another version of the rule, a bug, a reply altered on the way) would bias the output
    # without a trace; k comparisons catch it. A sampled bonus or recovered token is a draw the
    # client cannot redo without the target's row, so it is taken as sent.
    accepted, path, next_token = accepted_by_rule(block, verdict)
    if block.tree_parents is not None and path != verdict.path:
        raise SpecDecError(f"verifier accepted the path {verdict.path} where the "
                           f"acceptance rule gives {path}: protocol mismatch")
    if accepted != verdict.num_accepted:
        raise SpecDecError(f"verifier accepted {verdict.num_accepted} drafts where the "
                           f"acceptance rule gives {accepted}: protocol mismatch")
    if next_token is not None and next_token != verdict.next_token:
        raise SpecDecError(f"verifier drew {verdict.next_token} where the target's choice is "
                           f"{next_token}: protocol mismatch")
    return accepted


def read_verdict(reply: VerifyResponse, req: VerifyRequest, block: Block,
                 info: InfoResponse) -> Verdict:
    """The verdict ``reply`` carries on ``block`` (sent as ``req``), checked: its shape, its
    row, and the rule."""
    check_reply(reply, req, block.config.deterministic, info)
    try:
        verdict = reply.verdict(info.vocab_size)
    except ValueError as exc:
        raise SpecDecError(f"the verifier sent an invalid reply: row: {exc}") from exc
    check_verdict(verdict, block)
    return verdict
