"""What the verifier's jobs need from a target model: the engine interface.

An engine holds the model and the sessions' caches, one *slot* per session. The scheduler hands
it a batch of :class:`Step` s - new tokens for some slots, and for a verify block what to decide
from their rows - and gets back one :class:`StepResult` per step: a verdict (a tree's accepted
path already moved to where a chain would have put it), the rows themselves (beam search), or
nothing (a prefill). Jobs never see logits, pools or devices; they only turn a verdict into a
response.

Implementations: the causal slot-pool engine (``target.py``), the encoder-decoder engine
(``seq2seq.py``), and tensor parallelism as a wrapper around the first
(``tensor_parallel.py``). An engine that scores with another library (llama.cpp) implements
:class:`BatchForward`'s two model operations, or the whole protocol.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import torch

from shared.engines import MIN_CONTEXT
from shared.machine_cache import cpu_name, read_json, specdec_home, update_json
from shared.models import ModelSpecError
from shared.protocol.acceptance import Block, Verdict, decide
from shared.protocol.schema import StepLoad

VERIFY_KS = (0, 1, 2, 3, 4, 6, 8, 12, 16)  # drafts per block timed at start (``verify_ms``)
# The dearest verify forward a cost file may claim: ten minutes (a recorded cost past it is
# nonsense, and priced against the others it would steer ``--engine auto``).
MAX_VERIFY_MS = 600_000.0

log = logging.getLogger(__name__)


def check_context(context: int) -> None:
    """Refuse a session context too short for the start's warm-up (ModelSpecError: the
    verifier prints it as one line): ``--max-context``, ``--kv-budget-tokens`` or the model's
    own limit below :data:`MIN_CONTEXT`."""
    if context < MIN_CONTEXT:
        raise ModelSpecError(
            f"a session may hold {context} tokens here (the least of --max-context, "
            f"--kv-budget-tokens and the model's own limit); the verifier needs at least "
            f"{MIN_CONTEXT}")


def checked_costs(value: Any, ks: Sequence[int] | None = None) -> list[tuple[int, float]]:
    """A recorded ``verify_ms`` as [(k, ms)] where it is one, else ValueError saying why: a
    non-empty list of [k, ms] pairs, k an integer of ``ks`` (default :data:`VERIFY_KS`) each at
    most once in increasing order (exactly ``ks`` where given), ms a finite number above 0 and
    at most :data:`MAX_VERIFY_MS`. Cost files are data anyone with the home's volume can write:
    a negative cost priced rows below nothing (every verify answered 500), a huge k had the
    start time a block of that many tokens."""
    if not isinstance(value, list) or not value:
        raise ValueError("not a non-empty list of [k, ms] pairs")
    allowed = VERIFY_KS if ks is None else tuple(ks)
    pairs: list[tuple[int, float]] = []
    for pair in value:
        if not isinstance(pair, list | tuple) or len(pair) != 2:
            raise ValueError(f"{pair!r} is not a [k, ms] pair")
        k, ms = pair
        if type(k) is not int or k not in allowed:
            raise ValueError(f"k={k!r} is not one of the timed {list(allowed)}")
        if isinstance(ms, bool) or not isinstance(ms, int | float) or not math.isfinite(ms) \
                or not 0.0 < ms <= MAX_VERIFY_MS:
            raise ValueError(f"k={k}: {ms!r} is not a time in ms (above 0, at most "
                             f"{MAX_VERIFY_MS:.0f})")
        if pairs and k <= pairs[-1][0]:
            raise ValueError(f"k={k} out of order")
        pairs.append((k, float(ms)))
    if ks is not None and [k for k, _ in pairs] != list(allowed):
        raise ValueError(f"the ks {[k for k, _ in pairs]} are not the timed {list(allowed)}")
    return pairs


def verify_costs_path() -> Path:
    """``$SPECDEC_VERIFY_COSTS``, else ``$SPECDEC_HOME/verify-costs.json``: the verify costs
    measured at earlier starts, per model, engine, dtype, device, threads and versions."""
    return Path(os.environ.get("SPECDEC_VERIFY_COSTS")
                or specdec_home() / "verify-costs.json")


def device_name(device: torch.device | str) -> str:
    """The chip a cost was measured on: the GPU's name, else the CPU's."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    return cpu_name()


