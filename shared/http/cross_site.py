"""What keeps a web page from driving a server on this machine: ``specdec serve`` is closed by
default. (Here, not in the gateway's package, so the command line checks the flags without
loading the gateway.)

A page on any site can make the browser send a "simple" request - a ``text/plain``, form or
multipart body, or one with no Content-Type - to ``http://127.0.0.1:8080`` without asking first,
and a page whose name it rebinds to 127.0.0.1 (DNS rebinding) can even read the answers. So:

* a POST body must be ``application/json`` (UTF-8): anything else gets 415 before it is parsed
  (a JSON body from another origin needs a CORS preflight, which the gateway does not grant);
* the ``Host`` a request names must be one this gateway answers to (:class:`HostPolicy`), or
  421: a rebound name is refused whatever the page does;
* CORS headers only for the origins configured (``--cors-origins``); none by default.

The playground at ``/`` is the gateway's own origin and needs none of these opened.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from starlette.responses import Response

# Names of the loopback interface a browser on this machine may use in Host.
LOOPBACK_NAMES = frozenset({"127.0.0.1", "localhost", "[::1]"})
# Bind addresses that listen on every interface: then any Host, unless an allow-list is set.
WILDCARD_BINDS = frozenset({"0.0.0.0", "[::]", ""})
# A host name or IPv4 address, or an IPv6 address in brackets, then an optional port.
_HOST = re.compile(r"^(?P<name>\[[0-9a-f:.]+\]|[a-z0-9_.-]+)(?::(?P<port>[0-9]{1,5}))?$")
_ORIGIN = re.compile(r"^https?://(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.-]+)(:[0-9]{1,5})?$")


def split_host(value: str) -> tuple[str, int | None] | None:
    """``Host``'s (name, port) - the name lower case, without a final dot, an IPv6 address in
    brackets - or None for a value that is no host."""
    match = _HOST.match(value.strip().lower())
    if match is None:
        return None
    name, port = match["name"], match["port"]
    if name.startswith("["):
        try:
            ipaddress.IPv6Address(name[1:-1])
        except ValueError:
            return None
    name = name.rstrip(".")
    if not name or (port is not None and int(port) > 65535):
        return None
    return name, int(port) if port is not None else None


def bind_name(host: str) -> str:
    """A bind address as it appears in Host (an IPv6 address in brackets)."""
    host = host.strip().lower()
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def check_allowed_hosts(entries: Iterable[str]) -> str | None:
    """The first entry of ``--allowed-hosts`` that is no host[:port] (nor ``*``), as one line."""
    for entry in entries:
        if entry != "*" and split_host(entry) is None:
            return (f"--allowed-hosts: {entry!r} is not a host name or address with an optional "
                    "port (e.g. gateway.example.com, 10.0.0.5:8080, [::1]); a URL is not a host")
    return None


def check_cors_origins(entries: Iterable[str]) -> str | None:
    """The first entry of ``--cors-origins`` that is no origin (nor ``*``), as one line."""
    for entry in entries:
        if entry != "*" and not _ORIGIN.match(entry):
            return (f"--cors-origins: {entry!r} is not an origin: scheme://host[:port] as a "
                    "browser sends it, e.g. https://app.example.com (no path, no final /)")
    return None


class HostPolicy:
    """Which ``Host`` values the gateway answers to.

    Always the loopback names (127.0.0.1, localhost, [::1]) on the port the request reached,
    and the bind address itself when it names one interface; bound to every interface
    (0.0.0.0, ::) any Host unless ``allowed`` is set. ``allowed`` adds entries ``name`` (any
    port) or ``name:port``; ``*`` turns the check off. A request without Host (HTTP/1.0) names
    nothing a page could have rebound, and passes."""

    def __init__(self, bind: str, allowed: Iterable[str] = ()) -> None:
        allowed = [entry.strip() for entry in allowed if entry.strip()]
        bound = bind_name(bind)
        self.open = "*" in allowed or (bound in WILDCARD_BINDS and not allowed)
        self.own = set(LOOPBACK_NAMES)
        if bound not in WILDCARD_BINDS:
            self.own.add(bound)
        self.allowed = [parsed for parsed in map(split_host, allowed if not self.open else [])
                        if parsed is not None]

    def allows(self, host: str | None, port: int, default_port: int = 80) -> bool:
        """``host``: the request's Host header; ``port``: the local port it arrived on."""
        if self.open or host is None:
            return True
        parsed = split_host(host)
        if parsed is None:
            return False
        name, asked = parsed
        asked = default_port if asked is None else asked
        if name in self.own and asked == port:
            return True
        return any(name == entry and (entry_port is None or entry_port == asked)
                   for entry, entry_port in self.allowed)

    def names(self) -> str:
        """What it answers to, for the refusal's message."""
        own = ", ".join(sorted(self.own))
        extra = ", ".join(name + (f":{port}" if port is not None else "")
                          for name, port in self.allowed)
        return own + " (on the port it listens on)" + (f", {extra}" if extra else "")


# (status, code, message) -> the gateway's error answer
Reject = Callable[[int, str, str], "Response"]


class HostCheck:
    """A pure ASGI middleware: a request whose Host the policy refuses gets 421 and nothing
    else runs (DNS rebinding protection)."""

    def __init__(self, app: Any, policy: HostPolicy, reject: Reject, port: int) -> None:
        self.app, self.policy, self.reject, self.port = app, policy, reject, port

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or self.policy.open:
            await self.app(scope, receive, send)
            return
        raw = dict(scope.get("headers", [])).get(b"host")
        host = raw.decode("latin-1") if raw is not None else None
        server = scope.get("server")
        port = server[1] if server and server[1] is not None else self.port
        default = 443 if scope.get("scheme") == "https" else 80
        if self.policy.allows(host, port, default):
            await self.app(scope, receive, send)
            return
        response = self.reject(
            421, "host_not_allowed",
            f"Host {host!r} is not a name this gateway answers to ({self.policy.names()}): "
            "a page on another site may have pointed its own name here (DNS rebinding). Serve "
            "this name deliberately with --allowed-hosts or SPECDEC_SERVE_ALLOWED_HOSTS")
        response.headers["connection"] = "close"
        await response(scope, receive, send)


def json_body_problem(content_type: str | None) -> str | None:
    """Why a POST body with this Content-Type is not taken (one line), or None for JSON in
    UTF-8: ``application/json``, with at most a ``charset=utf-8`` parameter."""
    if not content_type or not content_type.strip():
        return ("the body must be JSON sent as Content-Type: application/json; the request "
                "named no Content-Type")
    media, *params = (part.strip() for part in content_type.split(";"))
    if media.lower() != "application/json":
        return (f"the body must be JSON sent as Content-Type: application/json, not "
                f"{media!r}")
    for param in params:
        key, _, value = param.partition("=")
        if key.strip().lower() == "charset" and value.strip().strip('"').lower() not in (
                "utf-8", "utf8"):
            return (f"the body must be JSON in UTF-8; Content-Type names charset "
                    f"{value.strip()!r}")
    return None
