"""Generated ids -> text, block by block: stop strings and what is safe to stream.

The text is always ``decode(ids)`` of everything generated so far (never pieced together from
per-token decodes, which differ for tokenizers that merge or clean up across tokens), cut before
the first stop string. Streaming sends only text that cannot change: a trailing incomplete UTF-8
sequence (decoded as U+FFFD) and a tail that could still grow into a stop string are held back.

Stop strings end a generation without touching its distribution: the text before the stop is
what the unstopped generation would have produced.
"""

from __future__ import annotations

from collections.abc import Callable

REPLACEMENT = "\ufffd"


class TextTracker:
    def __init__(self, decode: Callable[[list[int]], str], stops: list[str] | None = None) -> None:
        self.decode = decode
        self.stops = [s for s in (stops or []) if s]
        self.ids: list[int] = []
        self.text = ""
        self.sent = 0  # characters of ``text`` handed out by ``delta``
        self.stopped = False  # a stop string was found; ids and text end before it

    def add(self, tokens: list[int]) -> None:
        """A block of new ids. After a stop string, ``ids`` keeps the tokens up to the one that
        completed it (what was generated for this text) and later tokens are ignored."""
        if self.stopped:
            return
        before = len(self.ids)
        longest = max((len(s) for s in self.stops), default=0)
        search_from = max(0, len(_completed(self.text)) - longest)
        self.ids.extend(tokens)
        self.text = self.decode(self.ids)
        cut = self._find_stop(self.text, search_from)
        if cut is None:
            return
        # The fewest of this block's tokens whose text already holds the stop string.
        for n in range(before + 1, len(self.ids) + 1):
            text = self.decode(self.ids[:n])
            cut = self._find_stop(text, search_from)
            if cut is not None:
                del self.ids[n:]
                self.text = text[:cut]
                break
        self.stopped = True

    def _find_stop(self, text: str, start: int) -> int | None:
        """Where the first stop string begins in ``text``'s completed characters: a trailing
        U+FFFD stands for a character whose bytes have not all come yet, so it matches nothing."""
        text = _completed(text)
        found = [i for s in self.stops if (i := text.find(s, start)) >= 0]
        return min(found) if found else None

    def delta(self, final: bool = False) -> str:
        """The text not handed out yet that can no longer change (everything when ``final``)."""
        end = len(self.text)
        if not final and not self.stopped:
            end = max(self.sent, len(_completed(self.text)))
            end -= self._held_for_stop(self.text[:end])
        if end <= self.sent:
            return ""
        piece, self.sent = self.text[self.sent:end], end
        return piece

    def _held_for_stop(self, text: str) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
        held = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), held, -1):
                if text.endswith(stop[:n]):
                    held = n
                    break
        return held


def _completed(text: str) -> str:
    """``text`` without its trailing U+FFFD: the characters whose bytes have all been decoded."""
    return text.rstrip(REPLACEMENT)
