"""An HTTP/1.1 proxy that injects faults between the drafter client and the verifier.

  * ``delay_ms``: hold every response this long before sending it (a one-way delay on the path
    back to the client, like ``tc netem delay`` on the verifier's interface);
  * ``drop_responses``: for these 1-based numbers of matching requests, let the verifier answer,
    then close the client's connection without sending the answer (a response lost on the way);
  * ``die_after``: after this many matching requests, stop: close every connection and refuse
    new ones (a verifier that is gone for good).

Used by the fault-injection tests, and as the delay stage of the network tests where the kernel
has no netem. Run standalone:

  python -m tests.support.fault_proxy --listen 127.0.0.1:9000 --upstream http://127.0.0.1:8000 \
      --delay-ms 20
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import threading
from collections.abc import Iterable

import httpx

HOP_BY_HOP = {b"connection", b"keep-alive", b"transfer-encoding", b"content-length",
              b"proxy-connection", b"upgrade", b"te", b"trailer"}


class FaultProxy:
    def __init__(self, upstream: str, host: str = "127.0.0.1", port: int = 0,
                 delay_ms: float = 0.0, match: str = "/verify",
                 drop_responses: Iterable[int] = (), die_after: int | None = None) -> None:
        self.upstream, self.host, self.port = upstream.rstrip("/"), host, port
        self.delay_s, self.match = delay_ms / 1e3, match
        self.drop_responses, self.die_after = set(drop_responses), die_after
        self.matched = 0  # requests whose path contains ``match``
        self.dropped = 0
        self._server: asyncio.base_events.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # -- one connection ---------------------------------------------------------------------
    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            async with httpx.AsyncClient(base_url=self.upstream, timeout=300) as upstream:
                while await self._one_request(reader, writer, upstream):
                    pass
        except (ConnectionError, asyncio.IncompleteReadError, httpx.TransportError):
            pass
        finally:
            self._writers.discard(writer)
            with contextlib.suppress(Exception):
                writer.close()

    async def _one_request(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                           upstream: httpx.AsyncClient) -> bool:
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        method, path, _ = lines[0].split(" ", 2)
        headers = [tuple(line.split(":", 1)) for line in lines[1:] if ":" in line]
        length = next((int(v) for k, v in headers if k.strip().lower() == "content-length"), 0)
        body = await reader.readexactly(length) if length else b""
        number = 0
        if self.match in path:
            self.matched += 1
            number = self.matched
        if self.die_after is not None and number > self.die_after:
            self.stop_serving()
            return False
        forward = {k.strip(): v.strip() for k, v in headers
                   if k.strip().lower().encode() not in HOP_BY_HOP | {b"host"}}
        response = await upstream.request(method, path, content=body, headers=forward)
        if number in self.drop_responses:  # the verifier answered; the client never hears it
            self.dropped += 1
            writer.transport.abort()
            return False
        if self.delay_s:  # a slow network, on purpose: the fault this proxy injects
            await asyncio.sleep(self.delay_s)
        out = [f"HTTP/1.1 {response.status_code} {response.reason_phrase}".encode()]
        out += [k + b": " + v for k, v in response.headers.raw if k.lower() not in HOP_BY_HOP]
        out += [b"content-length: " + str(len(response.content)).encode(),
                b"connection: keep-alive"]
        writer.write(b"\r\n".join(out) + b"\r\n\r\n" + response.content)
        await writer.drain()
        return True

    # -- lifecycle --------------------------------------------------------------------------
    async def _serve(self) -> None:
        self._server = await asyncio.start_server(self._handle, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        await self._server.serve_forever()

    def stop_serving(self) -> None:
        """Refuse new connections and cut the open ones (called on the proxy's loop)."""
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.transport.abort()

    def start(self) -> FaultProxy:
        def run() -> None:
            self._loop = asyncio.new_event_loop()
            with contextlib.suppress(asyncio.CancelledError):
                self._loop.run_until_complete(self._serve())

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the fault proxy did not start")
        return self

    def close(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.stop_serving)
            for task in asyncio.all_tasks(self._loop):
                self._loop.call_soon_threadsafe(task.cancel)
        if self._thread is not None:
            self._thread.join(timeout=10)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--listen", default="127.0.0.1:9000", help="host:port")
    parser.add_argument("--upstream", required=True, help="the verifier's URL")
    parser.add_argument("--delay-ms", type=float, default=0.0)
    args = parser.parse_args()
    host, port = args.listen.rsplit(":", 1)
    proxy = FaultProxy(args.upstream, host, int(port), args.delay_ms)
    print(f"fault proxy on {host}:{port} -> {args.upstream}, delay {args.delay_ms:g} ms",
          flush=True)
    asyncio.run(proxy._serve())


if __name__ == "__main__":
    main()