class EngineLost(RuntimeError):
    """The engine can serve nothing more (its model file changed or went away under it): the
    verifier answers the batch with a 503 and ends, in one line, rather than read the file."""


@dataclass(frozen=True)
class ForwardItem:
    """New tokens for one slot; ``keep_logits`` asks for their logits rows back."""

    slot: int
    start: int  # tokens already in the slot
    token_ids: list[int]
    keep_logits: bool
    encoder_ids: list[int] | None = None  # encoder-decoder targets: a new session's source
    tree_parents: list[int] | None = None  # token_ids[1:] form a tree below token_ids[0]
    keep_from: int = 0  # with keep_logits: the rows of token_ids[keep_from:] only
    # token_ids[steps_from:] were generated by earlier steps (a reopened session's): an engine
    # whose prompts round otherwise than its steps writes them as its steps did
    steps_from: int | None = None




@dataclass(frozen=True, kw_only=True)
class TargetOptions:
    """How to load a target: the settings every engine reads (the verifier's
    ``Settings.target_options`` fills it), and the chosen engine's own options."""

    # No defaults: the verifier's Settings hold them (``Settings(model=...).target_options()``)
    model: str  # short name, folder, .gguf file or hub id
    device: str
    max_context: int  # tokens a session may hold; 0: the model's own limit
    kv_budget_tokens: int  # 0: DEFAULT_KV_BUDGET, or sized from free memory on CUDA
    threads: int  # the engine's CPU threads; 0: every core this process may use
    acceptance: str  # "device": batched next to the rows; "host": the reference
    max_batch_tokens: int  # tokens per batched forward
    max_batch_size: int  # jobs per batched forward (1 without batching)
    max_draft_tokens: int  # the longest block a verify call may send
    engine_options: Any = None  # the engine's own options model (``Backend.options``)


@dataclass(frozen=True)
class ModelInfo:
    """What a client and the request validator must know about the target."""

    name: str
    vocab_size: int
    eos_token_ids: list[int]
    fingerprint: str  # of the tokenizer
    max_context: int  # tokens one session may hold
    model_limit: int  # the model's own context length
    dtype: str
    device: str
    encoder_decoder: bool = False
    decoder_start_token_id: int | None = None
    verify_ms: list[tuple[int, float]] = field(default_factory=list)  # [k, ms] measured at start
    # how the rows are computed: "exact" (a verify block's rows equal one-token steps', so
    # greedy speculation equals the target alone's), "fast", or "inexact: <why>"
    kernels: str = "exact"
    engine: str = ""  # the engine's name, and why ``--engine auto`` chose it
    engine_choice: str = ""
    # the Hugging Face tokenizer (structured output's grammar reads it; never sent)
    tokenizer: Any = field(default=None, repr=False, compare=False)


@dataclass(frozen=True)
class Step:
    """One job's share of a batched forward. With a ``block`` to decide, the result holds its
    verdict; without one, the item's logits rows on the host ([n, vocab] float32) when it kept
    them."""

    item: ForwardItem
    block: Block | None = None
    # tokens to write into the same slot before ``item`` in the same forward (a session's
    # prompt, deferred from its create to its first verify): no rows, no result of their own
    prefill: ForwardItem | None = None


@dataclass(frozen=True)
class StepResult:
    """What the engine gives back for one step: the verdict of its block, or the rows it kept
    (a step without a block: beam search reads whole rows), or neither (a prefill); and the
    scheduler adds the batched forward it rode in (``load``)."""

    verdict: Verdict | None = None
    rows: torch.Tensor | None = None  # [n, vocab] float32 on the host
    load: StepLoad | None = None
    # the step's rows held NaN or an infinity (a fault of the engine's arithmetic): the step
    # is failed alone, nothing of it decided or committed
    non_finite: bool = False

    def decided(self) -> Verdict:
        """The verdict of a step that had a block."""
        if self.verdict is None:
            raise RuntimeError("the engine returned no verdict for a step with a block")
        return self.verdict


NOTHING = StepResult()


