"""How many tokens to draft per block: fixed, a heuristic schedule, or a cost model (`-k auto`).

The cost model keeps running estimates of
  * c_i, the probability that draft i is accepted given drafts 1..i-1 were (per position),
  * the drafting time per token, and
  * the verify round trip per k: each measured k's own decayed mean, straight lines between
    measured ks, and the least-squares slope over recent blocks past the longest,
and picks the k that maximises expected tokens per second,
    E[tokens](k) / (k t_draft + rtt(k)),  E[tokens](k) = 1 + sum_{i<=k} prod_{j<=i} c_j,
which is (1 - a^(k+1)) / (1 - a) when every c_j = a (Leviathan et al. 2023). Because the round
trip is measured, a distant verifier makes longer drafts worth it.

k = 0 is a candidate too: plain decode steps through the same session (no drafting), asked for
in runs of up to ``PLAIN_RUN`` more steps per round trip (``more_uniforms``), at 1 / rtt(0)
tokens per second with rtt(0) per token of a run. Where no k >= 1 beats it - drafting costs
more than the verify time it saves, as with a float32 target on a 2-core CPU - the cost model
drafts nothing, so speculation is never slower than the target alone by more than a round trip's
overhead. While it drafts nothing its acceptance estimates go stale, so every ``probe_every``
plain steps it drafts one block of k = 1, the cheapest look (the gap doubles, up to
``max_probe_gap``, while probes do not win, and starts again when one does) - if drafting could
pay at all: where it would lose even at 90% acceptance, no probe is made. A model drafter that
has fallen behind must first feed what it has not seen (``DrafterCosts.catch_up_s``: the whole
prompt before its first draft, every plain token after a plain stretch): a switch to drafting
must repay that over the tokens left, and probes together may cost at most ``PROBE_SHARE`` of
the time spent in plain steps (none in the last ``MIN_PROBE_ROOM`` tokens). Each choice
depends only on blocks already verified and on timings, never on the block about to be
drafted, so the output distribution stays the target's.

A verifier reports what its verify forwards cost (``/v1/info`` ``verify_ms``, timed at start):
those costs seed the per-k round trips with one block's weight each, so the first choices are
made on this verifier's costs rather than on a guess, and blocks measured here soon outweigh
them (they lack the network's share of a round trip). The seeds also keep the *shape* of the
cost in k for as long as the session lasts: a k not measured lately is priced from the nearest
measured k plus the seeded difference between the two. Without that, a session that drafted
k = 3 for a while saw every longer block as costing what k = 3 costs (no spread to fit a slope
on: the lookup then sent 16-token copies at 60% trust), and after about 60 blocks forgot the
longer ks altogether (copies cut to 4 tokens on a verifier whose 16-token block costs 1.4
one-token steps).
"""

from __future__ import annotations

import statistics
from typing import Protocol

from drafter_client.outcome import BlockOutcome

DRAFT_SAMPLES = 7  # per-token drafting times the cost model's median is over
PLAIN_RUN = 15  # most extra plain steps asked for in one round trip where k = 0 (the
# verifier's max_draft_tokens caps it too: 16 by default, one call per 16 tokens)
COPY_SAVING = 0.6  # the share of a plain step that a copied (free-draft) token saves
OPTIMISTIC_ACCEPTANCE = 0.9  # a probe is made only where drafting would pay at this rate
PROBE_SHARE = 0.03  # probes may cost at most this share of the time spent in plain steps
MIN_PROBE_ROOM = 16  # no probe with fewer tokens left to generate: it could not repay


