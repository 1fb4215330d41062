"""`specdec chat` through a pseudo-terminal: answers stream in colour and equal the target's
greedy output, slash commands change the settings, the target-alone comparison runs."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pexpect
import pytest

from drafter_client.api import SpecDecClient
from tests.support.live_server import LiveServer

ANSI = re.compile(r"\x1b\[[0-9;]*m")
PROMPT = "> "


def spawn(url: str, drafter: Path, *extra: str) -> pexpect.spawn:
    child = pexpect.spawn(sys.executable, ["-m", "drafter_client.apps.cli", "chat",
                                           "--verifier-url",
                                           url, "--drafter", str(drafter), "--max-new-tokens",
                                           "16", *extra], encoding="utf-8", timeout=60,
                          dimensions=(50, 400), env={"PYTHONUNBUFFERED": "1", "TERM": "xterm",
                                                     "PATH": "/usr/bin:/bin"})
    child.expect_exact(PROMPT)
    return child


def answer(child: pexpect.spawn, line: str) -> str:
    """What the console printed for one line, up to its next prompt."""
    child.sendline(line)
    child.expect_exact(PROMPT)
    printed: str = child.before
    return printed.split("\r\n", 1)[1] if "\r\n" in printed else printed  # drop the echo


@pytest.mark.slow  # the console in a pseudo-terminal against a verifier process
def test_chat_console_streams_in_colour_and_obeys_commands(
        gpt2_server: LiveServer, tiny_models: dict[str, Path]) -> None:
    drafter = tiny_models["gpt2-drafter"]
    reference = SpecDecClient(gpt2_server.url, str(drafter))
    first = reference.generate("the cat sat", chat=True, max_new_tokens=16)
    conversation = [{"role": "user", "content": "the cat sat"},
                    {"role": "assistant", "content": first.text},
                    {"role": "user", "content": "a dog ran"}]
    second = reference.generate(reference.encode_chat(conversation), max_new_tokens=16)

    child = spawn(gpt2_server.url, drafter)
    banner = child.before
    assert "\x1b[32m" in banner and "accepted" in banner  # the legend, in colour on a TTY
    shown = answer(child, "the cat sat")
    assert "\x1b[" in shown  # coloured tokens
    plain = ANSI.sub("", shown)
    assert plain.startswith(first.text)  # the target's greedy answer, exactly
    assert f"[{len(first.token_ids)} tokens" in plain
    # the second turn answers the whole conversation
    assert ANSI.sub("", answer(child, "a dog ran")).startswith(second.text)

    assert "k = 2" in answer(child, "/k 2")
    # the default drafter is the hybrid (lookup + model): the setting reaches its model
    assert "draft min prob = 0.3" in answer(child, "/draft-min-prob 0.3")
    assert "error" in answer(child, "/k zero")
    assert "error" in answer(child, "/temperature -1")
    # a settings field's own bound, said in one line that names the field
    assert "error: /seed: seed: Input should be less than" in answer(child, f"/seed {2**63}")
    assert "error: /max-tokens: max_new_tokens:" in answer(child, "/max-tokens 0")
    assert "compare with the target alone: on" in answer(child, "/compare")
    assert "new conversation" in answer(child, "/reset")
    compared = ANSI.sub("", answer(child, "the cat sat"))
    assert compared.startswith(first.text)  # k and min prob changed, greedy output did not
    assert "target alone" in compared and "identical output" in compared
    assert "verify calls" in answer(child, "/metrics")
    assert "unknown command" in answer(child, "/frobnicate")
    assert "temperature = 0.7" in answer(child, "/temperature 0.7")
    sampled = ANSI.sub("", answer(child, "the big"))
    assert re.search(r"\[\d+ tokens", sampled)
    child.sendline("/quit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_no_color_and_end_of_input(gpt2_server: LiveServer,
                                   tiny_models: dict[str, Path]) -> None:
    child = spawn(gpt2_server.url, tiny_models["gpt2-drafter"], "--no-color", "--drafter",
                  "ngram")
    shown = answer(child, "the cat sat")
    assert "\x1b[" not in shown and "tokens" in shown
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


@pytest.mark.parametrize("flag", [["-k", "0.5"], ["--temperature", "-1"]])
def test_bad_flags_exit_2(gpt2_server: LiveServer, tiny_models: dict[str, Path],
                          flag: list[str]) -> None:
    child = pexpect.spawn(sys.executable, ["-m", "drafter_client.apps.cli", "chat",
                                           "--verifier-url",
                                           gpt2_server.url, "--drafter", "ngram", *flag],
                          encoding="utf-8", timeout=60)
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 2
    assert "error" in child.before


def test_a_line_that_is_not_utf8_is_an_error_and_the_console_goes_on(
        gpt2_server: LiveServer) -> None:
    """Piped input: a line with a byte that is not UTF-8 gets one error line; the next line
    is answered and end of input exits 0 (it was a traceback)."""
    import subprocess

    run = subprocess.run([sys.executable, "-m", "drafter_client.apps.cli", "chat",
                          "--verifier-url", gpt2_server.url, "--drafter", "ngram",
                          "--max-new-tokens", "4", "--no-color"],
                         input=b"the \xff cat\nthe cat sat\n", capture_output=True, timeout=120)
    out = run.stdout.decode("utf-8", "replace")
    assert run.returncode == 0 and b"Traceback" not in run.stderr, run.stderr
    assert "is not UTF-8 text (byte 0xff" in out and "tokens" in out.split("UTF-8", 1)[1]
