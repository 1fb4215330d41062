"""What the command line and the chat console print: generated text as it is verified, and a
generation's summary."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from drafter_client.text import TextTracker

if TYPE_CHECKING:
    from drafter_client.outcome import BlockOutcome
    from drafter_client.speculative import GenerationResult


def utf8_text(data: str | bytes, where: str) -> str:
    """Text read from the command line or a file, as it came; ValueError naming ``where`` and
    the first byte that is not UTF-8 (on the command line Python keeps such bytes as lone
    surrogates, which no tokenizer takes)."""
    if isinstance(data, bytes):
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as exc:
            byte, at = data[exc.start], exc.start
    else:
        try:
            data.encode("utf-8")
            return data
        except UnicodeEncodeError as exc:  # a lone surrogate: U+DC80-U+DCFF holds a raw byte
            byte = ord(data[exc.start]) & 0xFF
            at = len(data[:exc.start].encode("utf-8"))
    raise ValueError(f"{where} is not UTF-8 text (byte 0x{byte:02x} at offset {at})")


def stdout_write(piece: str, kind: str) -> None:
    sys.stdout.write(piece)
    sys.stdout.flush()


class TextStream:
    """Writes decoded text as tokens arrive (``TextTracker``: a trailing incomplete UTF-8
    sequence waits for the token that completes it); ``finish`` writes what is still held when
    the generation ends. ``write(piece, kind)`` gets each piece with the kind of the token that
    completed it: "accepted" (a draft the target accepted), "recovered", "bonus", or "target"
    (no drafts in its block, or fed as plain ids)."""

    def __init__(self, decode: Callable[[list[int]], str],
                 write: Callable[[str, str], None] = stdout_write) -> None:
        self.tracker = TextTracker(decode)
        self.write = write
        self.kind = "target"

    def __call__(self, new_ids: list[int]) -> None:
        """A block's new ids (``on_tokens``)."""
        self.kind = "target"
        self.tracker.add(new_ids)
        self._emit()

    def block(self, outcome: BlockOutcome) -> None:
        """A verified block (``on_block``), token by token, each with its kind."""
        for token, self.kind in zip(outcome.tokens, outcome.kinds(), strict=True):
            self.tracker.add([token])
            self._emit()

    def finish(self) -> None:
        self._emit(final=True)

    def _emit(self, final: bool = False) -> None:
        piece = self.tracker.delta(final=final)
        if piece:
            self.write(piece, self.kind)


def summary(result: GenerationResult, label: str) -> str:
    """A generation's figures in a few lines: speed, acceptance, bytes and where time went."""
    m: dict[str, Any] = result.metrics.to_dict()
    lines = [f"--- {label}: {m['new_tokens']} tokens in {m['wall_s']:.2f} s = "
             f"{m['tokens_per_s']:.2f} tok/s"]
    if m["verify_calls"]:
        per_pos = " ".join(f"{a:.2f}" for a in m["per_position_acceptance"])
        t = m["time_s"]
        lines += [
            f"verify calls {m['verify_calls']}, drafted {m['drafted_tokens']}, accepted "
            f"{m['accepted_tokens']} (rate {m['acceptance_rate']:.3f}), "
            f"{m['mean_tokens_per_call']:.2f} tokens/call, "
            f"target forwards saved {m['target_forwards_saved']}",
            f"per-position acceptance: {per_pos}",
            f"bytes sent {m['bytes_sent']}, received {m['bytes_received']} "
            f"({m['bytes_per_token']} B/token)",
            f"time: prefill {t['prefill_rtt']:.2f} s, drafting {t['drafting']:.2f} s, verify "
            f"round trips {t['verify_rtt']:.2f} s (forward {t['verify_forward']:.2f} s), client "
            f"{t['client']:.2f} s",
        ]
    return "\n".join(lines)