class DraftLength(Protocol):
    name: str

    def next_k(self, catch_up_s: float = 0.0, room: int | None = None) -> int:
        """k for the next block; ``catch_up_s``: what the drafter must spend before it can
        draft (``DrafterCosts.catch_up_s``), ``room``: tokens the generation may still add."""

    def free_k(self, acceptance: float) -> int | None:
        """How long a draft that costs nothing to make (a prompt-lookup match) should be when
        each of its tokens passes with probability ``acceptance``; None: as long as k."""

    def prefers_free(self, acceptance: float) -> bool | None:
        """Whether such a free draft is expected to give more tokens per second than the
        model drafter at its best k; None: no opinion (the hybrid's own trust rule)."""

    def plain_run(self, room: int, copy_rate: float | None = None) -> int:
        """With k = 0 chosen: how many more plain steps to ask for in the same round trip (a
        plain run, ``more_uniforms``), at most ``room``; ``copy_rate``: the drafter's
        ``Drafter.copy_rate``, how often a free draft begins inside a run."""

    def seed_drafting(self, seconds_per_token: float) -> None:
        """The drafter's cost per token measured before the first block (its warm-up)."""

    def update(self, block: BlockOutcome) -> None:
        """What the last block did and cost."""


class NoCostModel:
    """For policies without a cost model: no advice on free drafts; k = 0 (only a fixed
    policy chooses it) in plain runs of ``PLAIN_RUN`` more steps."""

    def free_k(self, acceptance: float) -> int | None:
        return None

    def prefers_free(self, acceptance: float) -> bool | None:
        return None

    def plain_run(self, room: int, copy_rate: float | None = None) -> int:
        return max(0, min(room, PLAIN_RUN))

    def seed_drafting(self, seconds_per_token: float) -> None:
        pass


class FixedLength(NoCostModel):
    def __init__(self, k: int) -> None:
        self.k, self.name = k, str(k)

    def next_k(self, catch_up_s: float = 0.0, room: int | None = None) -> int:
        return self.k

    def update(self, block: BlockOutcome) -> None:
        pass


class HeuristicLength(NoCostModel):
    """Grow by 2 after a fully accepted block, shrink by 1 otherwise (transformers' schedule)."""

    name = "heuristic"

    def __init__(self, start: int = 4, max_k: int = 16) -> None:
        self.k, self.max_k = start, max_k

    def next_k(self, catch_up_s: float = 0.0, room: int | None = None) -> int:
        return self.k

    def update(self, block: BlockOutcome) -> None:
        if block.depth and block.num_accepted == block.depth:
            self.k = min(self.k + 2, self.max_k)
        elif block.depth:
            self.k = max(self.k - 1, 1)


