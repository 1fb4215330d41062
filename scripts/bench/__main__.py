"""``python -m scripts.bench SUBCOMMAND [options]``: one tool for every benchmark."""

from __future__ import annotations

import argparse
import importlib
import sys
from types import ModuleType
from typing import Any

# Each command's module (scripts/bench/NAME.py), imported when it is chosen: a spawned worker
# process imports this entry point again, and should not load every benchmark with it.
COMMANDS = {"suite": "suite", "client": "client", "batching": "batching", "calls": "calls",
            "network": "network", "profile": "profile", "attack": "attack",
            "gateway": "gateway", "gpu": "gpu", "gpu-smoke": "gpu_smoke", "llama": "llama",
            "llama-blocks": "llama_blocks", "cpu-blocks": "cpu_blocks",
            "cpu-kernels": "cpu_kernels", "prompt-memory": "prompt_memory", "quality": "quality",
            "serving": "serving", "report": "report", "prediction": "prediction",
            "grammar": "grammar", "prefill": "prefill",
            "w4a8-products": "w4a8_products", "neighbours": "neighbours",
            "capacity": "capacity"}


def command_module(name: str) -> ModuleType:
    return importlib.import_module(f"scripts.bench.{COMMANDS[name]}")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """Every command's flags (``only``: that command's alone, the others without theirs)."""
    parser = argparse.ArgumentParser(prog="python -m scripts.bench",
                                     description=sys.modules["scripts.bench"].__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        if only is not None and name != only:
            sub.add_parser(name)
            continue
        module = command_module(name)
        doc = module.__doc__ or name
        command = sub.add_parser(name, help=doc.splitlines()[0], description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(command)
    return parser


def main(argv: list[str] | None = None) -> Any:
    argv = sys.argv[1:] if argv is None else argv
    chosen = argv[0] if argv and argv[0] in COMMANDS else None
    args = build_parser(chosen).parse_args(argv)
    args.command_line = "python -m scripts.bench " + " ".join(argv)
    return command_module(args.command).run(args)


if __name__ == "__main__":
    main()
