"""``--engine auto`` on a CPU where two engines can serve the target: the one whose measured
costs serve the expected work fastest.

Every start of an engine records its verify costs (``/v1/info``'s ``verify_ms``: a forward of k
drafts, k = 0..16, one session) under the model, this machine (the CPU, the cores this process
may use, the threads), the session context and the engine's own options (int8's outliers,
llama.cpp's kernels): :func:`engine_costs_path`, the verify costs' own file. A record that is
not what a start writes (negative, NaN or zero costs, a k no start times, wrong types: the file
is data anyone with the home's volume can write) is ignored with a warning, as if that engine
had not been measured yet. Where llama.cpp (the GGUF file) and the int8 engine (the converted
folder) both have costs recorded, auto prices the work the verifier expects: with ``sessions``
sessions at once, each drafting k tokens accepted at rate ``acceptance``, a forward holds
``sessions * (k + 1)`` rows and yields ``sessions * (1 - a^(k+1)) / (1 - a)`` tokens (Leviathan
et al. 2023); the engine with the fewer milliseconds per output token at its best k wins. A
forward of several sessions' rows is priced as one session's block of as many rows (within 10%
on both engines in docs/benchmarks/cpu_blocks_1204.json), and past the sweep's 17 rows linearly
from its last two points.

Where a candidate has no costs recorded yet, auto takes the first engine that claims the model
(llama.cpp) and says so: ``/v1/info``'s ``engine_choice`` names what to run once to measure.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from shared.engines.target import VERIFY_KS, TargetOptions, checked_costs, verify_costs_path
from shared.machine_cache import cpu_name, read_json, update_json

log = logging.getLogger(__name__)

MAX_K = VERIFY_KS[-1]  # the longest block each start times


class AutoOptions(BaseModel):
    """``--engine auto``'s own settings: the work it prices the candidates for."""

    expected_sessions: int = Field(
        1, ge=1, description="--engine auto, where two engines can serve the target (llama.cpp "
        "on its GGUF file and int8 on its converted folder): how many sessions you expect to "
        "draft at once; auto picks the engine whose recorded verify costs (every start records "
        "them, in $SPECDEC_HOME/verify-costs.json) give the fewest ms per output token for "
        "that work")
    expected_acceptance: float = Field(
        0.0, ge=0.0, lt=1.0, description="--engine auto: the acceptance you expect of a "
        "drafted token (0: text where nothing can be drafted; a verify block then yields one "
        "token, and the cheaper one-token step wins)")


@dataclass(frozen=True)
class Workload:
    """What the verifier expects to serve."""

    sessions: int = 1  # sessions drafting at once
    acceptance: float = 0.0  # a draft token's chance of acceptance (0: nothing to draft)


def engine_costs_path() -> Path:
    """The one cache of measured costs (``verify_costs_path``): each engine's start times its
    blocks there under its own keys, and records them here under the model's."""
    return verify_costs_path()


def usable_cpus() -> int:
    """The cores this process may run on (a container's limit, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def _key(target: TargetOptions) -> str:
    """What every candidate's costs depend on besides its own options: the model, the CPU, the
    cores and threads, and the session context."""
    return (f"auto|{target.model}|{cpu_name()}|cpus={usable_cpus()}|threads={target.threads}"
            f"|context={target.max_context}")


def _entry(engine: str, options: Any) -> str:
    """An engine's name and its own options (they change what its forwards cost)."""
    said = options.model_dump_json() if isinstance(options, BaseModel) else ""
    return f"{engine}|{said}"


def record_costs(target: TargetOptions, engine: str, options: Any,
                 verify_ms: list[tuple[int, float]]) -> None:
    """Keep ``engine``'s verify costs (with its own ``options``) for ``target`` on this
    machine (an engine's start); costs that are not a start's (none timed: a short context)
    are not kept."""
    try:
        costs = checked_costs([list(pair) for pair in verify_ms])
    except ValueError:
        return

    def keep(data: dict[str, Any]) -> None:
        entry = data.get(_key(target))
        if not isinstance(entry, dict):
            entry = data[_key(target)] = {}
        entry[_entry(engine, options)] = [list(pair) for pair in costs]

    update_json(engine_costs_path(), keep, "the engines' verify costs")


def recorded_costs(target: TargetOptions, options: Mapping[str, Any],
                   engines: list[str]) -> dict[str, list[tuple[int, float]]]:
    """The recorded costs of each of ``engines`` (with its options in ``options``) that has a
    valid record for ``target`` here; a record that is not one is left out with a warning."""
    path = engine_costs_path()
    entry = read_json(path, "the engines' verify costs").get(_key(target))
    if entry is None:
        return {}
    if not isinstance(entry, dict):
        log.warning("ignoring the engines' costs recorded in %s (not an object): --engine auto "
                    "treats every engine as not measured yet", path)
        return {}
    costs = {}
    for name in engines:
        pairs = entry.get(_entry(name, options.get(name)))
        if pairs is None:
            continue
        try:
            costs[name] = checked_costs(pairs)
        except ValueError as exc:
            log.warning("ignoring %s's costs recorded in %s (%s): --engine auto treats it as "
                        "not measured yet", name, path, exc)
    return costs


def rows_ms(verify_ms: list[tuple[int, float]], rows: int) -> float:
    """A forward of ``rows`` new tokens, from one session's costs of k drafts (k + 1 rows):
    interpolated between measured row counts, extrapolated linearly past the last two."""
    points = sorted((k + 1, ms) for k, ms in verify_ms)
    if len(points) == 1:
        return points[0][1] * rows / points[0][0]
    for (r0, m0), (r1, m1) in zip(points, points[1:], strict=False):
        if rows <= r1:
            return m0 + (m1 - m0) * (rows - r0) / (r1 - r0) if rows >= r0 else m0
    (r0, m0), (r1, m1) = points[-2], points[-1]
    return m1 + (m1 - m0) * (rows - r1) / (r1 - r0)


def expected_tokens(k: int, acceptance: float) -> float:
    """Output tokens of a block of k drafts each accepted with probability ``acceptance``."""
    if acceptance >= 1.0:
        return float(k + 1)
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


def ms_per_token(verify_ms: list[tuple[int, float]], work: Workload) -> tuple[float, int]:
    """The fewest milliseconds per output token over k = 0..16, and that k."""
    return min(((rows_ms(verify_ms, work.sessions * (k + 1))
                 / (work.sessions * expected_tokens(k, work.acceptance)), k)
                for k in range(MAX_K + 1)), key=lambda pair: pair[0])


@dataclass(frozen=True)
class Choice:
    engine: str
    why: str


def price(candidates: list[str], costs: dict[str, list[tuple[int, float]]],
           work: Workload) -> Choice:
    """The candidate with the fewest ms per output token for ``work``; the first candidate
    where any has no costs recorded."""
    missing = [name for name in candidates if name not in costs]
    if missing:
        return Choice(candidates[0], f"{', '.join(missing)} not measured here yet (start the "
                      f"verifier once with --engine {missing[0]}): the first that claims the "
                      "model")
    priced = {name: ms_per_token(costs[name], work) for name in candidates}
    engine = min(candidates, key=lambda name: priced[name][0])
    said = "; ".join(f"{name} {ms:.1f} ms a token at k={k}"
                     for name, (ms, k) in priced.items())
    return Choice(engine, f"measured costs for {work.sessions} session(s) at acceptance "
                  f"{work.acceptance:g}: {said}")