class CostModelLength:
    """`-k auto`: the k with the highest expected tokens per second under running estimates."""

    name = "auto"

    def __init__(self, max_k: int = 16, start: int = 2, decay: float = 0.95,
                 prior_acceptance: float = 0.6, prior_weight: float = 2.0,
                 probe_every: int = 4, max_probe_gap: int = 32,
                 verify_ms: list[tuple[int, float]] | None = None,
                 load_aware: bool = True) -> None:
        self.max_k, self.k, self.decay = max_k, start, decay
        self.load_aware = load_aware  # False: draft_price() is 0 whatever the replies said
        self.probe_every, self.max_probe_gap = probe_every, max_probe_gap
        self.probe_gap = probe_every  # plain steps before the next probe
        self.plain_steps = 0  # plain steps since the last drafted block
        self.prior_acceptance, self.prior_weight = prior_acceptance, prior_weight
        self.reached = [0.0] * max_k  # decayed count of blocks that tested position i
        self.passed = [0.0] * max_k  # ... and accepted it
        self.draft_s_per_token: float | None = None
        self._rtt = [0.0] * 5  # decayed sums: n, k, k^2, rtt, k * rtt
        # Decayed (weight, weighted rtt sum) per k seen: a verify's cost is not a line in k on
        # every machine (CPU matmul kernels switch at some widths), so a k that was measured
        # is judged by its own times, and the others from their measured neighbours (rtt()).
        self._rtt_at: dict[int, list[float]] = {}
        self.min_samples = 0.5  # decayed weight (one block ~13 blocks ago) to count as measured
        # The first block's drafting includes the drafter's prefill of the whole prompt, several
        # drafted tokens' worth: as a per-token cost it would make k = 1 look best for many
        # blocks. It is not counted; and
        # the cost is the median of the last few blocks' per-token times, so a block that also
        # paid for something else - the model's prefill after lookup-only blocks, its catch-up
        # on the tokens of plain steps - does not stand for the drafter's speed.
        self.blocks = 0
        self._draft_samples: list[float] = []
        self._overhead = [0.0, 0.0]  # decayed (weight, sum) of a call's round trip less forward
        self.plain_s = 0.0  # seconds spent in plain steps (round trips of blocks of k = 0)
        self.probe_s = 0.0  # what the probes were expected to cost (``probe_cost``)
        self.probe_waits = False  # a probe is due but not affordable yet (``affords_probe``)
        self._price = [0.0, 0.0]  # decayed (weight, sum) of the verifier's price per draft
        self._seed: dict[int, float] = {}  # the verifier's verify_ms, seconds: the cost's shape
        for k, ms in verify_ms or []:
            if k <= max_k:
                self._rtt_at[k] = [1.0, ms / 1e3]  # one block's weight at the verifier's cost
                self._seed[k] = ms / 1e3

    def acceptance(self) -> list[float]:
        """c_i per position, shrunk towards the pooled rate where a position has little data."""
        pooled_pass, pooled_reach = sum(self.passed), sum(self.reached)
        pooled = ((pooled_pass + self.prior_acceptance * self.prior_weight)
                  / (pooled_reach + self.prior_weight))
        return [(p + pooled * self.prior_weight) / (r + self.prior_weight)
                for p, r in zip(self.passed, self.reached, strict=True)]

    def rtt(self, k: int) -> float:
        """A measured k: its own decayed mean. Between measured ks: the straight line between
        the nearest two. Below every measured k: the smallest one's cost (fewer tokens are not
        much cheaper to verify, and a line fitted over k = 2 and 3 put k = 1 near zero). Above:
        the largest one's cost plus the fitted slope. Where the verifier seeded its costs,
        every k not measured is the nearest measured k's cost plus the seeded difference."""
        measured = {j: total / weight for j, (weight, total) in self._rtt_at.items()
                    if weight >= self.min_samples}
        if k in measured:
            return measured[k]
        plain = self._rtt_at.get(0)
        if k == 0 and plain is not None and plain[0] > 1e-9:
            return plain[1] / plain[0]  # plain steps are rare while drafting wins: keep the mean
        if self._seed:
            if not measured:
                return self.seeded(k)
            anchor = min(measured, key=lambda j: (abs(j - k), j > k))  # the nearest, lower first
            return max(measured[anchor] + self.seeded(k) - self.seeded(anchor), 0.0)
        if not measured:
            return self.rtt_line(k)
        below = max((j for j in measured if j < k), default=None)
        above = min((j for j in measured if j > k), default=None)
        if below is not None and above is not None:
            share = (k - below) / (above - below)
            return measured[below] + share * (measured[above] - measured[below])
        if above is not None:
            return measured[above]
        assert below is not None
        return measured[below] + self.slope() * (k - below)

    def seeded(self, k: int) -> float:
        """The verifier's cost of a k-draft verify (seconds): its ``verify_ms`` where it timed
        k, straight lines between the ks it timed, the last segment's slope past them."""
        if k in self._seed:
            return self._seed[k]
        ks = sorted(self._seed)
        below = [j for j in ks if j < k]
        if not below:
            return self._seed[ks[0]]
        above = [j for j in ks if j > k]
        if above:
            lo, hi = below[-1], above[0]
        elif len(ks) > 1:
            lo, hi = ks[-2], ks[-1]
        else:
            return self._seed[ks[0]]
        return self._seed[lo] + (k - lo) * (self._seed[hi] - self._seed[lo]) / (hi - lo)

    def slope(self) -> float:
        """The least-squares line's slope over recent blocks (seconds per drafted token)."""
        n, sk, skk, sr, skr = self._rtt
        spread = n * skk - sk * sk
        return max((n * skr - sk * sr) / spread, 0.0) if spread > 1e-9 else 0.0

    def rtt_line(self, k: int) -> float:
        n, sk, _, sr, _ = self._rtt
        if n == 0:
            return 0.0
        slope = self.slope()
        intercept = (sr - slope * sk) / n
        return max(intercept + slope * k, 0.0)

    def expected_rate(self, k: int) -> float:
        """Expected tokens per second of a block of k drafts."""
        tokens, survive = 1.0, 1.0
        for c in self.acceptance()[:k]:
            survive *= c
            tokens += survive
        seconds = k * ((self.draft_s_per_token or 0.0) + self.draft_price()) + self.rtt(k)
        return tokens / seconds if seconds > 0 else tokens

    def draft_price(self) -> float:
        """Seconds one drafted token costs the other sessions in the verifier's forwards
        (decayed mean of what its replies said): a block is judged by its tokens per second
        of the whole batch's time, not of this client's alone, so a busy verifier whose
        rows cost time gets short drafts and an idle one long drafts (load-aware
        speculation; with every session deciding so, drafting pays only where it raises the
        batch's goodput)."""
        weight, total = self._price
        return total / weight if weight > 1e-9 and self.load_aware else 0.0

    def plain_rate(self) -> float:
        """Tokens per second of plain decode steps (k = 0)."""
        seconds = self.rtt(0)
        return 1.0 / seconds if seconds > 0 else float("inf")

    def measured(self, k: int) -> bool:
        entry = self._rtt_at.get(k)
        return entry is not None and entry[0] >= self.min_samples

    def free_k(self, acceptance: float) -> int | None:
        """The k with the most expected tokens per second for a draft that costs nothing to
        make, its tokens each passing with probability ``acceptance``: 0 where none beats a
        plain step, at most one past the longest k measured (or seeded)."""
        return self._best_free(acceptance)[0]

    def longest_known(self) -> int | None:
        """The longest k whose round trip was measured not too long ago, or that the verifier
        timed (its seeded cost keeps the shape of the cost in k: :meth:`rtt`)."""
        return max([k for k, (w, _) in self._rtt_at.items() if w > 0.05] + list(self._seed),
                   default=None)

    def _best_free(self, acceptance: float) -> tuple[int, float]:
        best, best_rate = 0, self.plain_rate()
        longest = self.longest_known()
        if longest is None:
            return best, best_rate
        tokens, survive = 1.0, 1.0
        for k in range(1, min(self.max_k, longest + 1) + 1):
            survive *= acceptance
            tokens += survive
            seconds = self.rtt(k) + k * self.draft_price()
            if seconds > 0 and tokens / seconds > best_rate:
                best, best_rate = k, tokens / seconds
        return best, best_rate

    def prefers_free(self, acceptance: float) -> bool | None:
        if self._rtt[0] == 0 or self.draft_s_per_token is None:
            return None  # the model's cost is not measured yet
        model = max(self.expected_rate(k) for k in range(1, self.max_k + 1))
        k, rate = self._best_free(acceptance)
        return k > 0 and rate > model

    def could_pay(self, acceptance: float = OPTIMISTIC_ACCEPTANCE) -> bool:
        """Whether drafting beats plain steps at some k if every draft passed with
        probability ``acceptance``: where even that loses (a 2-token verify costing twice a
        plain step), a probe could only cost time, so none is made."""
        plain = self.plain_rate()
        for k in range(1, self.max_k + 1):
            tokens = sum(acceptance ** i for i in range(k + 1))
            seconds = k * ((self.draft_s_per_token or 0.0) + self.draft_price()) + self.rtt(k)
            if seconds <= 0 or tokens / seconds > plain:
                return True
        return False

    def next_k(self, catch_up_s: float = 0.0, room: int | None = None) -> int:
        if self.draft_s_per_token is None or not (self._rtt[0] or self.measured(0)):
            return self.k  # not measured yet (nor seeded)
        if 0 not in self._rtt_at:
            self.k = 0  # one plain step, to know what drafting nothing costs
            return self.k
        # Climb: at most one past the longest draft measured, so a cost that is not a line
        # is found step by step rather than extrapolated.
        known = self.longest_known()
        longest = self.k if known is None else known
        best = max(range(1, min(self.max_k, longest + 1) + 1), key=self.expected_rate)
        rate, plain = self.expected_rate(best), self.plain_rate()
        due = rate < plain and self.plain_steps >= self.probe_gap and self.could_pay()
        self.probe_waits = due and not self.affords_probe(catch_up_s, room)
        if rate >= plain and self.repays(catch_up_s, rate, room):
            self.k, self.plain_steps, self.probe_gap = best, 0, self.probe_every
        elif due and not self.probe_waits:
            self.k, self.plain_steps = 1, 0  # drafting lost; look again now and then
            self.probe_gap = min(2 * self.probe_gap, self.max_probe_gap)
            self.probe_s += self.probe_cost(catch_up_s)
        else:
            self.k = 0
            self.plain_steps += 1
        return self.k

    def repays(self, catch_up_s: float, rate: float, room: int | None) -> bool:
        """Whether drafting at ``rate`` (tokens per second) over the tokens left to generate
        saves more than the drafter's catch-up costs first (where it is behind: after plain
        steps, lookup-only blocks, or before its first draft of the prompt)."""
        if catch_up_s <= 0 or room is None:
            return True
        saved_per_token = 1.0 / self.plain_rate() - 1.0 / rate
        return saved_per_token * room >= catch_up_s

    def probe_cost(self, catch_up_s: float) -> float:
        """A probe's seconds beyond the plain step it replaces: the drafter's catch-up, its
        one draft and a 1-token verify's surplus over a plain step's."""
        return (catch_up_s + (self.draft_s_per_token or 0.0) + self.draft_price()
                + max(self.rtt(1) - self.rtt(0), 0.0))

    def affords_probe(self, catch_up_s: float, room: int | None) -> bool:
        """Probes, together, cost at most ``PROBE_SHARE`` of the time spent in plain steps -
        a drafter far behind (the whole prompt before its first draft) waits until the plain
        steps have paid for its catch-up - and none is made near the end."""
        if room is not None and room < MIN_PROBE_ROOM:
            return False
        return self.probe_s + self.probe_cost(catch_up_s) <= PROBE_SHARE * self.plain_s

    def seed_drafting(self, seconds_per_token: float) -> None:
        """With the verifier's seeded verify costs, the first block is chosen on this
        machine's costs too (until blocks measured here replace the seed)."""
        if self.draft_s_per_token is None:
            self.draft_s_per_token = seconds_per_token

    def plain_run(self, room: int, copy_rate: float | None = None) -> int:
        """Plain steps up to the next probe, so a run never delays one (at most
        ``PLAIN_RUN``; a probe waiting for its budget does not shorten runs); a plain step's
        cost is then per token of the run. Where free drafts (copies) begin inside runs at
        ``copy_rate`` per token, a run of n tokens delays such a copy by (n - 1) / 2 tokens on
        average, each losing ``COPY_SAVING`` of a step t, while its round trip's overhead o is
        shared by n tokens: n = sqrt(o / (c t COPY_SAVING / 2)) minimises
        o / n + c (n - 1) t COPY_SAVING / 2 per token - short runs next to a
        verifier whose calls cost little, long ones across a network."""
        if self.could_pay() and not self.probe_waits:  # a run does not delay a probe
            room = min(room, max(self.probe_gap - self.plain_steps, 0))
        longest = PLAIN_RUN
        overhead, step = self.call_overhead(), self.rtt(0)
        if copy_rate and overhead is not None and step > 0:
            tokens = (overhead / (copy_rate * step * COPY_SAVING / 2)) ** 0.5
            longest = min(longest, max(0, round(tokens) - 1))
        return max(0, min(room, longest))

    def call_overhead(self) -> float | None:
        """A verify call's round trip less the verifier's forward (decayed mean, seconds)."""
        weight, total = self._overhead
        return total / weight if weight > 1e-9 else None

    def update(self, block: BlockOutcome) -> None:
        """A free block (a lookup match sent alone) tells the verify cost of its length, not
        the model's acceptance or drafting time: those stay the model's own. A plain run's
        round trip counts per token, and its tokens as plain steps."""
        proposed, accepted, rtt_s = block.depth, block.num_accepted, block.round_trip_s
        forward_s, plain_tokens = block.verifier_s, block.plain_tokens
        d = self.decay
        whole_rtt_s = rtt_s
        self._price = [d * self._price[0] + 1.0, d * self._price[1] + block.draft_price_s]
        if forward_s is not None and self.blocks:
            self._overhead = [d * self._overhead[0] + 1.0,
                              d * self._overhead[1] + max(rtt_s - forward_s, 0.0)]
        if proposed == 0 and plain_tokens > 1:
            rtt_s /= plain_tokens
            self.plain_steps += plain_tokens - 1
        self.blocks += 1
        if not block.free:
            for i in range(self.max_k):
                self.reached[i] *= d
                self.passed[i] *= d
            for i in range(min(accepted + 1, proposed)):  # positions 0..accepted were tested
                self.reached[i] += 1
                self.passed[i] += float(i < accepted)
            if proposed and self.blocks > 1:
                drafting = max(block.drafting_s - block.catch_up_s, 0.0)
                self._draft_samples = [*self._draft_samples[-(DRAFT_SAMPLES - 1):],
                                       drafting / proposed]
                self.draft_s_per_token = statistics.median(self._draft_samples)
        if self.blocks == 1:
            return  # its round trip also paid for the prompt's prefill
        if proposed == 0:
            self.plain_s += whole_rtt_s
        for entry in self._rtt_at.values():
            entry[0] *= d
            entry[1] *= d
        entry = self._rtt_at.setdefault(proposed, [0.0, 0.0])
        entry[0] += 1.0
        entry[1] += rtt_s
        k = float(proposed)
        self._rtt = [d * v for v in self._rtt]
        for i, v in enumerate((1.0, k, k * k, rtt_s, k * rtt_s)):
            self._rtt[i] += v


