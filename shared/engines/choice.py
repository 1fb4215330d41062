"""``--engine auto`` on a CPU where two engines can serve the target: the one whose measured
costs serve the expected work fastest.

Every start of an engine records its verify costs (``/v1/info``'s ``verify_ms``: a forward of k
drafts, k = 0..16, one session) under the model and this machine (:func:`engine_costs_path`: the
verify costs' own file). Where llama.cpp (the GGUF file) and the int8 engine (the converted
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

from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, Field

from shared.engines.target import VERIFY_KS, verify_costs_path
from shared.machine_cache import cpu_name, read_json, write_json

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


def _key(model: str, threads: int) -> str:
    return f"auto|{model}|{cpu_name()}|threads={threads}"


def record_costs(model: str, threads: int, engine: str,
                 verify_ms: list[tuple[int, float]]) -> None:
    """Keep ``engine``'s verify costs for ``model`` on this machine (an engine's start)."""
    if not verify_ms:
        return
    path = engine_costs_path()
    data = read_json(path)
    data.setdefault(_key(model, threads), {})[engine] = [list(pair) for pair in verify_ms]
    write_json(path, data, "the engines' verify costs")


def recorded_costs(model: str, threads: int) -> dict[str, list[tuple[int, float]]]:
    entry = read_json(engine_costs_path()).get(_key(model, threads), {})
    if not isinstance(entry, dict):
        return {}
    return {name: [(int(k), float(ms)) for k, ms in pairs] for name, pairs in entry.items()
            if isinstance(pairs, list) and pairs}


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
