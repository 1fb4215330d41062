"""Rolling back a transformers KV cache to a prefix: the model drafter's cache, and the
decoder caches of an encoder-decoder target (a causal target's KV lives in the verifier's slot
pool and rolls back by moving a length: ``shared/kv_pool.py``)."""

from __future__ import annotations

from typing import Any


def cache_length(cache: Any) -> int:
    return int(cache.get_seq_length()) if cache is not None else 0


def crop_cache(cache: Any, keep: int) -> None:
    """Keep the first ``keep`` positions. transformers 5.x: ``crop`` takes a negative count."""
    drop = cache_length(cache) - keep
    if drop < 0:
        raise ValueError(f"cannot crop a cache of {cache_length(cache)} tokens to {keep}")
    if drop > 0:
        cache.crop(-drop)
