"""The client against a verifier that answers nonsense (issue #12, client side): every bad reply
is one line with the documented exit code, partial output kept; finish_reason says why a
generation ended."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from drafter_client import SpecDecClient, SpecDecError
from shared.models.catalog import load_tokenizer, tokenizer_fingerprint
from tests.support.live_server import LiveServer

BIN = Path(sys.executable).parent
GOOD_VERIFY = {"num_accepted": 0, "target_logprobs": None, "target_argmax": [7, 7, 7, 7, 7],
               "next_token": 7, "row": None, "forward_ms": 1.0}


class EvilVerifier:
    """Answers /v1/info truthfully (unless told otherwise), then ``verify_replies`` in turn."""

    def __init__(self, fingerprint: str, info: dict[str, Any] | None = None,
                 verify_replies: list[dict[str, Any]] | None = None,
                 generate_reply: dict[str, Any] | None = None) -> None:
        self.info = {"protocol_version": 1, "model": "evil", "vocab_size": 64,
                     "tokenizer_fingerprint": fingerprint, "eos_token_ids": [1],
                     "max_context": 256, "max_draft_tokens": 8, "max_new_tokens": 64,
                     "dtype": "float32", "device": "cpu", **(info or {})}
        self.verify_replies = list(verify_replies or [])
        self.generate_reply = generate_reply or {}
        self.position = 0
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def answer(self, status: int, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802
                self.answer(200, owner.info)

            def do_DELETE(self) -> None:  # noqa: N802
                self.send_response(204)
                self.end_headers()

            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                if self.path == "/v1/sessions":
                    owner.position = len(body["prompt_ids"])
                    self.answer(200, {"session_id": body["session_id"],
                                      "position": owner.position, "prefill_ms": 1.0})
                elif self.path == "/v1/generate":
                    self.answer(200, {"forward_ms": 1.0, "forward_calls": 1,
                                      **owner.generate_reply})
                else:
                    reply = owner.verify_replies.pop(0) if owner.verify_replies else GOOD_VERIFY
                    reply = {"position": body["position"] + 1, **reply}
                    self.answer(200, reply)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> EvilVerifier:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()


@pytest.fixture(scope="module")
def fingerprint(tiny_models: dict[str, Path]) -> str:
    return tokenizer_fingerprint(load_tokenizer(str(tiny_models["gpt2-target"])))


BAD_VERIFY = {
    "next_token past the vocabulary": {**GOOD_VERIFY, "next_token": 99999},
    "negative next_token": {**GOOD_VERIFY, "next_token": -5},
    "next_token past 64 bits": {**GOOD_VERIFY, "next_token": 2**70},
    "short target_argmax": {**GOOD_VERIFY, "target_argmax": [7]},
    "accepted more than drafted": {**GOOD_VERIFY, "num_accepted": 9},
    "neither token nor row": {**GOOD_VERIFY, "next_token": None},
    "a broken row": {**GOOD_VERIFY, "next_token": None,
                     "row": {"ids": None, "probs": "not base64!"}},
}


@pytest.mark.parametrize("case", list(BAD_VERIFY))
def test_bad_verify_replies_are_one_clear_error(case: str, fingerprint: str,
                                                tiny_models: dict[str, Path]) -> None:
    with EvilVerifier(fingerprint, verify_replies=[BAD_VERIFY[case]]) as evil:
        client = SpecDecClient(evil.url, "ngram", tokenizer=str(tiny_models["gpt2-target"]),
                               retry_budget_s=1)
        with pytest.raises(SpecDecError) as err:
            client.generate([2, 3, 4], num_draft_tokens=4, max_new_tokens=8)
    assert "\n" not in str(err.value)
    assert err.value.partial is not None and err.value.partial.token_ids == []
    assert err.value.partial.finish_reason == "error"


def test_bad_info_is_one_clear_error(fingerprint: str, tiny_models: dict[str, Path]) -> None:
    for info in ({"vocab_size": 0}, {"eos_token_ids": [100]}, {"max_context": -1}):
        with EvilVerifier(fingerprint, info=info) as evil, pytest.raises(SpecDecError):
            SpecDecClient(evil.url, "ngram", tokenizer=str(tiny_models["gpt2-target"]),
                          retry_budget_s=1)


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    import os

    return subprocess.run([str(BIN / "specdec"), *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})})


@pytest.mark.slow  # one CLI process per exit code
def test_cli_exit_codes_and_partial_output(fingerprint: str,
                                           tiny_models: dict[str, Path]) -> None:
    tokenizer = str(tiny_models["gpt2-target"])
    # Nothing generated: exit 2, one line.
    with EvilVerifier(fingerprint, verify_replies=[BAD_VERIFY["short target_argmax"]]) as evil:
        run = run_cli("generate", "--verifier-url", evil.url, "--drafter", "ngram",
                      "--tokenizer", tokenizer, "--prompt", "the cat sat", "--json",
                      "--retry-budget-s", "1")
    assert run.returncode == 2, run.stderr
    assert len(run.stderr.strip().splitlines()) == 1 and "Traceback" not in run.stderr
    # Two good blocks, then nonsense: exit 3, the two tokens on stdout.
    with EvilVerifier(fingerprint, verify_replies=[GOOD_VERIFY, GOOD_VERIFY,
                                                   BAD_VERIFY["next_token past the vocabulary"]]
                      ) as evil:
        run = run_cli("generate", "--verifier-url", evil.url, "--drafter", "ngram",
                      "--tokenizer", tokenizer, "--prompt", "the cat sat", "--json",
                      "-k", "0", "--retry-budget-s", "1")
    assert run.returncode == 3, run.stderr
    out = json.loads(run.stdout)
    assert out["token_ids"] == [7, 7] and out["partial"] is True
    assert out["finish_reason"] == "error" and "Traceback" not in run.stderr
    # A baseline reply outside the vocabulary: exit 2.
    with EvilVerifier(fingerprint, generate_reply={"token_ids": [5, 64]}) as evil:
        run = run_cli("baseline", "--verifier-url", evil.url, "--tokenizer", tokenizer,
                      "--prompt", "the cat sat", "--retry-budget-s", "1")
    assert run.returncode == 2 and "invalid reply" in run.stderr


@pytest.mark.parametrize(("flags", "env", "words"), [
    (["--temperature", "nan"], {}, "--temperature"),
    (["--temperature", "-1"], {}, "--temperature"),
    (["--top-p", "0"], {}, "--top-p"),
    (["--max-new-tokens", "0"], {}, "--max-new-tokens"),
    ([], {"SPECDEC_API_KEY": "cl\u00e9-\u043a\u043b\u044e\u0447"}, "API key"),
])
def test_cli_bad_arguments_are_one_line(flags: list[str], env: dict[str, str],
                                        words: str) -> None:
    run = run_cli("baseline", "--verifier-url", "http://127.0.0.1:9", "--prompt", "x", *flags,
                  env=env)
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0] and "Traceback" not in run.stderr


def test_finish_reasons(gpt2_server: LiveServer, tiny_models: dict[str, Path]) -> None:
    client = SpecDecClient(gpt2_server.url, str(tiny_models["gpt2-drafter"]), dtype="float32")
    context = client.info.max_context  # 256 for the tiny GPT-2
    long_prompt = [2 + i % 40 for i in range(context - 8)]
    for generate in (lambda **kw: client.generate(long_prompt, num_draft_tokens=3, **kw),
                     lambda **kw: client.baseline(long_prompt, **kw)):
        near_limit = generate(max_new_tokens=40)
        eos = near_limit.token_ids and near_limit.token_ids[-1] in client.info.eos_token_ids
        assert near_limit.finish_reason == ("stop" if eos else "context")
        assert len(near_limit.token_ids) <= 9
        assert generate(max_new_tokens=2).finish_reason in ("length", "stop")


@pytest.mark.parametrize(("case", "words"), [
    ("--prompt not UTF-8", "--prompt is not UTF-8 text (byte 0xff at offset 4)"),
    ("stdin not UTF-8", "standard input is not UTF-8 text (byte 0xfe at offset 2)"),
    ("--prompt-file missing", "No such file or directory"),
    ("--prompt-file a directory", "Is a directory"),
    ("--prompt-file not UTF-8", "is not UTF-8 text (byte 0xe9 at offset 3)"),
    ("--verifier-url unparsable", "is not a valid URL"),
    ("--verifier-url without a scheme", "needs http:// or https://"),
])
@pytest.mark.parametrize("command", ["generate", "baseline"])
def test_cli_input_and_url_errors_are_one_line(case: str, words: str, command: str,
                                               tmp_path: Path) -> None:
    """Read before anything connects: one line naming the source, exit 2, no traceback."""
    (tmp_path / "latin1.txt").write_bytes("caf\u00e9 au lait".encode("latin-1"))
    flags = {"--prompt not UTF-8": ["--prompt", "abc \udcff"],  # argv byte 0xff
             "stdin not UTF-8": ["--prompt-file", "-"],
             "--prompt-file missing": ["--prompt-file", str(tmp_path / "absent.txt")],
             "--prompt-file a directory": ["--prompt-file", str(tmp_path)],
             "--prompt-file not UTF-8": ["--prompt-file", str(tmp_path / "latin1.txt")],
             "--verifier-url unparsable": ["--prompt", "x", "--verifier-url", "http://[::1"],
             "--verifier-url without a scheme": ["--prompt", "x", "--verifier-url",
                                                 "127.0.0.1:8000"]}[case]
    drafter = ["--drafter", "ngram"] if command == "generate" else []
    run = subprocess.run([str(BIN / "specdec"), command, "--verifier-url", "http://127.0.0.1:9",
                          *drafter, *flags], input=b"ok\xfe\n", capture_output=True,
                         timeout=120)
    stderr = run.stderr.decode("utf-8", "replace")
    assert run.returncode == 2, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0] and "Traceback" not in stderr, stderr
