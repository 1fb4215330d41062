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

from drafter_client.settings import (
    DEFAULTS,
    ClientSettings,
    DrafterOptions,
    GatewaySettings,
    Sampling,
)

# Only light imports here: the parser, --help and the flag checks run before torch and
# transformers load (they take seconds); each command imports what it runs.
from shared.engines import DRAFTING_ENGINES

if TYPE_CHECKING:
    from pydantic import ValidationError

    from drafter_client.api import SpecDecClient
    from drafter_client.speculative import GenerationResult

OPTIONS, SAMPLING, GATEWAY = DEFAULTS.options, DEFAULTS.sampling, DEFAULTS.gateway


def _connection(p: argparse.ArgumentParser) -> None:
    p.add_argument("--verifier-url", required=True, help="e.g. http://127.0.0.1:8000")
    p.add_argument("--tokenizer", help="tokenizer spec (default: the drafter's, or the "
                   "verifier's model when it resolves here)")
    p.add_argument("--api-key", default=os.environ.get("SPECDEC_API_KEY"),
                   help="the verifier's API key (default: $SPECDEC_API_KEY; prefer the "
                   "variable, a flag shows in ps)")
    p.add_argument("--timeout-s", type=float, default=DEFAULTS.timeout_s,
                   help="HTTP timeout per call")
    p.add_argument("--retry-budget-s", type=float, default=DEFAULTS.retry_budget_s,
                   help="how long to keep retrying a verifier that is down or overloaded "
                   "before giving up (the first contact: at most 10 s)")
    p.add_argument("--simulated-rtt-ms", type=float, default=DEFAULTS.simulated_rtt_ms,
                   help="add this delay before every call to the verifier (network studies)")


def _sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=SAMPLING.max_new_tokens)
    p.add_argument("--temperature", type=float, default=SAMPLING.temperature,
                   help="0 means greedy")
    p.add_argument("--top-k", type=int, default=SAMPLING.top_k, help="0 disables top-k")
    p.add_argument("--top-p", type=float, default=SAMPLING.top_p, help="1.0 disables top-p")
    p.add_argument("--seed", type=int, default=SAMPLING.seed)
    p.add_argument("--reproducible", action="store_true",
                   help="sampled output identical to the target alone's with the same --seed, "
                   "whatever the drafter, -k or timing (Gumbel-max with noise shared by drafter "
                   "and target; costs some acceptance)")


