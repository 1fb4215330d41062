"""Rolling back a transformers KV cache to a prefix: the model drafter's cache, and the
decoder caches of an encoder-decoder target (a causal target's KV lives in the verifier's slot
pool and rolls back by moving a length: ``shared/engines/transformers/kv_pool.py``)."""

from __future__ import annotations

import functools
import inspect
from typing import Any


@functools.cache
def _cache_keyword(model_class: Any) -> str:
    parameters = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def with_cache(model: Any, cache: Any) -> dict[str, Any]:
    """The keyword arguments that hand ``cache`` to ``model``'s forward and have it filled.
    transformers 5.24 names it ``cache`` (``past_key_values`` is deprecated there); 5.17 (the
    GPU machine's) knows only ``past_key_values`` and silently ignores ``cache``, which left
    the cache empty."""
    model_class: Any = type(model)
    return {_cache_keyword(model_class): cache, "use_cache": True}


def cache_length(cache: Any) -> int:
    return int(cache.get_seq_length()) if cache is not None else 0


def crop_cache(cache: Any, keep: int) -> None:
    """Keep the first ``keep`` positions. transformers 5.x: ``crop`` takes a negative count."""
    drop = cache_length(cache) - keep
    if drop < 0:
        raise ValueError(f"cannot crop a cache of {cache_length(cache)} tokens to {keep}")
    if drop > 0:
        cache.crop(-drop)
