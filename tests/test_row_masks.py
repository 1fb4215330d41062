"""Row masks on the wire (structured output): each row in the shortest of three forms (allowed
ids, forbidden ids, the vocabulary's bitmask), decoded to the same rows, refused in one line
where they are not masks; and a 16-draft block on a 151,936-id vocabulary (Qwen2.5's) under a
free-text pattern fits the verifier's body limit, which the ids alone did not (the control)."""

from __future__ import annotations

import base64

import numpy as np
import orjson
import pytest

from shared.http.limits import HTTP_LIMITS
from shared.protocol.schema import RowMask, VerifyRequest

VOCAB = 151_936
FREE_TEXT = 41_762  # ids `^[a-z ]+$` allows a row on Qwen2.5's vocabulary


def random_mask(allowed: int, seed: int) -> np.ndarray:
    keep = np.zeros(VOCAB, dtype=bool)
    keep[np.random.default_rng(seed).choice(VOCAB, allowed, replace=False)] = True
    return keep


@pytest.mark.parametrize(("allowed", "form"), [(1, "allowed"), (4_000, "allowed"),
                                               (FREE_TEXT, "bits"), (VOCAB - 4_000, "forbidden"),
                                               (VOCAB, "forbidden")])
def test_each_mask_takes_its_shortest_form_and_decodes_to_itself(allowed: int, form: str) -> None:
    keep = random_mask(allowed, seed=allowed)
    mask = RowMask.of(keep)
    assert [name for name, value in mask.model_dump().items() if value is not None] == [form]
    assert np.array_equal(mask.keep(VOCAB).numpy(), keep)
    assert len(orjson.dumps(mask.model_dump())) <= 4 * ((VOCAB + 7) // 8 + 2) // 3 + 64


def test_a_16_draft_block_on_a_real_vocabulary_fits_the_body_limit() -> None:
    masks = [RowMask.of(random_mask(FREE_TEXT, seed)) for seed in range(17)]
    body = VerifyRequest(position=100, last_token=1, draft_ids=list(range(16)),
                         log_uniforms=[-1.0] * 16, final_uniform=0.5, masks=masks)
    size = len(orjson.dumps(body.model_dump()))
    assert size < HTTP_LIMITS.max_body_bytes / 2
    # control: the same rows as id lists, the earlier wire form, are over the limit
    as_ids = [RowMask(allowed=base64.b64encode(np.flatnonzero(m.keep(VOCAB).numpy())
                                               .astype("<i4").tobytes()).decode())
              for m in masks]
    assert len(orjson.dumps(body.model_copy(update={"masks": as_ids}).model_dump())) \
        > HTTP_LIMITS.max_body_bytes


def bits_of(keep: np.ndarray) -> str:
    return base64.b64encode(np.packbits(keep, bitorder="little").tobytes()).decode()


@pytest.mark.parametrize(("mask", "message"), [
    (RowMask(), "exactly one of"),
    (RowMask(allowed="AAAAAA==", bits="AA=="), "exactly one of"),
    (RowMask(bits="not base64!"), "not base64"),
    (RowMask(bits=bits_of(np.ones(VOCAB - 8, dtype=bool))), "bytes; a vocabulary"),
    (RowMask(bits=bits_of(np.zeros(VOCAB, dtype=bool))), "allows no token"),
    (RowMask(allowed=base64.b64encode(b"\x01\x00\x00").decode()), "whole int32"),
    (RowMask(allowed=base64.b64encode(np.array([VOCAB], "<i4").tobytes()).decode()),
     "outside"),
    (RowMask(forbidden=base64.b64encode(np.array([-1], "<i4").tobytes()).decode()), "outside"),
])
def test_what_is_not_a_mask_is_refused_in_one_line(mask: RowMask, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        mask.keep(VOCAB)


def test_bits_past_the_vocabulary_are_refused() -> None:
    mask = RowMask(bits=bits_of(np.ones(VOCAB, dtype=bool)))  # 18,992 bytes: also 151,933 ids'
    assert mask.keep(VOCAB).all()
    with pytest.raises(ValueError, match="past the vocabulary"):
        mask.keep(VOCAB - 3)
