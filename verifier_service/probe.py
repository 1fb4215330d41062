"""``specdec-probe [URL]``: exit 0 when URL answers 2xx within 3 s, else 1 (a container
healthcheck). The default URL is the verifier's readiness probe on this host:
``http://127.0.0.1:$SPECDEC_PORT/readyz``.

A single word on purpose: some engines (Podman 4's Docker API) split a ``CMD`` healthcheck's
arguments on spaces, which breaks ``python -c "..."`` probes."""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    url = args[0] if args else f"http://127.0.0.1:{os.environ.get('SPECDEC_PORT', '8000')}/readyz"
    key = os.environ.get("SPECDEC_PROBE_KEY")  # for a probe path behind an API key
    request = urllib.request.Request(url, headers={"authorization": f"Bearer {key}"}
                                     if key else {})
    try:
        with urllib.request.urlopen(request, timeout=3) as response:  # noqa: S310 - our URL
            ok = 200 <= response.status < 300
    except (urllib.error.URLError, OSError) as exc:
        print(f"specdec-probe: {url}: {exc}", file=sys.stderr)
        return 1
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