class Engine(Protocol):
    info: ModelInfo
    trees: bool  # verifies token trees (a verify call with ``tree_parents``)
    acceptance: str  # "device": decided batched next to the rows; "host": the reference path

    @property
    def num_slots(self) -> int: ...

    @property
    def free_slots(self) -> int: ...

    @property
    def slot_tokens(self) -> int: ...

    @property
    def nbytes(self) -> int:
        """Bytes its caches hold."""

    def allocate(self) -> int | None:
        """A free slot, or None when all are taken."""

    def release(self, slot: int) -> None: ...

    def reserve(self, slot: int, tokens: int) -> bool:
        """Make ``slot`` hold ``tokens`` tokens (a KV region may grow); False when the caches
        have no room for that now (the slot is unchanged)."""

    def run(self, steps: list[Step]) -> list[StepResult]:
        """One forward over every step's new tokens (written into their slots), then each
        step's result, in step order."""

    def reorder(self, slots: list[int], parents: list[int], length: int) -> None:
        """Slot ``slots[j]`` takes the first ``length`` cached positions of slot
        ``slots[parents[j]]`` (beam search following its parents)."""

    def counters(self) -> dict[str, int]:
        """Engine-specific counts for ``/metrics`` (e.g. static-shape replays)."""


# The most prompt tokens one forward writes: a longer prompt is written ahead in pieces of this
# many (cut at absolute positions that are multiples of it, so a prompt is cut in the same
# places however it comes: llama.cpp's exact prompts are cut at multiples of 512), bounding a
# forward's activations whatever the prompt's length.
PREFILL_CHUNK = 2048


