"""Which requests the gateway tokenizes off its event loop: a chat's cost counts its messages,
not only their characters (a chat of 31,000 empty messages stalled the loop for 1.4 s)."""

from __future__ import annotations

from drafter_client.gateway.engine import INLINE_TOKENIZE_CHARS, tokenize_cost
from drafter_client.gateway.schema import ChatCompletionRequest, CompletionRequest


def chat(messages: int, content: str = "") -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": content}] * messages})


def test_many_empty_messages_go_off_the_event_loop() -> None:
    assert tokenize_cost(chat(31_000)) > INLINE_TOKENIZE_CHARS
    # the characters alone (what decided before) would have kept it on the loop
    assert sum(len(m.text()) for m in chat(31_000).messages) == 0


def test_a_short_chat_and_a_short_prompt_stay_inline() -> None:
    assert tokenize_cost(chat(3, "hello there")) <= INLINE_TOKENIZE_CHARS
    prompt = CompletionRequest.model_validate({"model": "m", "prompt": "x" * 100})
    assert tokenize_cost(prompt) == 100
    long = CompletionRequest.model_validate({"model": "m", "prompt": "x" * 9000})
    assert tokenize_cost(long) > INLINE_TOKENIZE_CHARS
