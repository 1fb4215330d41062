"""specdec drafter client: drafts next to the user, verifies on a remote target.

The names below load on first use (PEP 562), so importing a light part of the package (its
settings, the command line's parser) does not import torch and transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from drafter_client.api import SpecDecClient
    from drafter_client.drafters import Draft, Drafter, HFDrafter
    from drafter_client.settings import ClientSettings, DrafterOptions, Sampling
    from drafter_client.speculative import GenerationResult, speculative_generate
    from drafter_client.transport import HttpVerifier, SpecDecError

_WHERE = {
    "SpecDecClient": "api", "Draft": "drafters", "Drafter": "drafters", "HFDrafter": "drafters",
    "ClientSettings": "settings", "DrafterOptions": "settings", "Sampling": "settings",
    "GenerationResult": "speculative", "speculative_generate": "speculative",
    "HttpVerifier": "transport", "SpecDecError": "transport",
}

__all__ = ["ClientSettings", "Draft", "Drafter", "DrafterOptions", "GenerationResult", "HFDrafter",
           "HttpVerifier", "Sampling", "SpecDecClient", "SpecDecError", "speculative_generate"]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'drafter_client' has no attribute {name!r}")
    return getattr(importlib.import_module(f"drafter_client.{_WHERE[name]}"), name)