def written_ahead(item: ForwardItem, chunk: int = PREFILL_CHUNK
                  ) -> tuple[list[ForwardItem], ForwardItem]:
    """The prompt pieces of ``item`` to write first, each alone in a forward, and what is left
    of it: the tokens before its first kept row, cut at multiples of ``chunk``. Trees and
    encoder inputs are left whole."""
    head = item.keep_from if item.keep_logits else len(item.token_ids)
    if item.tree_parents or item.encoder_ids is not None:
        return [], item
    cut = (item.start + head) // chunk * chunk - item.start  # the last cut before the rows
    if cut < chunk:
        return [], item
    pieces, at, steps = [], 0, item.steps_from
    while at < cut:
        end = min(cut, (item.start + at) // chunk * chunk + chunk - item.start)
        pieces.append(ForwardItem(item.slot, item.start + at, item.token_ids[at:end], False,
                                  steps_from=None if steps is None or steps >= end
                                  else max(0, steps - at)))
        at = end
    rest = replace(item, start=item.start + cut, token_ids=item.token_ids[cut:],
                   keep_from=max(0, item.keep_from - cut),
                   steps_from=None if item.steps_from is None
                   else max(0, item.steps_from - cut))
    return pieces, rest


def needs_forward(item: ForwardItem) -> bool:
    """New tokens, or a new encoder-decoder session's encoder input."""
    return bool(item.token_ids) or item.encoder_ids is not None


class PoolSlots:
    """The slot half of :class:`Engine` for an engine whose ``pool`` hands out the slots
    (``SlotAllocator``: the KV pool, the encoder-decoder states) and moves them for beams."""

    pool: Any

    @property
    def num_slots(self) -> int:
        return int(self.pool.num_slots)

    @property
    def free_slots(self) -> int:
        return int(self.pool.free_slots)

    @property
    def slot_tokens(self) -> int:
        return int(self.pool.slot_tokens)

    @property
    def nbytes(self) -> int:
        return int(self.pool.nbytes)

    def allocate(self) -> int | None:
        return self.pool.allocate()  # type: ignore[no-any-return]

    def release(self, slot: int) -> None:
        self.pool.release(slot)

    def reserve(self, slot: int, tokens: int) -> bool:
        return bool(self.pool.reserve(slot, tokens))

    def reorder(self, slots: list[int], parents: list[int], length: int) -> None:
        self.pool.reorder(slots, parents, length)


class SlotAllocator:
    """``num_slots`` slot ids of ``slot_tokens`` positions each, handed out and taken back (the
    encoder-decoder engine's per-session states, llama.cpp's sequences, the int8 engine's KV
    tensors): a ``pool`` for :class:`PoolSlots`."""

    def __init__(self, num_slots: int, slot_tokens: int) -> None:
        self.num_slots, self.slot_tokens = num_slots, slot_tokens
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def allocate(self) -> int | None:
        return self._free.pop() if self._free else None

    def release(self, slot: int) -> None:
        if slot in self._free:
            raise ValueError(f"slot {slot} is already free")
        self._free.append(slot)

    def reserve(self, slot: int, tokens: int) -> bool:
        return tokens <= self.slot_tokens


class BatchForward:
    """:meth:`Engine.run` from two model operations a subclass provides: ``forward`` (rows left
    on the model's device) and ``keep_path`` (a tree's accepted nodes moved in the cache).
    Acceptance runs next to the rows (``acceptance = "device"``) or on the host (``"host"``,
    the reference path)."""

    acceptance = "device"
    prefill_chunk = PREFILL_CHUNK  # the most prompt tokens one forward writes
    info: ModelInfo

    def forward(self, items: list[ForwardItem]) -> list[torch.Tensor | None]:
        """One forward over the new tokens of every item; [n, vocab] logits rows for the items
        that asked, on the model's device in its dtype."""
        raise NotImplementedError

    def keep_path(self, slot: int, root: int, path: list[int]) -> None:
        """A tree's root is cached at ``root`` and node i at ``root + 1 + i``: move the nodes
        of ``path`` to ``root + 1``, ``root + 2``, ... (where a chain would have put them)."""
        raise NotImplementedError

    def run(self, steps: list[Step]) -> list[StepResult]:
        steps = [self._write_long_prompts(step) for step in steps]
        # A step's prefill goes just before its item: every layer writes all new keys and values
        # into their slots before any segment attends, so the item sees them.
        items = [item for step in steps
                 for item in (step.prefill, step.item) if item is not None and needs_forward(item)]
        scored = iter(self.forward(items) if items else [])
        rows = []
        for step in steps:
            if step.prefill is not None and needs_forward(step.prefill):
                next(scored)  # kept no rows
            rows.append(next(scored) if needs_forward(step.item) else None)
        # one check for the whole batch (one sync): a step whose rows are not all finite
        # fails alone, the others are decided as if it were not there
        with_rows = [j for j, r in enumerate(rows) if r is not None]
        finite = (torch.stack([torch.isfinite(rows[j]).all() for j in with_rows]).tolist()  # type: ignore[arg-type]
                  if with_rows else [])
        broken = {j for j, ok in zip(with_rows, finite, strict=True) if not ok}
        checked = [j for j, step in enumerate(steps)
                   if step.block is not None and rows[j] is not None and j not in broken]
        verdicts = decide([rows[j] for j in checked],  # type: ignore[misc]
                          [steps[j].block for j in checked],  # type: ignore[misc]
                          on_device=self.acceptance == "device")
        results = [  # rows asked for without a block: to the host
            NOTHING if kept is None or step.block is not None
            else StepResult(rows=kept.float().cpu())
            for step, kept in zip(steps, rows, strict=True)]
        for j in broken:
            results[j] = StepResult(non_finite=True)
        for j, verdict in zip(checked, verdicts, strict=True):
            item = steps[j].item
            if verdict.path is not None:
                self.keep_path(item.slot, item.start, verdict.path)
            results[j] = StepResult(verdict=verdict)
        return results

    def _write_long_prompts(self, step: Step) -> Step:
        """A prompt longer than PREFILL_CHUNK is written ahead, a piece per forward; the step
        keeps the rest (memory bounded whatever the prompt's length)."""
        pieces: list[ForwardItem] = []
        prefill = step.prefill
        if prefill is not None:
            pieces, prefill = written_ahead(prefill, self.prefill_chunk)
            if pieces and not prefill.token_ids:
                prefill = None
        item = step.item
        if prefill is None:  # else the item follows the prefill's last piece, as it is
            ahead, item = written_ahead(item, self.prefill_chunk)
            pieces += ahead
        for piece in pieces:
            self.forward([piece])
        return step if not pieces else replace(step, prefill=prefill, item=item)

    def warm_up_and_time(self, key: str) -> None:
        """One small forward on a free slot (buffers allocated before the first client), then
        the verify costs that ``/v1/info`` reports (:meth:`measured_verify_ms` under ``key``).
        A session context below :data:`MIN_CONTEXT` is refused first (ModelSpecError)."""
        check_context(self.info.max_context)
        slot = self.allocate()  # type: ignore[attr-defined]
        if slot is None:
            return
        ids = [i % self.info.vocab_size for i in range(16)]
        self.forward([ForwardItem(slot, 0, ids, False)])
        self.info = replace(self.info, verify_ms=self.measured_verify_ms(slot, ids, key))
        self.release(slot)  # type: ignore[attr-defined]

    def measured_verify_ms(self, slot: int, ids: list[int], key: str,
                           ) -> list[tuple[int, float]]:
        """The verify costs of :meth:`time_verify_blocks`, timed at this model's first start
        with this ``key`` (engine, model file, dtype, device, threads, versions) and then read
        from :func:`verify_costs_path`: on a CPU the sweep takes tens of seconds, and a start
        on the same machine measures the same costs within its noise (the client's cost model
        soon replaces them with what it measures itself)."""
        ks = self.verify_ks()
        if not ks:
            return []
        key = f"{key}|ks={','.join(map(str, ks))}"
        path = verify_costs_path()
        known = read_json(path, "the verify costs").get(key)
        if known is not None:
            try:
                earlier = checked_costs(known, ks)
            except ValueError as exc:  # written by something else: a crash, a hand, an attack
                log.warning("ignoring the verify costs recorded in %s for this start (%s): "
                            "timing again", path, exc)
            else:
                if self.still_holds(slot, ids, earlier):
                    log.info("verify costs of an earlier start (%s)", path)
                    return earlier
                log.info("the verify costs of an earlier start no longer hold here: timing "
                         "again")
        timed = self.time_verify_blocks(slot, ids, ks)

        def keep(data: dict[str, Any]) -> None:  # what others wrote during the sweep stays
            data[key] = [list(pair) for pair in timed]

        update_json(path, keep, "the verify costs")
        return timed

    def still_holds(self, slot: int, ids: list[int], earlier: list[tuple[int, float]],
                    tolerance: float = 0.3) -> bool:
        """Whether two of ``earlier``'s costs (no drafts, and the middle k) time within
        ``tolerance`` of what they were: a sweep timed while something else ran (a build, a
        benchmark) would otherwise price every block wrongly on every later start."""
        probes = [earlier[0], earlier[len(earlier) // 2]] if earlier else []
        again = dict(self.time_verify_blocks(slot, ids, tuple(k for k, _ in probes)))
        return all(abs(again[k] / ms - 1.0) <= tolerance for k, ms in probes if ms > 0)

    def verify_ks(self) -> tuple[int, ...]:
        """The :data:`VERIFY_KS` whose block fits a session after the 16-token warm-up cache."""
        return tuple(k for k in VERIFY_KS if 16 + k + 1 <= self.info.max_context)

    def time_verify_blocks(self, slot: int, ids: list[int], ks: tuple[int, ...] | None = None,
                           repeats: int = 2) -> list[tuple[int, float]]:
        """[k, ms] of a verify forward of k drafts (default: :meth:`verify_ks`) on the 16-token
        warm-up cache (the fastest of ``repeats``, after one untimed): what ``/v1/info``
        reports as ``verify_ms``."""
        timings = []
        for k in self.verify_ks() if ks is None else ks:
            block = [ids[i % len(ids)] for i in range(k + 1)]
            times = []
            for i in range(repeats + 1):
                started = time.perf_counter()
                rows = self.forward([ForwardItem(slot, 16, block, True)])
                if rows[0] is not None:
                    rows[0].cpu()  # the logits are ready (a GPU forward returns early)
                if i:
                    times.append(time.perf_counter() - started)
            # at least a microsecond: a recorded 0 would be refused and timed at every start
            timings.append((k, max(round(1e3 * min(times), 3), 0.001)))
        return timings