def _common(p: argparse.ArgumentParser) -> None:
    _connection(p)
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text")
    prompt.add_argument("--prompt-file", help="read the prompt from this file ('-' for stdin)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    _sampling(p)
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def _drafter(p: argparse.ArgumentParser) -> None:
    p.add_argument("--drafter", required=True,
                   help="a model (short name, local folder, .gguf file, hub id), or one of "
                   "ngram, prompt-lookup, bigram")
    p.add_argument("-k", "--num-draft-tokens", default=DEFAULTS.num_draft_tokens,
                   help="drafts per block: an integer, 'auto' (default: a cost model of "
                   "measured acceptance, drafting time and round trip per k) or 'heuristic' "
                   "(grow by 2 after a fully accepted block, shrink by 1 otherwise)")
    p.add_argument("--ngram-n", type=int, default=OPTIONS.ngram_n, help="ngram: the order n")
    p.add_argument("--ngram-kind", choices=["simple", "multi"], default=OPTIONS.ngram_kind,
                   help="ngram: fixed n (SimpleDynaGram) or all orders 2..n longest first "
                   "(MultiDynaGram)")
    p.add_argument("--ngram-top-k-filler", type=int, default=OPTIONS.ngram_top_k_filler,
                   metavar="K",
                   help="ngram: also learn the target's top-K ids at each scored position")
    p.add_argument("--ngram-stop-if-unknown", action="store_true",
                   help="ngram: stop a draft at an unknown context instead of padding it")
    p.add_argument("--lookup-min-ngram", type=int, default=OPTIONS.lookup_min_ngram,
                   help="prompt-lookup: shortest match")
    p.add_argument("--lookup-max-ngram", type=int, default=OPTIONS.lookup_max_ngram,
                   help="prompt-lookup: longest match")
    p.add_argument("--draft-min-prob", type=float, default=OPTIONS.draft_min_prob, metavar="P",
                   help="model drafter: stop a block when its top probability drops below P")
    p.add_argument("--tree-width", type=int, default=OPTIONS.tree_width, metavar="W",
                   help="model drafter: draft a token tree - the drafter's best chain and, at "
                   "each position, up to W-1 runner-up tokens as leaves (1: a chain)")
    p.add_argument("--lookup", action=argparse.BooleanOptionalAction,
                   default=OPTIONS.lookup,
                   help="model drafter: hybrid with prompt lookup - a trusted match in the "
                   "context drafts for free, the model drafts where there is none (default: "
                   "on; --no-lookup: the model alone)")
    p.add_argument("--lookup-tokens", type=int, default=OPTIONS.lookup_tokens, metavar="N",
                   help="hybrid: the longest prompt-lookup draft (0: the block's k)")
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=OPTIONS.overlap,
                   help="model drafter: draft the next block while this one is verified "
                   "(pays off when the verifier runs on other cores or another host)")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="model drafter: keep its KV cache in a preallocated slot and replay "
                   "its one-token steps as captured CUDA graphs (a GPU client; on a CPU the "
                   "same static steps run eagerly)")
    p.add_argument("--dtype", default=DEFAULTS.dtype,
                   choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default=DEFAULTS.device, help="auto, cpu, cuda or cuda:N")
    p.add_argument("--drafter-engine", default=OPTIONS.engine, choices=DRAFTING_ENGINES,
                   help="what runs a model drafter (shared/engines); auto: the first engine "
                   "that claims the model (on a CPU with the [llama] extra, llama.cpp for a "
                   ".gguf file or a short name whose GGUF is kept; else transformers)")
    p.add_argument("--threads", type=int, default=OPTIONS.threads,
                   help="CPU threads of the drafter (torch's, or llama.cpp's); 0: the default")


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
    serve.add_argument("--host", default=GATEWAY.host)
    serve.add_argument("--port", type=int, default=GATEWAY.port)
    serve.add_argument("--served-model-name",
                       help="the model name clients send (default: the verifier's model)")
    serve.add_argument("--chat-template", metavar="FILE",
                       help="a Jinja chat template file to use instead of the tokenizer's")
    serve.add_argument("--max-concurrency", type=int, default=GATEWAY.max_concurrency,
                       help="generations running at once (the verifier batches them)")
    serve.add_argument("--max-waiting", type=int, default=GATEWAY.max_waiting,
                       help="requests waiting for a slot beyond --max-concurrency; more get 429")
    serve.add_argument("--max-body-bytes", type=int, default=GATEWAY.max_body_bytes,
                       help="largest request body; beyond it 413, before it is parsed")
    serve.add_argument("--body-timeout-s", type=float, default=GATEWAY.body_timeout_s,
                       help="a request body must arrive within this many seconds, or 408")
    serve.add_argument("--header-timeout-s", type=float,
                       default=GATEWAY.header_timeout_s,
                       help="a request head must arrive within this many seconds of connecting "
                       "or of the last response, or 408 and closed")
    # The key itself never on the command line (it would show in ps): --serve-api-key is
    # refused (run), SPECDEC_SERVE_API_KEY or a file holds it.
    serve.add_argument("--serve-api-key-file", metavar="PATH",
                       default=os.environ.get("SPECDEC_SERVE_API_KEY_FILE"),
                       help="require the Bearer key in this file (its first line) from the "
                       "server's own clients (default: $SPECDEC_SERVE_API_KEY_FILE; or the key "
                       "in $SPECDEC_SERVE_API_KEY; neither: open)")
    serve.add_argument("--allowed-hosts", metavar="HOSTS",
                       default=os.environ.get("SPECDEC_SERVE_ALLOWED_HOSTS", ""),
                       help="comma-separated Host names to answer to besides 127.0.0.1, "
                       "localhost, [::1] and --host (name: any port, name:port; *: any Host); "
                       "other Hosts get 421 (DNS rebinding). With --host 0.0.0.0 and none set, "
                       "any Host (default: $SPECDEC_SERVE_ALLOWED_HOSTS)")
    serve.add_argument("--cors-origins", metavar="ORIGINS",
                       default=os.environ.get("SPECDEC_SERVE_CORS_ORIGINS", ""),
                       help="comma-separated origins (https://app.example.com) whose web pages "
                       "may call this API; none: no CORS headers, pages on other sites cannot "
                       "(default: $SPECDEC_SERVE_CORS_ORIGINS)")
    chat = sub.add_parser("chat", help="an interactive console against a verifier")
    _connection(chat)
    _drafter(chat)
    _sampling(chat)
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


def _listed(value: str) -> tuple[str, ...]:
    """A comma-separated flag's entries."""
    return tuple(entry.strip() for entry in value.split(",") if entry.strip())


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


