"""The suite's own order (tests/support/ordering.py): nothing lost, modules kept together, the
slow modules at the start of the workers' shares."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tests.support.ordering import worker_order


@dataclass(frozen=True)
class _Item:
    path: Path
    name: str
    slow: bool = False

    def get_closest_marker(self, name: str) -> object | None:
        return object() if name == "slow" and self.slow else None


def _suite(spec: dict[str, tuple[int, int]]) -> list[_Item]:
    """{module: (quick tests, slow tests)} as items, quick ones first as collected."""
    items = []
    for module, (quick, slow) in spec.items():
        items += [_Item(Path(module), f"{module}::q{i}") for i in range(quick)]
        items += [_Item(Path(module), f"{module}::s{i}", slow=True) for i in range(slow)]
    return items


def _shares(order: list[_Item], workers: int) -> list[list[_Item]]:
    """What worksteal hands each worker first: contiguous shares of the collection."""
    return [order[len(order) * w // workers:len(order) * (w + 1) // workers]
            for w in range(workers)]


def test_every_test_kept_once_and_modules_together() -> None:
    items = _suite({"a": (5, 0), "b": (2, 3), "c": (8, 0), "d": (1, 1), "e": (4, 2)})
    order = worker_order(items, 2)  # type: ignore[arg-type]
    assert sorted(i.name for i in order) == sorted(i.name for i in items)
    runs = [i.path for n, i in enumerate(order) if n == 0 or order[n - 1].path != i.path]
    assert len(runs) == len(set(runs)), runs  # each module in one contiguous run


def test_slow_modules_lead_the_workers_shares() -> None:
    spec = {f"q{n}": (2, 0) for n in range(5)} | {"slow_a": (1, 4)}
    spec |= {f"q{n}": (2, 0) for n in range(5, 10)} | {"slow_b": (2, 3)}
    items = _suite(spec)
    order = worker_order(items, 2)  # type: ignore[arg-type]
    first = [share[0] for share in _shares(order, 2)]
    assert {i.path.name for i in first} == {"slow_a", "slow_b"}
    assert all(i.slow for i in first)  # a module's slow tests before its quick ones
    # the control: collection order leaves a share without a slow module at its start
    assert not all(share[0].slow for share in _shares(items, 2))


def test_one_worker_runs_slow_modules_first() -> None:
    items = _suite({"q": (3, 0), "s": (2, 1)})
    order = worker_order(items, 1)  # type: ignore[arg-type]
    assert order[0].slow and order[0].path.name == "s"
    assert [i.path.name for i in order[-3:]] == ["q", "q", "q"]
