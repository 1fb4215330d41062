"""Structured output: a grammar (a JSON schema, any JSON object, a Lark grammar) that every
generated token must keep, through llguidance.

Why llguidance (measured against xgrammar and outlines-core on a 151,936-id vocabulary:
docs/benchmarks.md, "Which grammar engine for structured output?"): its mask takes 15-28 µs a
token there (xgrammar's 2-23 µs, yet the row costs this client about 120 µs whatever the
engine), it compiles a schema in about a millisecond (xgrammar 19 ms, outlines-core up to 9 s)
when a gateway meets each new schema at request time, it compiles Lark too, and it rolls back
consumed tokens, which a block needs: the mask of row i depends on the block's drafts before it.

The constrained target distribution at a position is the target's, masked to the tokens the
grammar allows there and renormalised. In speculation the client owns the sequence, so it owns
the grammar's state: for each block it computes the mask of every row - row 0 after the
committed tokens, row i after the first i drafts - and sends them with the block; the verifier
applies them to the rows before deciding (``shared.protocol.acceptance``), so acceptance, the
recovered token and the bonus token all use the masked distribution. A draft the grammar refuses
ends the block there (the target gives it probability 0: it would be rejected; nothing after it
can count). A model drafter drafts under the same masks (and the generation's penalties): its
rows go through ``VerifierSession.shape_row``, so its q is the constrained drafter's and its
drafts keep the grammar. Drafts that draw from no rows (a lookup's copies, a prediction) are
checked: one the grammar refuses ends the block. The target alone (``/v1/generate``) keeps a
state of its own on the verifier, one mask per step.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from shared.protocol.grammar_check import read_frame, write_frame
from shared.protocol.schema import RowMask

T = TypeVar("T")


class GrammarError(ValueError):
    """A grammar that does not compile, or a token it does not allow where it came."""


class GrammarDeadEnd(GrammarError):
    """The grammar cannot go on: no token of the vocabulary continues it, or llguidance gave
    up on it (a lexer or parser limit) mid-generation."""


MAX_SCHEMA_BYTES = 65536  # a schema larger than this (as JSON) is refused
MAX_SCHEMA_DEPTH = 32  # and one nested deeper
MAX_GRAMMAR_BYTES = 1 << 20  # a grammar's text (Lark, or llguidance's of a schema)
GRAMMAR_CHECK_SECONDS = 10.0  # the child's check of one grammar
COMPILE_STACK = 256 * 1024 * 1024  # the stack a grammar is compiled on here (grammar_check)
CHECKED_GRAMMARS = 1024  # digests of grammars that passed, kept


def _depth(value: Any, level: int = 0) -> int:
    if isinstance(value, dict):
        return max((_depth(v, level + 1) for v in value.values()), default=level + 1)
    if isinstance(value, list):
        return max((_depth(v, level + 1) for v in value), default=level + 1)
    return level


def json_schema_grammar(schema: dict[str, Any] | None) -> str:
    """The llguidance grammar of a JSON schema (None: any JSON object); ValueError naming what
    is wrong for a schema too large, too deep or not compilable."""
    import llguidance

    if schema is None:
        schema = {"type": "object"}
    if len(json.dumps(schema)) > MAX_SCHEMA_BYTES:
        raise ValueError(f"the schema is larger than {MAX_SCHEMA_BYTES} bytes")
    if _depth(schema) > MAX_SCHEMA_DEPTH:
        raise ValueError(f"the schema is nested deeper than {MAX_SCHEMA_DEPTH} levels")
    try:
        grammar = str(llguidance.LLMatcher.grammar_from_json_schema(schema))
    except Exception as exc:  # noqa: BLE001 - llguidance's own error says what is wrong
        raise ValueError(f"the schema does not compile: {exc}") from None
    CHECKER.check(grammar)
    return grammar


def lark_grammar(lark: str) -> str:
    """The llguidance grammar of a Lark grammar; ValueError for one that does not compile."""
    import llguidance

    if len(lark.encode()) > MAX_GRAMMAR_BYTES:
        raise GrammarError(f"the grammar is larger than {MAX_GRAMMAR_BYTES} bytes")
    grammar = str(llguidance.LLMatcher.grammar_from_lark(lark))
    CHECKER.check(grammar)
    return grammar


class GrammarChecker:
    """Checks each grammar once, in a child process (``grammar_check``) on a small stack and a
    memory cap, before this process compiles it: a grammar that crashes llguidance or runs past
    ``seconds`` is a GrammarError naming what happened, and the child is started again. The
    digests of grammars that passed are kept, so a gateway's repeated schema costs a lookup."""

    def __init__(self, seconds: float = GRAMMAR_CHECK_SECONDS) -> None:
        self.seconds = seconds
        self._child: subprocess.Popen[bytes] | None = None
        self._passed: OrderedDict[bytes, None] = OrderedDict()
        self._lock = threading.Lock()

    def check(self, grammar: str) -> None:
        body = grammar.encode()
        if len(body) > MAX_GRAMMAR_BYTES:
            raise GrammarError(f"the grammar is larger than {MAX_GRAMMAR_BYTES} bytes")
        digest = hashlib.sha256(body).digest()
        with self._lock:
            if digest in self._passed:
                self._passed.move_to_end(digest)
                return
            problem = self._ask(body)
            if problem:
                raise GrammarError(problem)
            self._passed[digest] = None
            while len(self._passed) > CHECKED_GRAMMARS:
                self._passed.popitem(last=False)

    def _ask(self, body: bytes) -> str:
        child = self._started()
        assert child.stdin is not None and child.stdout is not None
        try:
            write_frame(child.stdin, body)
        except OSError:
            return self._lost("the grammar check's process ended")
        readable, _, _ = select.select([child.stdout], [], [], self.seconds)
        answer = read_frame(child.stdout) if readable else None
        if not readable:
            return self._lost(f"the grammar took longer than {self.seconds:g} s to check")
        if answer is None:
            return self._lost("the grammar crashed llguidance's check of it (too deep or too "
                              "large a grammar)")
        return answer.decode()

    def _started(self) -> subprocess.Popen[bytes]:
        if self._child is not None and self._child.poll() is None:
            return self._child
        root = str(Path(__file__).resolve().parents[2])  # the folder that holds shared/
        path = os.environ.get("PYTHONPATH")
        env = {**os.environ, "PYTHONPATH": root + (os.pathsep + path if path else "")}
        child = subprocess.Popen(  # noqa: S603 - this interpreter, this package's module
            [sys.executable, "-m", "shared.protocol.grammar_check"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, bufsize=0)
        assert child.stdout is not None
        readable, _, _ = select.select([child.stdout], [], [], 60)
        if not readable or read_frame(child.stdout) != b"ready":
            child.kill()
            child.wait()
            raise GrammarError("the grammar check's process did not start")
        self._child = child
        return child

    def _lost(self, what: str) -> str:
        """``what``, with how the child ended; the next check starts a new one."""
        child, self._child = self._child, None
        if child is None:
            return what
        child.kill()
        code = child.wait()
        if code < 0:
            what += f" ({signal.Signals(-code).name} in the check's process)"
        return what

    def close(self) -> None:
        with self._lock:
            if self._child is not None:
                self._child.kill()
                self._child.wait()
                self._child = None


CHECKER = GrammarChecker()
atexit.register(CHECKER.close)


def on_big_stack(work: Callable[[], T]) -> T:
    """``work()`` on a thread with a stack of ``COMPILE_STACK`` bytes (llguidance recurses as
    deep as a grammar's rules chain; the child checked the grammar on a far smaller one)."""
    result: list[T] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            result.append(work())
        except BaseException as exc:  # noqa: BLE001 - raised again on the caller's thread
            failure.append(exc)

    with _stack_lock:
        before = threading.stack_size(COMPILE_STACK)
        try:
            worker = threading.Thread(target=run, name="grammar-compile")
            worker.start()
        finally:
            threading.stack_size(before)
    worker.join()
    if failure:
        raise failure[0]
    return result[0]


_stack_lock = threading.Lock()


class TokenizerCache:
    """llguidance's view of a tokenizer (about a second to build on a 150k vocabulary): built
    once per tokenizer, vocabulary size and EOS ids (a client's, the verifier's)."""

    def __init__(self) -> None:
        # keyed by id, so each entry keeps its tokenizer alive (an id is never reused meanwhile)
        self._built: dict[tuple[int, int, tuple[int, ...]], tuple[Any, Any]] = {}
        self._lock = threading.Lock()

    def get(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> Any:
        """GrammarError for a tokenizer llguidance cannot read (a slow one)."""
        key = (id(tokenizer), vocab_size, tuple(eos_token_ids))
        with self._lock:
            if key not in self._built:
                import llguidance.hf

                try:
                    built = llguidance.hf.from_tokenizer(
                        tokenizer, n_vocab=vocab_size, eos_token=eos_token_ids or None)
                except ValueError as exc:
                    raise GrammarError(f"llguidance cannot read this tokenizer: {exc}") from None
                self._built[key] = (tokenizer, built)
            return self._built[key][1]


LL_TOKENIZERS = TokenizerCache()


def _fresh_matcher(grammar: str, ll_tokenizer: Any) -> Any:
    """A matcher at the grammar's start, compiled now for this generation alone: a matcher
    copied from another shares its lexer with it, so what one generation built would carry over
    into the next (GrammarError naming the problem)."""
    import llguidance

    CHECKER.check(grammar)
    limits = llguidance.LLParserLimits(verbose_errors=False)
    matcher = on_big_stack(lambda: llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0,
                                                        limits=limits))
    if matcher.is_error():
        raise GrammarError(f"the grammar does not compile: {matcher.get_error()}")
    return matcher


class Constraint:
    """One generation's grammar state: the masks of a block's rows, and the committed tokens."""

    def __init__(self, grammar: str, ll_tokenizer: Any, vocab_size: int,
                 eos_ids: list[int]) -> None:
        self.matcher = _fresh_matcher(grammar, ll_tokenizer)
        self.vocab_size, self.eos_ids = vocab_size, frozenset(eos_ids)
        words = (vocab_size + 31) // 32
        self._bits = np.zeros(words, dtype=np.int32)
        self._rows: dict[tuple[int, ...], np.ndarray | None] = {}  # this block's, by drafts

    @classmethod
    def of(cls, grammar: str, tokenizer: Any, vocab_size: int,
           eos_ids: list[int]) -> Constraint:
        """A fresh state of ``grammar`` over a Hugging Face tokenizer (GrammarError: it does
        not compile)."""
        return cls(grammar, LL_TOKENIZERS.get(tokenizer, vocab_size, eos_ids), vocab_size,
                   eos_ids)

    def allowed(self) -> np.ndarray:
        """[vocab] bool: the tokens the grammar allows next."""
        # straight into our buffer (llguidance.torch's helper does the same, after compiling
        # a kernel at import that this never needs)
        self.matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        if self.matcher.is_error():  # a lexer or parser limit: its mask would allow EOS alone
            raise GrammarDeadEnd(f"the grammar cannot go on: {_first_line(self.matcher)}")
        bits = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[:self.vocab_size]
        return bits.astype(bool)

    def allowed_after(self, drafts: list[int]) -> np.ndarray | None:
        """[vocab] bool: the tokens the grammar allows after the committed sequence and
        ``drafts``; None where it refuses one of them (or ended before one). Kept until the
        next commit: a model drafter asks for each row as it drafts, the block's masks reuse
        them."""
        key = tuple(drafts)
        if key not in self._rows:
            self._rows[key] = self._row_after(drafts)
        return self._rows[key]

    def _row_after(self, drafts: list[int]) -> np.ndarray | None:
        if drafts:  # a token is consumed only where the row before allows it
            before = self.allowed_after(drafts[:-1])
            if before is None or not before[drafts[-1]]:
                return None
            if drafts[-1] in self.eos_ids:
                return None  # nothing follows an EOS (and llguidance takes one EOS id alone)
        consumed = 0
        try:
            for token in drafts:
                if self.matcher.is_stopped() or not self.matcher.consume_token(token):
                    return None
                consumed += 1
            return self.allowed()
        finally:
            if consumed:
                self.matcher.rollback(consumed)

    def block(self, drafts: list[int]) -> tuple[int, list[RowMask]]:
        """(how many of ``drafts`` the grammar keeps, the masks of rows 0..that many): the
        drafts up to the first one the grammar refuses, and a mask per row they give."""
        masks = []
        for i in range(len(drafts) + 1):
            allowed = self.allowed_after(drafts[:i])
            if allowed is None:
                break
            if i == 0 and not allowed.any():
                raise GrammarDeadEnd("no token of this vocabulary can continue the grammar "
                                     "here")
            masks.append(RowMask.of(allowed))
        return len(masks) - 1, masks

    def commit(self, tokens: list[int]) -> None:
        """The committed sequence grew by ``tokens`` (each allowed where it came; an EOS
        after the grammar's end is its end). GrammarDeadEnd where llguidance refuses a token
        its own mask allowed (an id it reads as no text, such as ``<unk>``, where the grammar
        has no other way on); GrammarError for a token the mask did not allow."""
        rows, self._rows = self._rows, {}
        for i, token in enumerate(tokens):
            if self.matcher.is_stopped() and token in self.eos_ids:
                continue
            if not self.matcher.consume_token(token):
                row = rows.get(tuple(tokens[:i]))
                if row is not None and row[token]:
                    raise GrammarDeadEnd(f"the grammar cannot go on: llguidance allowed token "
                                         f"{token} there, then refused it "
                                         f"({_first_line(self.matcher)})")
                raise GrammarError(f"token {token}, which the grammar does not allow there "
                                   f"({_first_line(self.matcher)})")


def _first_line(matcher: Any) -> str:
    return str(matcher.get_error()).strip().split("\n", 1)[0]
