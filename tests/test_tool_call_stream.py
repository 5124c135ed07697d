"""Streamed chat answers with tool calls: content up to the call's tag (a tag split across deltas is
held back, never sent as content), then each call as one `tool_calls` delta once its block is whole."""

from __future__ import annotations

import json

import pytest

from draftwise.server.tools import ToolCallStream
from draftwise.structured.tool_calls import holdback

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'


def stream(text: str, size: int) -> list[dict]:
    calls = ToolCallStream()
    pieces = [text[i:i + size] for i in range(0, len(text), size)]
    return [delta for i, piece in enumerate(pieces) for delta in calls.feed(piece, finished=i == len(pieces) - 1)]


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_text_then_a_call_stream_as_content_then_one_call(size):
    deltas = stream("Let me look. " + CALL, size)
    content = "".join(delta.get("content", "") for delta in deltas)
    calls = [call for delta in deltas for call in delta.get("tool_calls", [])]
    assert content == "Let me look. " and "<" not in content
    assert [(c["index"], c["function"]["name"]) for c in calls] == [(0, "get_weather")]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris", "days": 2}
    assert calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"


def test_two_calls_are_numbered_in_order():
    second = CALL.replace("get_weather", "get_time").replace('"city": "Paris", "days": 2', '"zone": "UTC"')
    calls = [call for delta in stream(CALL + "\n" + second, 5) for call in delta.get("tool_calls", [])]
    assert [(c["index"], c["function"]["name"]) for c in calls] == [(0, "get_weather"), (1, "get_time")]


def test_a_partial_tag_is_held_back_until_the_text_says_what_it_is():
    calls = ToolCallStream()
    assert calls.feed("a < b and <tool", finished=False) == [{"content": "a < b and "}]
    assert calls.feed("s are fine", finished=False) == [{"content": "<tools are fine"}]
    assert calls.feed(" <tool_c", finished=True) == [{"content": " <tool_c"}]  # the end: nothing is a call
    assert not calls.called


@pytest.mark.parametrize("text, held", [("abc", 0), ("abc<", 1), ("abc<tool_", 6), ("<tool_call", 10),
                                        ("<tool_call>", 0), ("a <b", 0)])
def test_holdback_counts_the_characters_that_may_open_a_call(text, held):
    assert holdback(text) == held


@pytest.mark.parametrize("size", [1, 4, 1000])
def test_a_call_cut_off_at_the_end_streams_as_the_content_a_whole_answer_has(size):
    """A call the answer never finished (max_tokens) is no call: the non-streamed answer's content is
    all its text (`answer_message`), and so is the stream's."""
    from draftwise.server.tools import answer_message

    cut = "Sure. " + CALL[:40]
    deltas = stream(cut, size)
    assert "".join(delta.get("content", "") for delta in deltas) == cut == answer_message(cut)[0]["content"]
    assert not any("tool_calls" in delta for delta in deltas)


@pytest.mark.parametrize("text", ["Sure.\n" + CALL, "A <tool_call>{oops}</tool_call> B " + CALL, CALL])
def test_streamed_content_is_the_unstreamed_messages_content(text):
    """Content ends at the first `<tool_call>` in both, whitespace kept (it was stripped unstreamed,
    and cut at the first valid call, so a stream lost text the message kept)."""
    from draftwise.server.tools import answer_message

    message, calls_tools = answer_message(text)
    streamed = "".join(delta.get("content", "") for delta in stream(text, 4))
    assert calls_tools and streamed == (message["content"] or "")
