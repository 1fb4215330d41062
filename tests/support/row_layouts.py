"""A decoder's rows computed in different layouts, for the CPU engines' exactness tests: a
prompt and greedy continuation token by token (the reference), then the same rows in verify
blocks of k, and beside another session's rows. Any decoder with ``forward(Rows, keep)``
(``Int8Decoder``, ``W4A8Decoder``) and at least 4 slots of 256 tokens over a 256-token vocabulary.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from shared.engines.int8.model import Rows

PROMPT = [5, 17, 33, 2, 90, 41, 7, 250, 12, 64, 3, 128]
OTHER = [int(t) for t in np.random.default_rng(3).integers(2, 256, 37)]
NEW = 24


def rows_of(model: Any, segments: list[tuple[int, int, list[int]]],
            keep: list[int]) -> torch.Tensor:
    """One forward over ``(slot, start, tokens)`` segments; the logits of rows ``keep``."""
    ids, slots, positions = [], [], []
    for slot, start, tokens in segments:
        ids += tokens
        slots += [slot] * len(tokens)
        positions += range(start, start + len(tokens))
    return model.forward(Rows(torch.tensor(ids), slots, positions), torch.tensor(keep))


def one_token_steps(model: Any, slot: int) -> tuple[list[int], torch.Tensor]:
    """Greedy decoding a token per forward (the prompt too): the tokens and every row."""
    kept = [rows_of(model, [(slot, i, [t])], [0])[0] for i, t in enumerate(PROMPT)][-1:]
    out: list[int] = []
    for i in range(NEW):
        out.append(int(kept[-1].argmax()))
        kept.append(rows_of(model, [(slot, len(PROMPT) + i, out[-1:])], [0])[0])
    return out, torch.stack(kept)


def in_blocks(model: Any, slot: int, tokens: list[int], k: int,
              beside: int | None = None) -> torch.Tensor:
    """The prompt whole, then ``tokens`` ``k`` at a time; ``beside``: another slot writes 3
    tokens in each of the same forwards, first."""
    kept = [rows_of(model, [(slot, 0, PROMPT)], [len(PROMPT) - 1])[0]]
    other_at = len(OTHER)
    for at in range(0, NEW, k):
        block = tokens[at:at + k]
        segments = [(slot, len(PROMPT) + at, block)]
        shift = 0
        if beside is not None:
            segments.insert(0, (beside, other_at, [3, 4, 5]))
            other_at, shift = other_at + 3, 3
        kept.extend(rows_of(model, segments, list(range(shift, shift + len(block)))))
    return torch.stack(kept[:NEW + 1])


def block_layouts(model: Any) -> dict[str, bool]:
    """For k = 2, 4, 8, 16 and beside another session: whether every row equals the
    one-token steps' bit for bit."""
    tokens, reference = one_token_steps(model, 0)
    same = {f"k={k}": torch.equal(in_blocks(model, 1, tokens, k), reference)
            for k in (2, 4, 8, 16)}
    rows_of(model, [(2, 0, OTHER)], [0])  # another session's history
    same["beside another session"] = torch.equal(in_blocks(model, 3, tokens, 5, beside=2),
                                                 reference)
    return same
