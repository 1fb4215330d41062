"""specdec drafter client: drafts next to the user, verifies on a remote target."""

from drafter_client.api import SpecDecClient
from drafter_client.drafters import Draft, Drafter, HFDrafter
from drafter_client.speculative import GenerationResult, speculative_generate
from drafter_client.transport import HttpVerifier, SpecDecError

__all__ = ["Draft", "Drafter", "GenerationResult", "HFDrafter", "HttpVerifier", "SpecDecClient",
           "SpecDecError", "speculative_generate"]
