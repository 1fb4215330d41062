"""``specdec chat``: an interactive console against a verifier.

Each turn is one speculative generation of the assistant's answer to the conversation so far (in
the model's chat template; a tokenizer without one makes every line a plain prompt). The answer
streams block by block, coloured by where each token came from: accepted draft tokens, the
target's recovered token after a rejection, the bonus token after a fully accepted block. Slash
commands change the settings between turns (``/help``).
"""

from __future__ import annotations

import argparse
import contextlib
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

from pydantic import ValidationError

from drafter_client.api import SpecDecClient
from drafter_client.apps.output import TextStream, summary, utf8_text
from drafter_client.draft_length import make_draft_length
from drafter_client.hybrid import HybridDrafter
from drafter_client.settings import DEFAULTS, ClientSettings, Sampling, replaced
from drafter_client.speculative import GenerationResult
from drafter_client.transport import SpecDecError
from shared.engines.drafter import LMDrafter
from shared.protocol.schema import SamplingParams

COLORS = {"accepted": "\x1b[32m", "recovered": "\x1b[33m", "bonus": "\x1b[36m", "target": "",
          "dim": "\x1b[2m"}
RESET = "\x1b[0m"

HELP = """commands (between turns):
  /k N | auto | heuristic   draft length
  /temperature T            0 = greedy
  /top-k K                  0 disables
  /top-p P                  1 disables
  /max-tokens N             new tokens per answer
  /seed N                   sampling seed
  /draft-min-prob P         model drafter: stop a block below this top probability
  /drafter SPEC             another drafter (model, ngram, prompt-lookup, bigram)
  /compare                  toggle: also run the target alone and compare
  /metrics                  the last answer's full metrics
  /system TEXT              set the system message (starts a new conversation)
  /reset                    forget the conversation
  /settings                 show the settings
  /quit                     leave (also Ctrl-D)"""


@dataclass
class ChatSettings:
    """What the console's commands change, starting from the client's settings."""

    k: str = DEFAULTS.num_draft_tokens
    sampling: Sampling = DEFAULTS.sampling
    compare: bool = False
    system: str | None = None

    @classmethod
    def of(cls, settings: ClientSettings, compare: bool = False,
           system: str | None = None) -> ChatSettings:
        return cls(settings.num_draft_tokens, settings.sampling, compare, system)


