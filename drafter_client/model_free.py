"""Model-free drafters: n-gram pools (NASD), prompt lookup and a bigram table.

Their drafts are deterministic, so q is one-hot: the verifier accepts x with probability p(x) and
draws the recovered token from p with x removed. No vocabulary-sized row crosses the wire.

N-gram assisted speculative decoding (NASD) keeps a pool of n-grams from the prompt, updated with
every token the target emits, and optionally with the target's top-k tokens at every scored
position ("filler"). Two pool kinds:
  * ``simple`` (SimpleDynaGram): contexts of exactly n - 1 tokens;
  * ``multi`` (MultiDynaGram): every order 2..n, longest matching context first.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection
from typing import Any

import torch

from drafter_client.settings import DEFAULT_OPTIONS, DrafterOptions
from shared.engines.drafter import Draft, Drafter
from shared.protocol.sampling import SamplingConfig


class _Continuations:
    """Next-token counts per context; the best is the most frequent, then the most recent."""

    def __init__(self) -> None:
        self.counts: dict[tuple[int, ...], dict[int, int]] = defaultdict(dict)
        self.last_seen: dict[tuple[int, ...], dict[int, int]] = defaultdict(dict)
        self.clock = 0

    def add(self, context: tuple[int, ...], token: int) -> None:
        self.clock += 1
        self.counts[context][token] = self.counts[context].get(token, 0) + 1
        self.last_seen[context][token] = self.clock

    def best(self, context: tuple[int, ...]) -> int | None:
        options = self.counts.get(context)
        if not options:
            return None
        seen = self.last_seen[context]
        return max(options, key=lambda t: (options[t], seen[t]))


class _SequenceDrafter(Drafter):
    """Shared bookkeeping: the committed sequence, and drafts of up to k tokens."""

    name = "model-free"

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.source: list[int] = []  # an encoder-decoder target's source (prompt lookup uses it)

    def reset(self, prompt_ids: list[int], encoder_ids: list[int] | None = None) -> None:
        self.tokens = []
        self.source = list(encoder_ids or [])
        self._on_reset()
        self.commit(prompt_ids)

    def _on_reset(self) -> None:
        raise NotImplementedError

    def commit(self, tokens: list[int]) -> None:
        for token in tokens:
            self.tokens.append(token)
            self._learn(len(self.tokens) - 1)

    def _learn(self, index: int) -> None:
        """The token at ``index`` was committed."""

    def _next(self, sequence: list[int]) -> int | None:
        raise NotImplementedError

    def _pad(self) -> int:
        """Filler for an unknown context: the last token (a cheap, often-repeated guess)."""
        return self.tokens[-1]

    stop_if_unknown = False

    def propose(self, k: int, config: SamplingConfig, generator: torch.Generator) -> Draft:
        sequence = list(self.tokens)
        draft: list[int] = []
        for _ in range(k):
            token = self._next(sequence)
            if token is None:
                if self.stop_if_unknown:
                    break
                token = self._pad()
            draft.append(token)
            sequence.append(token)
        return Draft(draft, None, None)


class NGramDrafter(_SequenceDrafter):
    """NASD: SimpleDynaGram (``kind="simple"``) or MultiDynaGram (``kind="multi"``).
    ``top_k_filler``: ask the verifier for its top-k ids per scored position and draft from them
    after the pool. The defaults are :class:`DrafterOptions`' ``ngram_*`` fields."""

    def __init__(self, n: int = DEFAULT_OPTIONS.ngram_n, kind: str = DEFAULT_OPTIONS.ngram_kind,
                 top_k_filler: int = DEFAULT_OPTIONS.ngram_top_k_filler,
                 stop_if_unknown: bool = DEFAULT_OPTIONS.ngram_stop_if_unknown) -> None:
        super().__init__()
        if n < 2:
            raise ValueError("n-gram order n must be at least 2")
        if kind not in ("simple", "multi"):
            raise ValueError(f"n-gram kind must be 'simple' or 'multi', not {kind!r}")
        self.n, self.kind = n, kind
        self.name = f"ngram-{kind}-{n}"
        self.stop_if_unknown = stop_if_unknown
        self.top_k_filler = top_k_filler
        self._on_reset()

    @classmethod
    def from_options(cls, options: DrafterOptions) -> NGramDrafter:
        return cls(options.ngram_n, options.ngram_kind, options.ngram_top_k_filler,
                   options.ngram_stop_if_unknown)

    @property
    def _orders(self) -> range:
        """Context lengths to try, longest first."""
        longest = self.n - 1
        return range(longest, 0 if self.kind == "multi" else longest - 1, -1)

    def _on_reset(self) -> None:
        self.pool = _Continuations()
        self.filler = _Continuations()  # the target's top-k guesses, used after the pool

    def _learn(self, index: int) -> None:
        for order in self._orders:
            if index - order >= 0:
                self.pool.add(tuple(self.tokens[index - order:index]), self.tokens[index])

    def observe_top_k(self, context: list[int], top_ids: list[int]) -> None:
        """The target's top-k next-token ids after ``context`` (a committed prefix)."""
        for order in self._orders:
            if len(context) >= order:
                key = tuple(context[len(context) - order:])
                for token in reversed(top_ids):  # the best id is added last: most recent
                    self.filler.add(key, token)

    def _next(self, sequence: list[int]) -> int | None:
        for table in (self.pool, self.filler):
            for order in self._orders:
                if len(sequence) >= order:
                    token = table.best(tuple(sequence[len(sequence) - order:]))
                    if token is not None:
                        return token
        return None


