"""`specdec-verifier`: serve a target model for speculative decoding clients."""

from __future__ import annotations

import argparse
import logging
import signal

import uvicorn

from verifier_service.app import create_app
from verifier_service.settings import Settings


def parse_settings(argv: list[str] | None = None) -> Settings:
    defaults = Settings()  # environment variables (SPECDEC_*) first, flags override them
    p = argparse.ArgumentParser(prog="specdec-verifier", description=__doc__)
    p.add_argument("--model", default=defaults.model,
                   help="short name (qwen2.5-coder-1.5b), local folder, .gguf file or hub id")
    p.add_argument("--dtype", default=defaults.dtype,
                   choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default=defaults.device, help="auto, cpu, cuda or cuda:N")
    p.add_argument("--threads", type=int, default=defaults.threads,
                   help="torch CPU threads (0: torch default)")
    p.add_argument("--host", default=defaults.host)
    p.add_argument("--port", type=int, default=defaults.port)
    p.add_argument("--max-sessions", type=int, default=defaults.max_sessions)
    p.add_argument("--session-ttl-s", type=float, default=defaults.session_ttl_s)
    p.add_argument("--max-draft-tokens", type=int, default=defaults.max_draft_tokens)
    p.add_argument("--max-context", type=int, default=defaults.max_context,
                   help="0: the model's own limit")
    p.add_argument("--max-new-tokens", type=int, default=defaults.max_new_tokens,
                   help="cap for /v1/generate")
    p.add_argument("--kv-budget-tokens", type=int, default=defaults.kv_budget_tokens,
                   help="KV pool size in tokens (slots = budget // max context)")
    p.add_argument("--no-batching", dest="batching", action="store_false",
                   default=defaults.batching, help="one session per forward (for comparison)")
    p.add_argument("--max-batch-size", type=int, default=defaults.max_batch_size)
    p.add_argument("--max-batch-tokens", type=int, default=defaults.max_batch_tokens)
    p.add_argument("--batch-wait-ms", type=float, default=defaults.batch_wait_ms)
    p.add_argument("--max-queue", type=int, default=defaults.max_queue,
                   help="queued calls beyond which the verifier answers 429")
    p.add_argument("--replica-name", default=defaults.replica_name,
                   help="name sent in the X-Verifier-Replica header (default host:port)")
    p.add_argument("--max-sessions-per-key", type=int, default=defaults.max_sessions_per_key,
                   help="open sessions one API key may hold (0: no per-key limit)")
    p.add_argument("--max-body-bytes", type=int, default=defaults.max_body_bytes)
    p.add_argument("--shutdown-grace-s", type=float, default=defaults.shutdown_grace_s,
                   help="on SIGTERM, how long calls in flight may take to finish")
    args = p.parse_args(argv)
    # API keys come only from the environment (SPECDEC_API_KEYS): a flag would show them in ps.
    return Settings(**{k: v for k, v in vars(args).items()}, api_keys=defaults.api_keys)


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