@dataclass
class Console:
    client: SpecDecClient
    settings: ChatSettings
    out: TextIO = sys.stdout
    color: bool = False
    history: list[dict[str, str]] = field(default_factory=list)
    last: GenerationResult | None = None
    turn: int = 0

    # -- output ------------------------------------------------------------------------------
    def say(self, text: str, kind: str = "dim") -> None:
        self.out.write(self._paint(text, kind) + "\n")
        self.out.flush()

    def _show(self, piece: str, kind: str) -> None:
        """Answer text as it is verified, coloured by the kind of its token."""
        self.out.write(self._paint(piece, kind))
        self.out.flush()

    def _paint(self, text: str, kind: str) -> str:
        code = COLORS.get(kind, "") if self.color else ""
        return f"{code}{text}{RESET}" if code else text

    def legend(self) -> str:
        parts = [self._paint(name, name) for name in ("accepted", "recovered", "bonus")]
        return "colours: " + " / ".join(parts) + " (draft tokens accepted / the target's token " \
               "after a rejection / after a fully accepted block)"

    # -- commands ----------------------------------------------------------------------------
    def command(self, line: str) -> bool:
        """Run a slash command; False to leave."""
        try:
            name, *rest = shlex.split(line[1:]) or [""]
        except ValueError as exc:
            self.say(f"error: {exc}")
            return True
        arg = " ".join(rest)
        handlers: dict[str, Callable[[str], None]] = {
            "k": self._set_k, "temperature": self._sampling("temperature", float),
            "top-k": self._sampling("top_k", int), "top-p": self._sampling("top_p", float),
            "max-tokens": self._set_max_tokens, "seed": self._set_seed,
            "draft-min-prob": self._set_min_prob, "drafter": self._set_drafter,
            "compare": self._toggle_compare, "metrics": self._show_metrics,
            "system": self._set_system, "reset": self._reset, "settings": self._show_settings,
            "help": lambda _: self.say(HELP),
        }
        if name in ("quit", "exit", "q"):
            return False
        handler = handlers.get(name)
        if handler is None:
            self.say(f"unknown command /{name}; /help lists them")
            return True
        try:
            handler(arg)
        except ValidationError as exc:  # a settings field's own bound: one line naming it
            error = exc.errors()[0]
            self.say(f"error: /{name}: {error['loc'][0]}: {error['msg']} "
                     f"(got {error.get('input')!r})")
        except (ValueError, SpecDecError) as exc:
            self.say(f"error: /{name}: {exc}")
        return True

    def _set_k(self, arg: str) -> None:
        make_draft_length(arg, self.client.info.max_draft_tokens)  # ValueError when bad
        self.settings.k = arg
        self.say(f"k = {arg}")

    def _sampling(self, attr: str, kind: Callable[[str], Any]) -> Callable[[str], None]:
        def set_value(arg: str) -> None:
            value = kind(arg)
            s = self.settings.sampling
            values = {"temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p,
                      attr: value}
            try:
                SamplingParams(**values)
            except Exception as exc:  # noqa: BLE001 - pydantic's message names the field
                raise ValueError(str(exc).splitlines()[-1].strip()) from None
            self.settings.sampling = replaced(s, **{attr: value})
            self.say(f"{attr} = {value}")
        return set_value

    def _set_max_tokens(self, arg: str) -> None:
        self.settings.sampling = replaced(self.settings.sampling, max_new_tokens=int(arg))
        self.say(f"max tokens = {self.settings.sampling.max_new_tokens}")

    def _set_seed(self, arg: str) -> None:
        self.settings.sampling = replaced(self.settings.sampling, seed=int(arg))
        self.say(f"seed = {self.settings.sampling.seed}")

    def _set_min_prob(self, arg: str) -> None:
        value = float(arg)
        if not 0.0 <= value <= 1.0:
            raise ValueError("must lie in [0, 1]")
        drafter = self.client.drafter
        if isinstance(drafter, HybridDrafter):  # the default: lookup + the model
            drafter = drafter.model
        if not isinstance(drafter, LMDrafter):
            raise ValueError("only a model drafter has a confidence stop")
        drafter.min_prob = value
        self.say(f"draft min prob = {value}")

    def _set_drafter(self, arg: str) -> None:
        if not arg:
            raise ValueError("name a drafter: a model, ngram, prompt-lookup or bigram")
        self.say(f"loading drafter {arg} ...")
        self.client = SpecDecClient(self.client.verifier, arg, self.client.tokenizer,
                                    settings=self.client.settings)
        self.say(f"drafter = {arg}")

    def _toggle_compare(self, _: str) -> None:
        self.settings.compare = not self.settings.compare
        self.say(f"compare with the target alone: {'on' if self.settings.compare else 'off'}")

    def _show_metrics(self, _: str) -> None:
        if self.last is None:
            self.say("no answer yet")
        else:
            self.say(summary(self.last, "last answer"))

    def _set_system(self, arg: str) -> None:
        self.settings.system = arg or None
        self._reset("")

    def _reset(self, _: str) -> None:
        self.history = []
        self.say("new conversation")

    def _show_settings(self, _: str) -> None:
        k, s = self.settings.k, self.settings.sampling
        drafter = self.client.drafter_name
        self.say(f"drafter {drafter}, k {k}, temperature {s.temperature}, top-k {s.top_k}, "
                 f"top-p {s.top_p}, max tokens {s.max_new_tokens}, seed {s.seed}, compare "
                 f"{'on' if self.settings.compare else 'off'}")

    # -- a turn ------------------------------------------------------------------------------
    def prompt_ids(self, text: str) -> list[int]:
        if not getattr(self.client.tokenizer, "chat_template", None):
            return self.client.encode(text)  # no template: a plain prompt, no history
        messages = ([{"role": "system", "content": self.settings.system}]
                    if self.settings.system else [])
        return self.client.encode_chat([*messages, *self.history,
                                        {"role": "user", "content": text}])

    def answer(self, text: str) -> None:
        s = self.settings
        ids = self.prompt_ids(text)
        stream = TextStream(self.client.decode, self._show)
        sampling = replaced(s.sampling, seed=(s.sampling.seed + self.turn) % 2**63)
        try:
            result = self.client.generate(ids, num_draft_tokens=s.k, on_block=stream.block,
                                          sampling=sampling)
            stream.finish()
        except SpecDecError as exc:
            self.out.write("\n")
            self.say(f"error: {exc}")
            return
        except KeyboardInterrupt:
            self.out.write("\n")
            self.say("(interrupted; the answer is dropped)")
            return
        self.turn += 1
        self.out.write("\n")
        self.last = result
        m = result.metrics.to_dict()
        self.say(f"[{m['new_tokens']} tokens, {m['tokens_per_s']:.1f} tok/s, acceptance "
                 f"{m['acceptance_rate']:.2f}, {m['mean_tokens_per_call']:.2f} tokens/call, "
                 f"{result.finish_reason}]")
        if getattr(self.client.tokenizer, "chat_template", None):
            self.history += [{"role": "user", "content": text},
                             {"role": "assistant", "content": result.text}]
        if s.compare:
            self._compare(ids, result, sampling)

    def _compare(self, ids: list[int], result: GenerationResult, sampling: Sampling) -> None:
        try:
            alone = self.client.baseline(ids, sampling=sampling)
        except SpecDecError as exc:
            self.say(f"target alone: error: {exc}")
            return
        fast, slow = result.metrics.to_dict(), alone.metrics.to_dict()
        speedup = fast["tokens_per_s"] / slow["tokens_per_s"] if slow["tokens_per_s"] else 0.0
        same = alone.token_ids == result.token_ids
        note = ("identical output" if same else "different output"
                + (" (expected when sampling)" if self.settings.sampling.temperature > 0 else
                   " - greedy outputs should match"))
        self.say(f"[target alone: {slow['tokens_per_s']:.1f} tok/s; speculative "
                 f"{speedup:.2f}x; {note}]")


