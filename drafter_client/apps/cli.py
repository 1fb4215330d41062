"""`specdec`: the drafter client's command line.

  specdec generate --verifier-url URL --drafter MODEL --prompt TEXT [-k 4] [--json] ...
  specdec baseline --verifier-url URL --prompt TEXT [--json] ...
  specdec serve    --verifier-url URL --drafter MODEL [--port 8080] ...  (OpenAI-compatible)
  specdec chat     --verifier-url URL --drafter MODEL ...                 (interactive console)
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import TYPE_CHECKING, Any

from drafter_client.apps.flags import add_flags, built, flag_problem, settings_rows
from drafter_client.settings import (
    DEFAULTS,
    ClientSettings,
    DrafterOptions,
    GatewaySettings,
    Sampling,
)

# Only light imports here: the parser, --help and the flag checks run before torch and
# transformers load (they take seconds); each command imports what it runs.

if TYPE_CHECKING:

    from drafter_client.api import SpecDecClient
    from drafter_client.speculative import GenerationResult

# ClientSettings' fields by the commands that take them (the nested objects: their classes)
CONNECTION = ("timeout_s", "retry_budget_s", "simulated_rtt_ms")
DRAFTING = ("num_draft_tokens", "load_aware", "dtype", "device")


def configuration_tables(settings: ClientSettings = DEFAULTS) -> str:
    """The tables of every settings flag by command, with ``settings``' values as defaults
    (docs/configuration.md holds this text: ``python -m drafter_client.apps.flags``)."""
    head = ["| flag | default | meaning |", "|---|---|---|"]
    groups = {
        "Every command (the connection)": settings_rows(settings, CONNECTION),
        "`generate`, `baseline` and `chat` (sampling)": settings_rows(settings.sampling),
        "`generate`, `serve` and `chat` (drafting)": [*settings_rows(settings, DRAFTING),
                                                     *settings_rows(settings.options)],
        "`serve` (the gateway)": settings_rows(settings.gateway),
    }
    return "\n\n".join(f"{title}:\n\n" + "\n".join(head + rows)
                       for title, rows in groups.items())


def _connection(p: argparse.ArgumentParser) -> None:
    p.add_argument("--verifier-url", required=True, help="e.g. http://127.0.0.1:8000")
    p.add_argument("--tokenizer", help="tokenizer spec (default: the drafter's, or the "
                   "verifier's model when it resolves here)")
    p.add_argument("--api-key", default=os.environ.get("SPECDEC_API_KEY"),
                   help="the verifier's API key (default: $SPECDEC_API_KEY; prefer the "
                   "variable, a flag shows in ps)")
    add_flags(p, ClientSettings, only=CONNECTION)


def _common(p: argparse.ArgumentParser) -> None:
    _connection(p)
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text")
    prompt.add_argument("--prompt-file", help="read the prompt from this file ('-' for stdin)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    add_flags(p, Sampling)
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def _drafter(p: argparse.ArgumentParser) -> None:
    p.add_argument("--drafter", required=True,
                   help="a model (short name, local folder, .gguf file, hub id), or one of "
                   "ngram, prompt-lookup, bigram")
    add_flags(p, ClientSettings, only=DRAFTING)
    add_flags(p, DrafterOptions)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="speculative decoding against a verifier")
    _common(gen)
    _drafter(gen)
    base = sub.add_parser("baseline", help="target-only generation on the verifier")
    _common(base)
    base.add_argument("--num-beams", type=int, default=1,
                      help="beam search with this many beams (greedy; as transformers' "
                      "generate(num_beams=N))")
    base.add_argument("--length-penalty", type=float, default=1.0,
                      help="beam search: score = sum of log-probs / length ** this")
    base.add_argument("--early-stopping", choices=["false", "true", "never"], default="false",
                      help="beam search: when to stop (as in transformers)")
    base.add_argument("--no-repeat-ngram-size", type=int, default=0, metavar="N",
                      help="beam search: never repeat an n-gram of this size")
    serve = sub.add_parser("serve", help="an OpenAI-compatible server (completions, chat, "
                           "streaming) that drafts here and verifies on the verifier")
    _connection(serve)
    _drafter(serve)
    add_flags(serve, GatewaySettings)
    serve.add_argument("--chat-template", metavar="FILE",
                       help="a Jinja chat template file to use instead of the tokenizer's")
    # The key itself never on the command line (it would show in ps): --serve-api-key is
    # refused (run), SPECDEC_SERVE_API_KEY or a file holds it.
    serve.add_argument("--serve-api-key-file", metavar="PATH",
                       default=os.environ.get("SPECDEC_SERVE_API_KEY_FILE"),
                       help="require the Bearer key in this file (its first line) from the "
                       "server's own clients (default: $SPECDEC_SERVE_API_KEY_FILE; or the key "
                       "in $SPECDEC_SERVE_API_KEY; neither: open)")
    chat = sub.add_parser("chat", help="an interactive console against a verifier")
    _connection(chat)
    _drafter(chat)
    add_flags(chat, Sampling)
    chat.add_argument("--system", help="a system message opening the conversation")
    chat.add_argument("--compare", action="store_true",
                      help="also run the target alone on every turn and compare")
    chat.add_argument("--no-color", action="store_true",
                      help="plain text (also when stdout is not a terminal)")
    return parser


def _read_prompt(args: argparse.Namespace) -> str:
    """The prompt from --prompt, --prompt-file or standard input; ValueError, one line naming
    the source, for a file that cannot be read or text that is not UTF-8."""
    from drafter_client.apps.output import utf8_text

    if args.prompt is not None:
        return utf8_text(args.prompt, "--prompt")
    if args.prompt_file == "-":
        return utf8_text(sys.stdin.buffer.read(), "the prompt on standard input")
    try:
        with open(args.prompt_file, "rb") as handle:
            data = handle.read()
    except OSError as exc:
        raise ValueError(f"--prompt-file {args.prompt_file!r}: {exc.strerror or exc}") from None
    return utf8_text(data, f"--prompt-file {args.prompt_file!r}")


EXIT_ERROR = 2  # nothing was generated
EXIT_PARTIAL = 3  # some tokens were generated (printed), then an unrecoverable error


def _print_json(result: GenerationResult, error: str | None = None) -> None:
    import orjson

    body: dict[str, Any] = {
        "text": result.text, "token_ids": result.token_ids,
        "prompt_token_ids": result.prompt_token_ids, "finish_reason": result.finish_reason,
        "metrics": result.metrics.to_dict(),
    }
    if error is not None:
        body.update(partial=True, error=error)
    sys.stdout.write(orjson.dumps(body).decode() + "\n")


# argparse takes a flag's prefix for the flag: each of these would reach --serve-api-key-file.
KEY_FLAG = "--serve-api-key"


def _key_on_command_line(argv: list[str]) -> bool:
    """``--serve-api-key`` (or a prefix argparse would take for ``--serve-api-key-file``) with
    a key, which ``ps`` would show to every user of the machine."""
    return any(KEY_FLAG.startswith(name) and name.startswith("--serve-a")
               for name in (arg.split("=", 1)[0] for arg in argv if arg.startswith("--")))


def serve_api_key(args: argparse.Namespace) -> str | None:
    """The gateway's key: the first line of ``--serve-api-key-file`` or
    ``$SPECDEC_SERVE_API_KEY``; None (open) without either. ValueError, one line, for a file
    that cannot be read or is empty, or a key given both ways."""
    variable = os.environ.get("SPECDEC_SERVE_API_KEY") or None  # compose passes "" when unset
    if not args.serve_api_key_file:
        return variable
    if variable is not None:
        raise ValueError("the gateway's key is given twice: --serve-api-key-file (or "
                         "SPECDEC_SERVE_API_KEY_FILE) and SPECDEC_SERVE_API_KEY; keep one")
    try:
        with open(args.serve_api_key_file, encoding="utf-8") as handle:
            key = handle.readline().strip()
    except (OSError, UnicodeDecodeError) as exc:
        reason = getattr(exc, "strerror", None) or exc
        raise ValueError(f"--serve-api-key-file {args.serve_api_key_file!r}: {reason}") from None
    if not key:
        raise ValueError(f"--serve-api-key-file {args.serve_api_key_file!r}: the first line "
                         "is empty (it holds the key)")
    return key


def _check_arguments(args: argparse.Namespace) -> str | None:
    """One line naming the first bad flag, or None."""
    from pydantic import ValidationError

    from shared.protocol.schema import GenerateRequest

    try:
        settings = client_settings(args)
    except ValueError as exc:
        return str(exc)
    if "num_beams" in args:
        try:
            GenerateRequest(prompt_ids=[0], num_beams=args.num_beams,
                            length_penalty=args.length_penalty,
                            no_repeat_ngram_size=args.no_repeat_ngram_size)
        except ValidationError as exc:
            return flag_problem(GenerateRequest, exc)
        if args.num_beams > 1 and settings.sampling.temperature != 0.0:
            return "--num-beams: beam search is greedy; use --temperature 0"
    return None


def client_settings(args: argparse.Namespace) -> ClientSettings:
    """The client settings the flags describe (a command without drafter flags keeps the
    defaults for them). ValueError, one line naming the flag, for a value a field refuses."""
    nested: dict[str, Any] = {}
    if "temperature" in args:
        nested["sampling"] = built(Sampling, args)
    if "drafter" in args:
        nested["options"] = built(DrafterOptions, args)
    if "max_concurrency" in args:  # specdec serve
        nested["gateway"] = built(GatewaySettings, args, api_key=serve_api_key(args))
    return built(ClientSettings, args, **nested)


def make_client(args: argparse.Namespace, with_drafter: bool = True) -> SpecDecClient:
    """The client the flags describe (``_connection`` and, with a drafter, ``_drafter``)."""
    from drafter_client.api import SpecDecClient

    return SpecDecClient(args.verifier_url, args.drafter if with_drafter else None,
                         args.tokenizer, settings=client_settings(args), api_key=args.api_key)


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from drafter_client.draft_length import make_draft_length
    from drafter_client.gateway import create_gateway, server_options
    from drafter_client.transport import SpecDecError

    template = None
    if args.chat_template:
        try:
            with open(args.chat_template, encoding="utf-8") as handle:
                template = handle.read()
        except OSError as exc:
            print(f"specdec: error: --chat-template: {exc}", file=sys.stderr)
            return EXIT_ERROR
    try:
        client = make_client(args)
        make_draft_length(str(args.num_draft_tokens), client.info.max_draft_tokens)
    except (SpecDecError, ValueError) as exc:
        print(f"specdec: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    settings = dataclasses.replace(client.settings.gateway,
                                   chat_template=template).serving(client.info.model)
    print(f"specdec serve: {settings.served_model_name!r} on "
          f"http://{settings.host}:{settings.port}/v1 "
          f"(verifier {args.verifier_url}, drafter {args.drafter}); the playground page: "
          f"http://{settings.host}:{settings.port}/", file=sys.stderr)
    uvicorn.run(create_gateway(client, settings), host=settings.host, port=settings.port,
                log_level="warning", **server_options(settings))
    return 0


def run(argv: list[str] | None = None) -> int:
    if _key_on_command_line(sys.argv[1:] if argv is None else argv):
        print("specdec: error: the gateway's key is not taken on the command line (ps shows "
              "it to every user): put it in SPECDEC_SERVE_API_KEY or in a file named by "
              "--serve-api-key-file", file=sys.stderr)
        return EXIT_ERROR
    args = build_parser().parse_args(argv)
    problem = _check_arguments(args)
    if problem is not None:
        print(f"specdec: error: {problem}", file=sys.stderr)
        return EXIT_ERROR
    from drafter_client.errors import SpecDecError, checked_url

    try:  # input errors before torch loads: one line at once
        checked_url(args.verifier_url)
        prompt = _read_prompt(args) if args.command in ("generate", "baseline") else ""
    except (SpecDecError, ValueError) as exc:
        print(f"specdec: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    if args.command == "serve":
        return _serve(args)
    from drafter_client.apps.output import TextStream, summary

    if args.command == "chat":
        from drafter_client.apps.console import run_console

        try:
            client = make_client(args)
        except SpecDecError as exc:
            print(f"specdec: error: {exc}", file=sys.stderr)
            return EXIT_ERROR
        return run_console(client, args)
    try:
        if args.command == "generate":
            client = make_client(args)
            stream = None if args.json else TextStream(client.decode)
            result = client.generate(prompt, chat=args.chat, on_tokens=stream)
            if stream is not None:
                stream.finish()
        else:
            client = make_client(args, with_drafter=False)
            early: bool | str = {"true": True, "false": False}.get(args.early_stopping, "never")
            result = client.baseline(prompt, num_beams=args.num_beams,
                                     length_penalty=args.length_penalty, early_stopping=early,
                                     no_repeat_ngram_size=args.no_repeat_ngram_size,
                                     chat=args.chat)
            if not args.json:
                sys.stdout.write(result.text)
    except SpecDecError as exc:
        partial: GenerationResult | None = exc.partial
        if partial is None or not partial.token_ids:  # nothing was generated: exit 2
            print(f"specdec: error: {exc}", file=sys.stderr)
            return EXIT_ERROR
        # Generation started and stopped: what was generated is on stdout, exit 3 says partial.
        if args.json:
            _print_json(partial, error=str(exc))
        else:
            sys.stdout.write("\n")
        print(f"specdec: error: {exc} (partial output: {len(partial.token_ids)} tokens "
              "generated before it)", file=sys.stderr)
        return EXIT_PARTIAL
    if args.json:
        _print_json(result)
    else:
        print("\n" + summary(result, args.command))
    if result.finish_reason == "context":
        print(f"specdec: notice: stopped at the verifier's context limit of "
              f"{client.info.max_context} tokens after {len(result.token_ids)} new tokens "
              f"(asked for {args.max_new_tokens})", file=sys.stderr)
    return 0


def main() -> None:
    sys.exit(run())


if __name__ == "__main__":
    main()
