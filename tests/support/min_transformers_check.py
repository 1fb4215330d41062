"""The tiny paths that hand a KV cache to transformers, run under whatever transformers is on
the path (``tests/test_min_transformers.py`` runs it under the oldest supported release, the GPU
machine's). Prints one JSON object.

Each drafter's every drafted token must equal the argmax of a full forward over the committed
sequence and the drafts before it, without a cache: a cache the forward ignored (transformers
5.17 silently drops an unknown ``cache=`` keyword) fails that, or cropping it fails outright.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
import transformers

from shared.engines.transformers.drafter import HFDrafter, HFSeq2SeqDrafter
from shared.engines.transformers.timing import plain_step_ms
from shared.protocol.sampling import SamplingConfig
from tests.support.tiny_models import build_model, build_seq2seq


def full_argmax(model: torch.nn.Module, ids: list[int], source: list[int] | None) -> int:
    with torch.inference_mode():
        if source is None:
            logits = model(input_ids=torch.tensor([ids])).logits
        else:
            logits = model(input_ids=torch.tensor([source]),
                           decoder_input_ids=torch.tensor([ids])).logits
    return int(logits[0, -1].argmax())


def check(drafter: HFDrafter, prompt: list[int], source: list[int] | None) -> dict[str, object]:
    """Three greedy blocks with a partial acceptance between them; drafts vs full forwards."""
    drafter.reset(prompt, source)
    committed, mismatches, drafted = list(prompt), 0, 0
    for accept in (2, 0, 4):
        draft = drafter.propose(4, SamplingConfig(), torch.Generator().manual_seed(0))
        for i, token in enumerate(draft.ids):
            drafted += 1
            mismatches += token != full_argmax(drafter.model, committed + draft.ids[:i], source)
        # accept a prefix, then a token the drafter did not propose (a recovered token)
        taken = [*draft.ids[:accept], (draft.ids[accept] + 1) % 64 if accept < 4 else 5]
        drafter.commit(taken)
        committed += taken
    return {"drafted": drafted, "mismatches": mismatches}


def main() -> None:
    causal = build_model("llama", 64, seed=3, init_range=0.3).eval()
    seq2seq = build_seq2seq("t5", 64, seed=13, init_std=10.0).eval()
    result = {
        "transformers": transformers.__version__,
        "causal": check(HFDrafter(causal, 64), [2, 3, 4, 5], None),
        "seq2seq": check(HFSeq2SeqDrafter(seq2seq, 64), [0], [7, 8, 9, 10, 1]),
        "plain_step_ms": plain_step_ms(causal, list(range(2, 30)), 4, repeats=2),
    }
    with tempfile.TemporaryDirectory() as folder:  # save and load, as the fixtures do
        causal.save_pretrained(Path(folder))
        result["reloaded"] = type(transformers.AutoModelForCausalLM.from_pretrained(
            folder)).__name__
    print(json.dumps(result))


if __name__ == "__main__":
    main()
