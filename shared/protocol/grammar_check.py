"""A child process that checks grammars for the grammar module, so that a grammar which crashes
llguidance (it recurses along chained rules: 3,000 of them overflow an 8 MiB stack, SIGSEGV)
takes this process with it, not the verifier or the gateway.

It reads grammars from stdin and answers each on stdout, both framed as a 4-byte big-endian
length and UTF-8 text; the answer is "" for a grammar that compiles, else the problem. Each check
runs on a thread with a stack of ``CHECK_STACK`` bytes, far smaller than the one the parent
compiles on (``grammar.COMPILE_STACK``), so a grammar that passes here has a wide margin there;
the process may map at most ``CHECK_MEMORY`` bytes.

Run as ``python -m shared.protocol.grammar_check``; ``grammar.GrammarChecker`` starts it.
"""

from __future__ import annotations

import resource
import struct
import sys
import threading
from typing import IO

CHECK_STACK = 2 * 1024 * 1024
CHECK_MEMORY = 4 * 1024 * 1024 * 1024


def _read_exactly(stream: IO[bytes], size: int) -> bytes | None:
    parts, left = [], size
    while left:
        part = stream.read(left)
        if not part:
            return None
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


def read_frame(stream: IO[bytes]) -> bytes | None:
    """One framed message; None at the end of the stream."""
    head = _read_exactly(stream, 4)
    if head is None:
        return None
    return _read_exactly(stream, struct.unpack(">I", head)[0])


def write_frame(stream: IO[bytes], body: bytes) -> None:
    stream.write(struct.pack(">I", len(body)) + body)
    stream.flush()


def problem_of(grammar: str) -> str:
    """"" for a grammar llguidance compiles (warnings pass), else its message."""
    import llguidance

    try:
        problem = llguidance.LLMatcher.validate_grammar(
            grammar, limits=llguidance.LLParserLimits(verbose_errors=False))
    except Exception as exc:  # noqa: BLE001 - the library's own words for the grammar
        return f"the grammar does not compile: {exc}"
    if problem and not problem.startswith("WARNING"):
        return f"the grammar does not compile: {problem}"
    return ""


def checked_on_small_stack(grammar: str) -> str:
    answer: list[str] = []
    threading.stack_size(CHECK_STACK)
    worker = threading.Thread(target=lambda: answer.append(problem_of(grammar)))
    worker.start()
    worker.join()
    return answer[0] if answer else "the grammar check failed"


def main() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (CHECK_MEMORY, CHECK_MEMORY))
    import llguidance  # noqa: F401 - loaded before the first grammar, not timed against it

    write_frame(sys.stdout.buffer, b"ready")
    while (grammar := read_frame(sys.stdin.buffer)) is not None:
        answer = checked_on_small_stack(grammar.decode("utf-8", errors="replace"))
        write_frame(sys.stdout.buffer, answer.encode())


if __name__ == "__main__":
    main()