def parse_k(spec: str) -> int | str:
    """A ``-k`` value's form: an integer >= 0, ``auto`` or ``heuristic`` (ValueError if not);
    its upper bound is the verifier's (``make_draft_length``)."""
    if spec in ("auto", "heuristic"):
        return spec
    try:
        k = int(spec)
    except ValueError:
        raise ValueError(f"-k must be an integer, 'auto' or 'heuristic'; got {spec!r}") from None
    if k < 0:
        raise ValueError(f"-k must be at least 0; got {k}")
    return k


def make_draft_length(spec: str, max_k: int, verify_ms: list[tuple[int, float]] | None = None,
                      load_aware: bool = True) -> DraftLength:
    """``-k`` values: an integer, ``auto`` (cost model, seeded with the verifier's measured
    ``verify_ms``; ``load_aware``: pricing drafts by the verifier's load) or ``heuristic``."""
    k = parse_k(spec)
    if k == "auto":
        return CostModelLength(max_k=max_k, verify_ms=verify_ms, load_aware=load_aware)
    if k == "heuristic":
        return HeuristicLength(max_k=max_k)
    assert isinstance(k, int)
    if not 0 <= k <= max_k:
        raise ValueError(f"-k must be in [0, {max_k}] (the verifier's max_draft_tokens); got {k}")
    return FixedLength(k)
