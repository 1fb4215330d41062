"""``python -m scripts.bench SUBCOMMAND [options]``: one tool for every benchmark."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from scripts.bench import (
    attack,
    batching,
    calls,
    client,
    gateway,
    gpu,
    gpu_smoke,
    llama,
    network,
    profile,
    report,
    suite,
)

COMMANDS = {"suite": suite, "client": client, "batching": batching, "calls": calls,
            "network": network,
            "profile": profile, "attack": attack, "gateway": gateway, "gpu": gpu,
            "gpu-smoke": gpu_smoke, "llama": llama, "report": report}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench",
                                     description=sys.modules["scripts.bench"].__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module in COMMANDS.items():
        doc = module.__doc__ or name
        command = sub.add_parser(name, help=doc.splitlines()[0], description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(command)
    return parser


def main(argv: list[str] | None = None) -> Any:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    args.command_line = "python -m scripts.bench " + " ".join(argv)
    return COMMANDS[args.command].run(args)


if __name__ == "__main__":
    main()
