"""The fenced-JSON fallback of tool-call parsing (serve/tools.py): a reply without ``<tool_call>`` tags whose fenced
JSON block calls an offered tool becomes that call, whole and streamed whatever the chunking; JSON that names no
offered tool, or any fence once a tagged call came, stays content."""

from __future__ import annotations

import json

import pytest

from dflash2.serve.tools import ToolCallStream, parse_reply

CALL = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}'
FENCED = f"I'll check.\n```json\n{CALL}\n```\n"
NAMES = ("get_weather", "get_time")


def test_a_fenced_call_of_an_offered_tool_is_a_call():
    parsed = parse_reply(FENCED, NAMES)
    assert parsed.content == "I'll check."
    assert [c["function"]["name"] for c in parsed.tool_calls] == ["get_weather"]
    assert json.loads(parsed.tool_calls[0]["function"]["arguments"]) == {"city": "Paris", "unit": "C"}
    bare = parse_reply(f"```\n{CALL}\n```", NAMES)  # no language tag
    assert bare.content is None and len(bare.tool_calls) == 1


@pytest.mark.parametrize("text", [
    FENCED.replace("get_weather", "delete_everything"),  # not an offered tool
    '```json\n{"city": "Paris"}\n```',  # JSON, but no call
    "```python\nprint('hi')\n```",  # code
])
def test_other_fenced_blocks_stay_content(text):
    parsed = parse_reply(text, NAMES)
    assert parsed.tool_calls == [] and parsed.content == text


def test_tagged_calls_win_and_no_names_means_no_fallback():
    tagged = f"<tool_call>{CALL.replace('weather', 'time')}</tool_call>\n{FENCED}"
    parsed = parse_reply(tagged, NAMES)
    assert [c["function"]["name"] for c in parsed.tool_calls] == ["get_time"]
    assert "```json" in parsed.content
    assert parse_reply(FENCED).tool_calls == []


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_streamed_fenced_calls_whatever_the_chunking(size):
    text = "Sure `x` here:\n" + FENCED + "```python\nprint(1)\n```\nbye ``"
    stream, content, calls = ToolCallStream(NAMES), [], []
    for start in range(0, len(text), size):
        piece, found = stream.push(text[start : start + size])
        content.append(piece)
        calls.extend(found)
    content.append(stream.flush())
    assert [c["function"]["name"] for c in calls] == ["get_weather"] and calls[0]["index"] == 0
    joined = "".join(content)
    assert joined.startswith("Sure `x` here:\nI'll check.\n") and CALL not in joined
    assert joined.endswith("```python\nprint(1)\n```\nbye ``")
    assert ToolCallStream().push(FENCED) == (FENCED, [])  # no offered names: plain content
