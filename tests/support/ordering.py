"""The suite's order: the longest work first on every worker, the run ending on short tests.

pytest-xdist's ``worksteal`` hands worker i the i-th contiguous share of the collection, and an
idle worker takes the second half of the longest queue left; so what runs last is whatever ends
each share. A minute-long test there leaves a core idle while one worker finishes it alone.
``worker_order`` keeps each module's tests together (its fixtures are set up once per worker),
puts a module's ``slow`` tests first, spreads the modules that have slow tests over the
workers' shares (most slow tests first, each to the share with the fewest so far) at the start
of each share, and fills every share up to its boundary with the quick modules (a share may end
a few quick tests off its boundary: modules are not split).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest


def worker_order(items: list[pytest.Item], workers: int) -> list[pytest.Item]:
    modules: dict[Path, list[pytest.Item]] = {}
    for item in items:
        modules.setdefault(item.path, []).append(item)
    slow = Counter(item.path for item in items if item.get_closest_marker("slow"))
    for tests in modules.values():
        tests.sort(key=lambda item: not item.get_closest_marker("slow"))  # stable
    shares: list[list[Path]] = [[] for _ in range(max(1, workers))]
    weight = [0] * len(shares)
    for path in sorted((p for p in modules if slow[p]), key=lambda p: -slow[p]):
        lightest = weight.index(min(weight))
        shares[lightest].append(path)
        weight[lightest] += slow[path]
    sizes = [sum(len(modules[p]) for p in share) for share in shares]
    lane, before = 0, 0  # before: the tests in the shares ahead of `lane`
    for path in (p for p in modules if not slow[p]):
        # fill this share up to its boundary (modules are not split: the module goes where the
        # share ends nearer its boundary), so that each share starts on its slow modules
        while lane < len(shares) - 1:
            boundary = len(items) * (lane + 1) // len(shares)
            end = before + sizes[lane]
            if abs(end + len(modules[path]) - boundary) < abs(end - boundary):
                break
            before += sizes[lane]
            lane += 1
        shares[lane].append(path)
        sizes[lane] += len(modules[path])
    return [item for share in shares for path in share for item in modules[path]]
