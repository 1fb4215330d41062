"""specdec drafter client: drafts next to the user, verifies on a remote target.

The names below load on first use (PEP 562), so importing a light part of the package (its
settings, the command line's parser) does not import torch and transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from drafter_client.api import SpecDecClient
    from drafter_client.settings import ClientSettings, DrafterOptions, Sampling
    from drafter_client.speculative import GenerationResult, speculative_generate
    from drafter_client.transport import HttpVerifier, SpecDecError
    from shared.engines.drafter import Draft, Drafter

_WHERE = {
    "SpecDecClient": "drafter_client.api", "Draft": "shared.engines.drafter",
    "Drafter": "shared.engines.drafter",
    "ClientSettings": "drafter_client.settings", "DrafterOptions": "drafter_client.settings",
    "Sampling": "drafter_client.settings", "GenerationResult": "drafter_client.speculative",
    "speculative_generate": "drafter_client.speculative",
    "HttpVerifier": "drafter_client.transport", "SpecDecError": "drafter_client.transport",
}

__all__ = ["ClientSettings", "Draft", "Drafter", "DrafterOptions", "GenerationResult",
           "HttpVerifier", "Sampling", "SpecDecClient", "SpecDecError", "speculative_generate"]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'drafter_client' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
