"""The drafter's side of the engine interface: a drafted block (:class:`Draft`), what every
drafter offers (:class:`Drafter`: model-free ones in ``drafter_client/model_free.py``), and the
common code of model drafters (:class:`LMDrafter`: trees, drafting ahead, rollback), whose
engines give it one forward and one rollback (``shared/engines/<engine>/drafter.py``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from shared.protocol.acceptance import tree_depths
from shared.protocol.sampling import (
    SamplingConfig,
    choose_tokens,
    draw_uniforms,
    greedy_tokens,
    process_logits,
    sample_from_probs,
)


class FreeDraftAdvice(Protocol):
    """What a drafter whose proposals may cost nothing to make asks of the loop's k policy
    (``drafter_client.draft_length.DraftLength`` offers it)."""

    def free_k(self, acceptance: float) -> int | None:
        """How long a free draft whose tokens each pass with ``acceptance`` should be; None:
        as long as k."""

    def prefers_free(self, acceptance: float) -> bool | None:
        """Whether such a draft beats the model drafter at its best k; None: no opinion."""


@dataclass(frozen=True)
class DrafterCosts:
    """What a drafter knows of its own costs, which the loop's k policy weighs."""

    # seconds per drafted token measured at warm-up (None: not measured): seeds the policy's
    # estimate before the first block
    draft_s_per_token: float | None = None
    # seconds the next draft will spend first feeding committed tokens the drafter has not seen
    # (after plain steps or lookup-only blocks; the prompt before its first draft), beyond the
    # one or two every block feeds; 0: none or not measured
    catch_up_s: float = 0.0
    # how often, per token of a plain run (k = 0), a free draft would have begun inside the run -
    # a copy the run then output (None: not tracked); the cost model shortens plain runs where
    # this is high (``DraftLength.plain_run``)
    copy_rate: float | None = None
    # the last proposal cost nothing to make: its block must not teach the policy what
    # drafting costs
    free_draft: bool = False


NO_COSTS = DrafterCosts()

# What a generation asks of a drafted row beyond the drafter's own logits - its penalties, its
# grammar's mask - as the target's rows will get it: (the sequence the row follows, the
# committed tokens and the drafts before it; its [vocab] logits) -> its [vocab] logits.
RowShaper = Callable[[list[int], torch.Tensor], torch.Tensor]


@dataclass
class Draft:
    ids: list[int]  # [k]
    logprobs: torch.Tensor | None  # [k] log q_i(x_i); None for deterministic (one-hot) drafts
    probs: torch.Tensor | None  # [k, vocab] processed q rows; None for deterministic drafts
    # A token tree instead of a chain: each draft's parent (-1: the last committed token; see
    # shared/protocol/acceptance.py); tree drafts are one-hot (logprobs and probs None).
    parents: list[int] | None = None

    def limited(self, max_depth: int, max_nodes: int) -> Draft:
        """At most ``max_depth`` tokens on any path and ``max_nodes`` drafts in all."""
        if self.parents is None:
            n = min(max_depth, max_nodes, len(self.ids))
            if n == len(self.ids):
                return self
            return Draft(self.ids[:n], None if self.logprobs is None else self.logprobs[:n],
                         None if self.probs is None else self.probs[:n])
        keep: list[int] = []  # kept nodes (a parent is always kept before its children)
        index: dict[int, int] = {}
        for node, (parent, depth) in enumerate(zip(self.parents, tree_depths(self.parents),
                                                   strict=True)):
            if len(keep) < max_nodes and depth <= max_depth and (parent < 0 or parent in index):
                index[node] = len(keep)
                keep.append(node)
        return Draft([self.ids[n] for n in keep], None, None,
                     [index[self.parents[n]] if self.parents[n] >= 0 else -1 for n in keep])

    def first_chain(self) -> list[int]:
        """What a block outputs when every first test passes: a chain's drafts, a tree's first
        child at every level."""
        if self.parents is None:
            return list(self.ids)
        chain, here = [], -1
        for node, parent in enumerate(self.parents):
            if parent == here:
                chain.append(self.ids[node])
                here = node
        return chain

    @property
    def depth(self) -> int:
        """Tokens on the longest root-to-leaf path (k for a chain)."""
        return max(tree_depths(self.parents), default=0) if self.parents else len(self.ids)


