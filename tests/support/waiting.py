"""Waiting in tests: on the condition itself, never on a guessed length of time."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(condition: Callable[[], T], timeout_s: float = 30.0, interval_s: float = 0.02,
               what: str = "the condition", ignoring: tuple[type[BaseException], ...] = ()
               ) -> T:
    """``condition()`` until it returns something true, which is returned; TimeoutError naming
    ``what`` (and the last value) after ``timeout_s``. Exceptions of the ``ignoring`` types count
    as "not yet" (a server still starting refuses connections). The condition is checked once
    more at the deadline, so a slow machine fails only when the condition really did not hold."""
    deadline = time.monotonic() + timeout_s
    while True:
        last_try = time.monotonic() >= deadline
        outcome: object
        try:
            outcome = value = condition()
        except ignoring as exc:
            outcome = exc
        else:
            if value:
                return value
        if last_try:
            raise TimeoutError(f"{what} did not hold within {timeout_s:g} s (last: {outcome!r})")
        time.sleep(interval_s)  # the poll interval, not a wait for anything in particular