def _flag_problem(exc: ValidationError) -> str:
    """The first error of a wire model built from flags, naming the flag."""
    err = exc.errors()[0]
    flag = "--" + str(err["loc"][0]).replace("_", "-")
    flag = {"--coupling-seed": "--seed"}.get(flag, flag)
    return f"{flag}: {err['msg']} (got {err.get('input')!r})"


def _check_arguments(args: argparse.Namespace) -> str | None:
    """One line naming the first bad flag, or None."""
    from pydantic import ValidationError

    from shared.protocol.schema import GenerateRequest, SamplingParams

    if "temperature" in args:
        try:
            SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                           coupling_seed=args.seed if args.reproducible else None)
        except ValidationError as exc:
            return _flag_problem(exc)
        if args.max_new_tokens < 1:
            return f"--max-new-tokens must be at least 1 (got {args.max_new_tokens})"
    if "num_beams" in args:
        try:
            GenerateRequest(prompt_ids=[0], num_beams=args.num_beams,
                            length_penalty=args.length_penalty,
                            no_repeat_ngram_size=args.no_repeat_ngram_size)
        except ValidationError as exc:
            return _flag_problem(exc)
        if args.num_beams > 1 and args.temperature != 0.0:
            return "--num-beams: beam search is greedy; use --temperature 0"
    if "tree_width" in args:
        from drafter_client.draft_length import parse_k

        try:  # the form of -k here; its bound, the verifier's max_draft_tokens, once connected
            parse_k(str(args.num_draft_tokens))
        except ValueError as exc:
            return str(exc)
        if args.tree_width < 1:
            return f"--tree-width must be at least 1 (got {args.tree_width})"
        if args.lookup_tokens < 0:
            return f"--lookup-tokens must be at least 0 (got {args.lookup_tokens})"
    if args.command == "serve":
        for flag in ("max_concurrency", "port"):
            if getattr(args, flag) < 1:
                return f"--{flag.replace('_', '-')} must be at least 1 (got {getattr(args, flag)})"
        if args.max_waiting < 0:
            return f"--max-waiting must be at least 0 (got {args.max_waiting})"
        from shared.http.cross_site import check_allowed_hosts, check_cors_origins

        problem = (check_allowed_hosts(_listed(args.allowed_hosts))
                   or check_cors_origins(_listed(args.cors_origins)))
        if problem is not None:
            return problem
        try:
            serve_api_key(args)
        except ValueError as exc:
            return str(exc)
    return None


def client_settings(args: argparse.Namespace) -> ClientSettings:
    """The client settings the flags describe (a command without drafter flags keeps the
    defaults for them)."""
    sampling = (Sampling(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                         top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                         reproducible=args.reproducible)
                if "temperature" in args else SAMPLING)
    connection = {"timeout_s": args.timeout_s, "retry_budget_s": args.retry_budget_s,
                  "simulated_rtt_ms": args.simulated_rtt_ms}
    if "drafter" not in args:
        return ClientSettings(sampling=sampling, **connection)
    options = DrafterOptions(
        ngram_n=args.ngram_n, ngram_kind=args.ngram_kind,
        ngram_top_k_filler=args.ngram_top_k_filler,
        ngram_stop_if_unknown=args.ngram_stop_if_unknown,
        lookup_min_ngram=args.lookup_min_ngram, lookup_max_ngram=args.lookup_max_ngram,
        draft_min_prob=args.draft_min_prob, tree_width=args.tree_width, lookup=args.lookup,
        lookup_tokens=args.lookup_tokens, overlap=args.overlap,
        cuda_graphs=args.cuda_graphs, engine=args.drafter_engine, threads=args.threads)
    gateway = GATEWAY
    if "max_concurrency" in args:  # specdec serve
        gateway = GatewaySettings(
            served_model_name=args.served_model_name or "", host=args.host, port=args.port,
            max_concurrency=args.max_concurrency, max_waiting=args.max_waiting,
            max_body_bytes=args.max_body_bytes, body_timeout_s=args.body_timeout_s,
            header_timeout_s=args.header_timeout_s, api_key=serve_api_key(args),
            allowed_hosts=_listed(args.allowed_hosts), cors_origins=_listed(args.cors_origins))
    return ClientSettings(num_draft_tokens=str(args.num_draft_tokens), options=options,
                          sampling=sampling, dtype=args.dtype, device=args.device,
                          gateway=gateway, **connection)


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
