"""`make demo`'s result line: the median of its side-by-side pairs, and the greedy check."""

from __future__ import annotations

import argparse
from types import SimpleNamespace
from typing import Any

import pytest

from scripts.demo import positive, summary


def result(tokens_per_s: float, token_ids: list[int]) -> Any:
    metrics = {"tokens_per_s": tokens_per_s, "new_tokens": len(token_ids),
               "acceptance_rate": 0.5, "verify_calls": 3}
    return SimpleNamespace(token_ids=token_ids, metrics=SimpleNamespace(to_dict=lambda: metrics))


def test_the_result_is_the_median_pair_and_the_first_difference() -> None:
    same = [1, 2, 3]
    pairs = [(result(12.0, same), result(10.0, same)),  # 1.20x
             (result(9.0, same), result(10.0, same)),  # 0.90x
             (result(10.5, same), result(10.0, same))]  # 1.05x: the median
    line = summary(pairs)
    assert line.startswith("speedup: 1.05x (median of 3 pairs: 0.90-1.20x)")
    assert line.endswith("greedy outputs identical")
    differs = summary([(result(10.0, [1, 2, 4]), result(10.0, same))])
    assert differs.startswith("speedup: 1.00x;") and "differ from token 2" in differs


@pytest.mark.parametrize("text", ["0", "-1", "two", ""])
def test_rounds_must_be_a_whole_number_of_at_least_one(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        positive(text)
    assert positive("3") == 3
