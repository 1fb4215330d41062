"""`specdec-verifier`: serve a target model for speculative decoding clients.

Every option is a field of :class:`verifier_service.settings.Settings`: a flag here, a
``SPECDEC_*`` variable in the environment (flags win).
"""

from __future__ import annotations

import logging
import signal
import sys

import torch
import uvicorn
from pydantic import ValidationError

from shared.engines import preflight
from shared.engines import serve as serve_on_engine
from shared.engines.target import Engine
from shared.models.catalog import ModelSpecError
from verifier_service.app import create_app, server_options
from verifier_service.settings import Settings, SettingsError, check_against_model, load_engine
from verifier_service.state import ModelThread


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
            where = ""
            if err["loc"]:
                name = str(err["loc"][0])
                where = f"--{name.replace('_', '-')} (SPECDEC_{name.upper()}): "
            print(f"specdec-verifier: {where}{err['msg']}", file=sys.stderr)
        raise SystemExit(2) from None


def load_target(settings: Settings) -> Engine:
    """Load the target and check the settings against it; a problem is one line, exit 2."""
    if settings.threads:
        torch.set_num_threads(settings.threads)
    try:
        engine = load_engine(settings)
        check_against_model(settings, engine.info.max_context, engine.info.model_limit)
    except (SettingsError, ModelSpecError) as exc:
        print(f"specdec-verifier: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    return engine


def main(argv: list[str] | None = None) -> None:
    settings = parse_settings(argv)
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        preflight(settings.engine_options())  # e.g. tensor parallel outside torchrun
    except ModelSpecError as exc:
        print(f"specdec-verifier: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    # Loaded before listening (a bad setting never serves a request), on the thread that will
    # run every forward (ModelThread says why one thread).
    model_thread = ModelThread()
    engine = model_thread.call(load_target, settings)
    # the engine's process hook runs the server (tensor parallel: rank 0 serves, the others
    # follow its model operations)
    serve_on_engine(engine, lambda: serve(settings, engine, model_thread), model_thread.call)


def serve(settings: Settings, engine: Engine, model_thread: ModelThread) -> None:
    if settings.key_list():
        logging.getLogger(__name__).info("API keys required (%d configured)",
                                         len(settings.key_list()))
    # uvicorn on SIGTERM / SIGINT: stops accepting connections, lets requests in flight finish
    # (up to the grace period), then runs the app's shutdown. It then re-raises the signal to
    # whatever handler was there before it; these no-op handlers make a drained shutdown exit 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    uvicorn.run(create_app(settings, engine, model_thread), host=settings.host, port=settings.port,
                log_level="warning", **server_options(settings))


if __name__ == "__main__":
    main()