class Drafter:
    """What the speculative loop needs from a drafter: subclass it.

    ``reset``, ``propose`` and ``commit`` are required. The rest are optional capabilities,
    declared here with defaults that say "not supported", so the loop never probes for them:
    ``top_k_filler`` / ``observe_top_k`` (NASD: the target's top ids per scored position),
    ``speculate`` (drafting the next block while this one is verified, ``--overlap``),
    ``advise`` (a drafter whose proposals may cost nothing to make, told the loop's k policy so
    it can judge how long such a proposal should be), ``costs`` (what it knows of its own
    costs: :class:`DrafterCosts`) and ``shape`` (drafting under a generation's row rule)."""

    name: str = "drafter"
    top_k_filler: int = 0  # how many of the target's top ids it wants back; 0: none

    def reset(self, prompt_ids: list[int], encoder_ids: list[int] | None = None) -> None:
        """Start a new sequence (``encoder_ids``: the source, for an encoder-decoder target;
        ``prompt_ids`` is then the decoder's prompt)."""
        raise NotImplementedError

    def propose(self, k: int, config: SamplingConfig, generator: torch.Generator) -> Draft:
        """Draft k tokens after the committed sequence."""
        raise NotImplementedError

    def commit(self, tokens: list[int]) -> None:
        """The committed sequence grew by ``tokens``; forget any draft not among them."""
        raise NotImplementedError

    def observe_top_k(self, context: list[int], top_ids: list[int]) -> None:
        """The target's top ids after ``context`` (only called when ``top_k_filler`` > 0)."""
        raise NotImplementedError(f"{type(self).__name__} asks for top ids but does not "
                                  "take them")

    def speculate(self, assumed: list[int], k: int, config: SamplingConfig,
                  generator: torch.Generator) -> tuple[int, Draft] | None:
        """While a block is in flight: (guess, the draft for the block after it) if the
        verifier accepts ``assumed`` and then outputs ``guess``; None: nothing drafted ahead."""
        return None

    overlaps: bool = False  # ``speculate`` drafts ahead (worth a thread for ``--overlap``)

    def advise(self, schedule: FreeDraftAdvice) -> None:
        """The loop's draft-length policy for this generation (set before the first block)."""

    def costs(self) -> DrafterCosts:
        """What it knows of its own costs now (read by the loop's policy around each block)."""
        return NO_COSTS

    def shape(self, shaper: RowShaper | None) -> None:
        """Draft this generation's rows through ``shaper`` (None: no more). A drafter that
        draws from no rows (a lookup's copies) ignores it: the loop cuts its drafts where a
        grammar refuses one, and a penalised row only lowers their chance to pass."""


class TreeBuilder:
    """Collects paths into one token tree, sharing common prefixes (a trie)."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.parents: list[int] = []
        self._child: dict[tuple[int, int], int] = {}  # (parent, token) -> node

    def add(self, parent: int, token: int) -> int:
        """The node for ``token`` below ``parent`` (-1: the root), made if new."""
        node = self._child.get((parent, token))
        if node is None:
            node = self._child[(parent, token)] = len(self.ids)
            self.ids.append(token)
            self.parents.append(parent)
        return node

    def add_path(self, tokens: list[int], parent: int = -1) -> None:
        for token in tokens:
            parent = self.add(parent, token)

    def add_draft(self, draft: Draft) -> None:
        if draft.parents is None:
            self.add_path(draft.ids)
            return
        nodes: list[int] = []
        for token, parent in zip(draft.ids, draft.parents, strict=True):
            nodes.append(self.add(-1 if parent < 0 else nodes[parent], token))

    def draft(self) -> Draft:
        return Draft(list(self.ids), None, None, list(self.parents))


def align_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[..., drafter vocab] -> [..., vocab_size]: drop ids the target lacks, pad with -inf."""
    have = logits.shape[-1]
    if have >= vocab_size:
        return logits[..., :vocab_size]
    pad = logits.new_full((*logits.shape[:-1], vocab_size - have), float("-inf"))
    return torch.cat([logits, pad], dim=-1)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


WARM_UP_CONTEXT = 48  # tokens of the warm-up's prefill (timed: a catch-up's cost per token)
FED_EVERY_BLOCK = 2  # tokens a block's draft feeds first anyway (the last draft and the bonus)
MEASURED_FEED = 8  # the fewest tokens in one feed that time a catch-up