class PromptLookupDrafter(_SequenceDrafter):
    """Find the longest match (``min_ngram`` .. ``max_ngram`` tokens) of the sequence's tail in
    its earlier tokens, the most recent of the longest, and propose what followed it; else the
    same in the source of an encoder-decoder target (summaries and edits copy from it).
    :attr:`matched` is the last proposal's match length (0: none), a measure of how much to
    trust it (the hybrid keeps its trust per match length).

    A proposal ends before the first of ``stop_ids`` - the tokenizer's control tokens (chat
    markers, BOS / EOS, fill-in-the-middle markers; :func:`special_ids`): they mark where the
    prompt's parts end, and an answer that copies a snippet of the prompt goes on with its own
    text there (a closing code fence, its end of turn), so a copy running into them failed its
    whole block - on a CPU a 12-token block cost 10 plain steps for the one token it gave."""

    CANDIDATES = 256  # most recent earlier places of the last token tried per proposal

    def __init__(self, min_ngram: int = DEFAULT_OPTIONS.lookup_min_ngram,
                 max_ngram: int = DEFAULT_OPTIONS.lookup_max_ngram,
                 stop_ids: Collection[int] = ()) -> None:
        super().__init__()
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("prompt lookup needs 1 <= min_ngram <= max_ngram")
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self.stop_ids = frozenset(stop_ids)
        self.name = f"prompt-lookup-{min_ngram}-{max_ngram}"
        self.stop_if_unknown = True  # nothing to pad with that is better than stopping
        self.matched = 0
        self._places: dict[int, list[int]] = {}  # token -> its indices in the sequence
        self._source_places: dict[int, list[int]] = {}

    def _on_reset(self) -> None:
        self._places, self._source_places = {}, {}
        for index, token in enumerate(self.source):
            self._source_places.setdefault(token, []).append(index)

    def _learn(self, index: int) -> None:
        self._places.setdefault(self.tokens[index], []).append(index)

    def _longest(self, haystack: list[int], places: list[int], before: int) -> tuple[int, int]:
        """(match length, index after the match) of the longest match of the sequence's tail
        ending at one of ``places`` below ``before``, most recent first."""
        tokens, best, after = self.tokens, 0, -1
        tried = 0
        for end in reversed(places):
            if end >= before:
                continue
            length = 1
            while (length < self.max_ngram and end - length >= 0
                   and length < len(tokens)
                   and haystack[end - length] == tokens[-1 - length]):
                length += 1
            if length > best:
                best, after = length, end + 1
                if best == self.max_ngram:
                    break
            tried += 1
            if tried >= self.CANDIDATES:
                break
        return best, after

    def propose(self, k: int, config: SamplingConfig, generator: torch.Generator) -> Draft:
        self.matched = 0
        tokens = self.tokens
        if not tokens:
            return Draft([], None, None)
        last = tokens[-1]
        # an earlier place: the continuation has at least one token
        length, after = self._longest(tokens, self._places.get(last, []), len(tokens) - 1)
        haystack = tokens
        if self.source and length < self.max_ngram:
            in_source = self._longest(self.source, self._source_places.get(last, []),
                                      len(self.source) - 1)
            if in_source[0] > length:
                (length, after), haystack = in_source, self.source
        if length < self.min_ngram:
            return Draft([], None, None)
        proposal = haystack[after:after + k]
        cut = next((i for i, token in enumerate(proposal) if token in self.stop_ids), None)
        if cut is not None:
            proposal = proposal[:cut]
        self.matched = length if proposal else 0
        return Draft(proposal, None, None)


def special_ids(tokenizer: Any) -> frozenset[int]:
    """The ids a tokenizer marks special: its added special tokens (chat and FIM markers) and
    BOS / EOS / pad; none for a tokenizer that marks none."""
    ids = set(getattr(tokenizer, "all_special_ids", None) or ())
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids.update(index for index, token in added.items() if getattr(token, "special", False))
    return frozenset(int(i) for i in ids)


class BigramDrafter(_SequenceDrafter):
    """A bigram table over the prompt and the generated text (a weak baseline)."""

    name = "bigram"

    def _on_reset(self) -> None:
        self.table = _Continuations()

    def __init__(self) -> None:
        super().__init__()
        self._on_reset()

    def _learn(self, index: int) -> None:
        if index > 0:
            self.table.add((self.tokens[index - 1],), self.tokens[index])

    def _next(self, sequence: list[int]) -> int | None:
        return self.table.best((sequence[-1],))
