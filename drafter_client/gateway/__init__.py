"""``specdec serve``: the OpenAI-compatible gateway in front of a verifier.

``app`` (routes and error shapes), ``engine`` (admission, generation on worker threads,
streaming), ``schema`` (OpenAI's request models), ``metrics`` (Prometheus).
"""

from drafter_client.gateway.app import create_gateway, server_options
from drafter_client.gateway.engine import GatewaySettings

__all__ = ["GatewaySettings", "create_gateway", "server_options"]