class LMDrafter(Drafter):
    """A language model drafting with its own KV cache; a subclass runs the model
    (``reset``, ``_forward``, ``_roll_back``, ``warm_up``): :class:`HFDrafter` on transformers,
    ``LlamaCppDrafter`` on llama.cpp.

    ``cached`` mirrors the ids in the KV cache. After a block it is cropped to its common prefix
    with the committed sequence (always leaving the last committed token out), so a fully accepted
    block feeds the last draft and the bonus token before drafting again. A new sequence
    (``reset``) keeps the cache's common prefix with its prompt the same way: the next turn of a
    chat, which re-sends the conversation, feeds only what is new.
    """

    overlaps = True

    def __init__(self, vocab_size: int, name: str = "lm", min_prob: float = 0.0,
                 tree_width: int = 1, alternative_min_prob: float = 0.05) -> None:
        self.vocab_size, self.name = vocab_size, name
        self.min_prob = min_prob  # stop a block when the drafter's top probability falls below
        # tree_width > 1: a token tree - the argmax chain, and at each position up to
        # tree_width - 1 runner-up tokens (drafter probability >= alternative_min_prob) as
        # leaves; one-hot drafts, at no extra drafter forward.
        if tree_width < 1:
            raise ValueError("tree_width must be at least 1")
        self.tree_width, self.alternative_min_prob = tree_width, alternative_min_prob
        self.committed: list[int] = []
        self.cached: list[int] = []
        self.last_logits = torch.empty(0)  # [vocab] after the last cached token
        self.shaper: RowShaper | None = None

    # The longest sequence the drafter's cache holds (None: no limit). Past it the drafter
    # drafts less, then nothing: the target goes on alone to its own context's end.
    context_tokens: int | None = None
    measured_draft_s: float | None = None  # per drafted token, timed by ``warm_up``
    measured_feed_s: float | None = None  # per token fed in one forward (a catch-up), timed

    def warm_up(self) -> None:
        """Throwaway drafts, so the first real block does not pay for kernel warm-up: the
        prefill of a 48-token context (timed: ``catch_up_s``) and a first block, then one
        block of 4 timed after it (``measured_draft_s``)."""
        config, generator = SamplingConfig(), torch.Generator()
        self.reset([i % self.vocab_size for i in range(WARM_UP_CONTEXT)])
        first = self.propose(2, config, generator)
        self.commit([*first.ids, 0])
        started = time.perf_counter()
        timed = self.propose(4, config, generator)
        if timed.ids:
            self.measured_draft_s = (time.perf_counter() - started) / len(timed.ids)

    def costs(self) -> DrafterCosts:
        return DrafterCosts(self.measured_draft_s, self.catch_up_s)

    def shape(self, shaper: RowShaper | None) -> None:
        self.shaper = shaper

    def _shaped(self, drafts: list[int], logits: torch.Tensor) -> torch.Tensor:
        """The row after the committed sequence and ``drafts``, as the generation shapes it."""
        if self.shaper is None:
            return logits
        return self.shaper([*self.committed, *drafts], logits)

    @property
    def behind(self) -> int:
        """Committed tokens not yet in the cache (fed before the next draft)."""
        return len(self.committed) - len(self.cached)

    @property
    def catch_up_s(self) -> float:
        if self.measured_feed_s is None:
            return 0.0
        return max(self.behind - FED_EVERY_BLOCK, 0) * self.measured_feed_s

    def _room(self, k: int) -> int:
        """How many of k tokens the drafter can draft after the committed sequence: a chain
        of k feeds the committed tokens and the first k - 1 drafts."""
        if self.context_tokens is None:
            return k
        return max(0, min(k, self.context_tokens - len(self.committed) + 1))

    def _catch_up(self) -> torch.Tensor:
        """Feed the committed tokens the cache lacks; a long feed (a catch-up) is timed, per
        token, for ``catch_up_s`` (the latest measurement counts: it is this context's)."""
        ids = self.committed[len(self.cached):]
        started = time.perf_counter()
        logits = self._forward(ids)
        if len(ids) >= MEASURED_FEED:
            self.measured_feed_s = (time.perf_counter() - started) / len(ids)
        return logits

    def reset(self, prompt_ids: list[int], encoder_ids: list[int] | None = None) -> None:
        self.committed = []
        self.commit(list(prompt_ids))  # the cache keeps its common prefix with the prompt

    def _forward(self, ids: list[int]) -> torch.Tensor:
        """Feed ids into the cache; the last position's logits aligned to the target vocab
        (no ids: those of the last forward)."""
        raise NotImplementedError

    def _roll_back(self, keep: int) -> None:
        """Drop the cached positions from ``keep`` on."""
        raise NotImplementedError

    def _choose(self, logits: torch.Tensor, config: SamplingConfig, ahead: int) -> int:
        """The drafter's deterministic choice for the token ``ahead`` places after the
        committed sequence: its argmax, or under coupled sampling its Gumbel-max choice with the
        noise the target uses at that position."""
        position = len(self.committed) + ahead
        return int(choose_tokens(logits[None], config, [position])[0].item())

    def propose_tree(self, k: int, config: SamplingConfig) -> Draft:
        """The argmax chain with runner-up leaves (see ``tree_width``); stops where the top
        probability falls below ``min_prob``, leaving that position's candidates as leaves."""
        tree = TreeBuilder()
        k = self._room(k)
        if k == 0:
            return tree.draft()
        logits = self._shaped([], self._catch_up())  # [vocab]
        parent, chain = -1, []
        for i in range(k):
            top = torch.topk(torch.softmax(logits, -1), self.tree_width)
            best = (self._choose(logits, config, i) if config.deterministic
                    else int(top.indices[0]))
            node = tree.add(parent, best)
            for prob, token in zip(top.values[1:].tolist(), top.indices[1:].tolist(),
                                   strict=True):
                if prob >= self.alternative_min_prob:
                    tree.add(parent, int(token))
            if float(top.values[0]) < self.min_prob:
                break  # not confident: the target picks among the candidates
            parent = node
            chain.append(best)
            if i < k - 1:
                logits = self._shaped(chain, self._forward([best]))
        return tree.draft()

    def propose(self, k: int, config: SamplingConfig, generator: torch.Generator) -> Draft:
        if self.tree_width > 1:
            return self.propose_tree(k, config)
        k = self._room(k)
        if k == 0:
            return Draft([], None if config.deterministic else torch.empty(0), None)
        logits = self._shaped([], self._catch_up())  # [vocab]
        ids: list[int] = []
        logprobs, rows = [], []
        for i in range(k):
            if self.min_prob and torch.softmax(logits, -1).max() < self.min_prob:
                break  # not confident: let the target decide
            if config.deterministic:
                token = self._choose(logits, config, i)
            else:
                lp = process_logits(logits, config)  # [vocab]
                token = sample_from_probs(lp.exp(), float(draw_uniforms(generator, 1)[0]))
                logprobs.append(lp[token])
                rows.append(lp.exp())
            ids.append(token)
            if i < k - 1:
                logits = self._shaped(ids, self._forward([token]))
        if config.deterministic:
            return Draft(ids, None, None)
        if not ids:
            return Draft([], torch.empty(0), torch.empty(0, self.vocab_size))
        return Draft(ids, torch.stack(logprobs), torch.stack(rows))  # [k], [k, vocab]

    def speculate(self, assumed: list[int], k: int, config: SamplingConfig,
                  generator: torch.Generator) -> tuple[int, Draft] | None:
        """While a block is in flight: the draft for the block after it, *if* the verifier
        accepts ``assumed`` (the block's drafts on its first chain) and then outputs ``guess``,
        the drafter's own best next token. Returns (guess, draft). The cache keeps what this
        computed; :meth:`commit` crops it back to what was really committed."""
        saved = self.committed
        if self._room(len(assumed) + 2) < len(assumed) + 2:
            return None  # the guess and a first draft after it would not fit
        try:
            self.committed = [*saved, *assumed]
            if len(self.cached) > len(self.committed) or (
                    self.cached != self.committed[:len(self.cached)]):
                return None  # not on the committed path (cannot happen after propose)
            logits = self._shaped([], self._forward(self.committed[len(self.cached):]))
            guess = (self._choose(logits, config, 0) if config.deterministic
                     else int(greedy_tokens(logits).item()))
            self.committed.append(guess)
            return guess, self.propose(k, config, generator)
        finally:
            self.committed = saved

    def commit(self, tokens: list[int]) -> None:
        self.committed.extend(tokens)
        keep = max(min(common_prefix(self.cached, self.committed), len(self.committed) - 1), 0)
        self._roll_back(keep)
        del self.cached[keep:]