def run_console(client: SpecDecClient, args: argparse.Namespace) -> int:
    settings = ChatSettings.of(client.settings, args.compare, args.system)
    try:
        make_draft_length(settings.k, client.info.max_draft_tokens)
    except ValueError as exc:
        print(f"specdec: error: -k: {exc}", file=sys.stderr)
        return 2
    console = Console(client, settings, color=not args.no_color and sys.stdout.isatty())
    with contextlib.suppress(ImportError):
        import readline  # noqa: F401 - line editing and history for input()
    console.say(f"specdec chat: {client.info.model} via {args.verifier_url}, drafter "
                f"{args.drafter}. /help for commands, Ctrl-D to leave.")
    if console.color:
        console.say(console.legend())
    if not getattr(client.tokenizer, "chat_template", None):
        console.say("(the tokenizer has no chat template: each line is a plain prompt)")
    while True:
        try:
            line = input("> ")
        except EOFError:
            console.out.write("\n")
            break
        except KeyboardInterrupt:
            console.out.write("\n")
            continue
        except UnicodeDecodeError as exc:
            console.say(f"error: that line is not UTF-8 text (byte 0x{exc.object[exc.start]:02x})")
            continue
        try:
            line = utf8_text(line, "that line").strip()
        except ValueError as exc:
            console.say(f"error: {exc}")
            continue
        if not line:
            continue
        if line.startswith("/"):
            if not console.command(line):
                break
            continue
        console.answer(line)
    client.close()
    return 0
