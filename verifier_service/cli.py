"""`specdec-verifier`: serve a target model for speculative decoding clients.

Every option is a field of :class:`verifier_service.settings.Settings`: a flag here, a
``SPECDEC_*`` variable in the environment (flags win).
"""

from __future__ import annotations

import logging
import signal
import sys

import uvicorn
from pydantic import ValidationError

from verifier_service.app import create_app
from verifier_service.settings import Settings


def parse_settings(argv: list[str] | None = None) -> Settings:
    args = sys.argv[1:] if argv is None else argv
    if any(a == "--api-keys" or a.startswith("--api-keys=") for a in args):
        # Hidden from --help, and refused: a flag would show the keys in `ps`.
        print("specdec-verifier: API keys come from the environment only (SPECDEC_API_KEYS)",
              file=sys.stderr)
        raise SystemExit(2)
    try:
        return Settings(_cli_parse_args=args)
    except ValidationError as exc:  # one line per bad value, naming the flag
        for err in exc.errors():
            name = str(err["loc"][0]) if err["loc"] else "?"
            print(f"specdec-verifier: --{name.replace('_', '-')} (SPECDEC_{name.upper()}): "
                  f"{err['msg']}", file=sys.stderr)
        raise SystemExit(2) from None


def main(argv: list[str] | None = None) -> None:
    settings = parse_settings(argv)
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if settings.key_list():
        logging.getLogger(__name__).info("API keys required (%d configured)",
                                         len(settings.key_list()))
    # uvicorn on SIGTERM / SIGINT: stops accepting connections, lets requests in flight finish
    # (up to the grace period), then runs the app's shutdown. It then re-raises the signal to
    # whatever handler was there before it; these no-op handlers make a drained shutdown exit 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port,
                log_level="warning",
                timeout_graceful_shutdown=max(1, round(settings.shutdown_grace_s)))


if __name__ == "__main__":
    main()
