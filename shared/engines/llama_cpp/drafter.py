"""A model drafter on llama.cpp (a GGUF file)."""

from __future__ import annotations

from typing import Any

import torch

from shared.engines.drafter import LMDrafter, align_vocab
from shared.engines.llama_cpp.runtime import LlamaModel, Segment


class LlamaCppDrafter(LMDrafter):
    """A GGUF drafter on llama.cpp: one sequence in its own context (the weights may be shared
    with other drafters' contexts); rollback drops the sequence's positions."""

    def __init__(self, weights: Any, vocab_size: int, seq_tokens: int, threads: int = 0,
                 name: str = "llama-cpp", min_prob: float = 0.0, tree_width: int = 1,
                 alternative_min_prob: float = 0.05) -> None:
        super().__init__(vocab_size, name, min_prob, tree_width, alternative_min_prob)
        self.lm = LlamaModel(weights, n_seqs=1, seq_tokens=seq_tokens, threads=threads,
                             batch_tokens=512)
        self.context_tokens = self.lm.seq_tokens  # at most the model's trained context

    def _forward(self, ids: list[int]) -> torch.Tensor:
        if not ids:
            return self.last_logits
        if len(self.cached) + len(ids) > self.lm.seq_tokens:
            raise ValueError(f"the drafter's context holds {self.lm.seq_tokens} tokens; this "
                             f"sequence needs {len(self.cached) + len(ids)}")
        [rows] = self.lm.decode([Segment(0, len(self.cached), ids, len(ids) - 1)])
        assert rows is not None
        self.cached.extend(ids)
        self.last_logits = align_vocab(torch.from_numpy(rows[-1]), self.vocab_size)
        return self.last_logits  # [vocab]

    def _roll_back(self, keep: int) -> None:
        self.lm.remove(0, keep)
