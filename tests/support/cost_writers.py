"""Writers of the verify-cost cache for tests/test_cost_files.py, in a module of their own: the
test's writer processes import this and what the cache needs, not the test's own imports
(transformers, the verifier, pytest: seconds of CPU per process)."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

from shared.engines.target import BatchForward


class Timed(BatchForward):
    """Only what ``measured_verify_ms`` uses: a context and an instant 'sweep'."""

    def __init__(self) -> None:
        self.info = SimpleNamespace(max_context=64)  # type: ignore[assignment]

    def time_verify_blocks(self, slot: int, ids: list[int], ks: Any = ()) -> list[Any]:
        return [(k, 1.5 + k) for k in ks]


def write_records(prefix: str, threads: int, each: int) -> None:
    """``threads`` threads, each recording ``each`` verify costs under keys of its own."""
    def one(t: int) -> None:
        for r in range(each):
            Timed().measured_verify_ms(0, [1] * 16, f"{prefix}-t{t}-r{r}")

    workers = [threading.Thread(target=one, args=(t,)) for t in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
