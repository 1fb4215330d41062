"""Generated ids -> text, block by block: stop strings and what is safe to stream.

The text is always ``decode(ids)`` of everything generated so far (never pieced together from
per-token decodes, which differ for tokenizers that merge or clean up across tokens), cut before
the first stop string. Streaming sends only text that cannot change: a trailing incomplete UTF-8
sequence (decoded as U+FFFD) and a tail that could still grow into a stop string are held back.

Stop strings end a generation without touching its distribution: the text before the stop is
what the unstopped generation would have produced.

The decoding is incremental, so a long answer costs linear work, not quadratic (#57: 8,000
tokens cost the gateway 5.3 s): the text of ``ids[:anchor]`` is kept, and the ids after it are
decoded with :data:`WINDOW` ids before them as context (a tokenizer's decoder may treat the
first id of a decode otherwise: a leading space dropped, a character split). Where the window
does not hold (the context's text is not a prefix of the longer decode), everything is decoded
again; and the final text is checked against one decode of every id.
"""

from __future__ import annotations

from collections.abc import Callable

REPLACEMENT = "\ufffd"
WINDOW = 8  # ids of context each new piece is decoded with
SETTLE = 32  # ids past the anchor before it moves up (to WINDOW ids before the end)


class TextTracker:
    def __init__(self, decode: Callable[[list[int]], str], stops: list[str] | None = None) -> None:
        self.decode = decode
        self.stops = [s for s in (stops or []) if s]
        self.ids: list[int] = []
        self.text = ""
        self.sent = 0  # characters of ``text`` handed out by ``delta``
        self.stopped = False  # a stop string was found; ids and text end before it
        self._anchor = 0  # ids[:_anchor] are never decoded again...
        self._stable = ""  # ...their text is this

    def _decode_to(self, end: int) -> str:
        """``decode(ids[:end])``, decoding only from the anchor on (with a window of context)."""
        start = max(0, self._anchor - WINDOW)
        context = self.decode(self.ids[start:self._anchor]) if start < self._anchor else ""
        piece = self.decode(self.ids[start:end])
        if start == 0:
            return piece
        if not piece.startswith(context):  # the window does not hold here
            return self.decode(self.ids[:end])
        return self._stable + piece[len(context):]

    def _settle(self) -> None:
        """Move the anchor up to WINDOW ids before the end, where the text there is whole."""
        if len(self.ids) - self._anchor < SETTLE:
            return
        anchor = len(self.ids) - WINDOW
        text = self._decode_to(anchor)
        if not text.endswith(REPLACEMENT) and self.text.startswith(text):
            self._anchor, self._stable = anchor, text

    def add(self, tokens: list[int]) -> None:
        """A block of new ids. After a stop string, ``ids`` keeps the tokens up to the one that
        completed it (what was generated for this text) and later tokens are ignored."""
        if self.stopped:
            return
        before = len(self.ids)
        longest = max((len(s) for s in self.stops), default=0)
        search_from = max(0, len(_completed(self.text)) - longest)
        self.ids.extend(tokens)
        self.text = self._decode_to(len(self.ids))
        cut = self._find_stop(self.text, search_from)
        if cut is None:
            self._settle()
            return
        # The fewest of this block's tokens whose text already holds the stop string.
        for n in range(before + 1, len(self.ids) + 1):
            text = self._decode_to(n)
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
        """The text not handed out yet that can no longer change (everything when ``final``:
        then the text is checked against one decode of every id)."""
        if final and not self.stopped:
            whole = self.decode(self.ids)
            if whole != self.text and whole.startswith(self.text[:self.sent]):
                self.text = whole  # the windows missed something the sent text did not hold
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
