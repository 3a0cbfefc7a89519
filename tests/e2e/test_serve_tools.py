"""Agents' and SDKs' paths with the official openai client against a live ``dflash2 serve``: a tool-calling loop,
json_schema replies that validate, streamed tool-call deltas, logprobs equal with and without drafts, and the
browser path (a CORS preflight, a cross-origin POST). SmolLM2 (marker ``model``); the default target ``qwen``."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.e2e.conftest import QWEN_TARGET, SMOLLM2
from tests.e2e.serve_fixture import start_server, stop_server

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

ORIGIN = "https://app.example"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "languages": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "languages"], "additionalProperties": False}
EXTRACT = [{"role": "user", "content": "Extract the person as JSON: Ada Lovelace, 36, wrote about Analytical "
                                       "Engine programs in English and French."}]
ASK = [{"role": "user", "content": "What's the weather like in Paris right now?"}]


def live(model: str, *extra: str):
    server = start_server(model, "--max-batch-size", "2", "--kv-memory-mb", "256", "--max-tokens", "256",
                          "--allowed-origins", ORIGIN, *extra)
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=server.api_key, max_retries=0, timeout=600)
    return server, client


@pytest.fixture(scope="module", params=[
    pytest.param(SMOLLM2, marks=pytest.mark.model, id="smollm2"),
    pytest.param(QWEN_TARGET, marks=[pytest.mark.qwen, pytest.mark.slow], id="qwen-1.5b"),
])
def served(request):
    server, client = live(request.param)
    yield server, client
    stop_server(server)


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema, "strict": True}}


def test_json_schema_replies_validate_and_match_plain_decoding(served):
    server, client = served
    replies = {}
    for drafter in ("none", None):  # None: the server's default drafter
        extra = {} if drafter is None else {"dflash2": {"drafter": drafter}}
        reply = client.chat.completions.create(model=server.model, messages=EXTRACT, temperature=0, max_tokens=120,
                                               response_format=schema_format(PERSON), extra_body=extra)
        assert reply.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(reply.choices[0].message.content), PERSON)
        replies[drafter] = reply.choices[0].message.content
    assert replies["none"] == replies[None]
    ask = [{"role": "user", "content": "Give a JSON object with the keys name and age for Ada Lovelace, aged 36."}]
    loose = client.chat.completions.create(model=server.model, messages=ask, temperature=0, max_tokens=120,
                                           response_format={"type": "json_object"})
    assert loose.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(loose.choices[0].message.content), dict)


def test_a_tool_calling_loop(served):
    """The model must call get_weather (a named tool_choice, enforced by the grammar), gets the result, answers."""
    server, client = served
    tools = [WEATHER, TIME]
    first = client.chat.completions.create(model=server.model, messages=ASK, tools=tools, temperature=0,
                                           max_tokens=100, tool_choice={"type": "function",
                                                                        "function": {"name": "get_weather"}})
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    messages = [*ASK, choice.message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "clear"})}]
    answer = client.chat.completions.create(model=server.model, messages=messages, tools=tools, temperature=0,
                                            max_tokens=60, tool_choice="none")
    assert answer.choices[0].finish_reason in ("stop", "length") and answer.choices[0].message.content
    required = client.chat.completions.create(model=server.model, messages=ASK, tools=tools, temperature=0,
                                              max_tokens=100, tool_choice="required")
    assert required.choices[0].message.tool_calls[0].function.name in ("get_weather", "get_time")


def test_streamed_tool_call_deltas_add_up_to_the_call(served):
    server, client = served
    args = dict(model=server.model, messages=ASK, tools=[WEATHER], temperature=0, max_tokens=100,
                tool_choice="required")
    whole = client.chat.completions.create(**args).choices[0].message.tool_calls[0]
    calls: dict[int, dict] = {}
    reasons = []
    for chunk in client.chat.completions.create(**args, stream=True):
        delta = chunk.choices[0].delta
        reasons.append(chunk.choices[0].finish_reason)
        for part in delta.tool_calls or []:
            entry = calls.setdefault(part.index, {"name": "", "arguments": ""})
            entry["name"] += part.function.name or ""
            entry["arguments"] += part.function.arguments or ""
    assert reasons[-1] == "tool_calls" and list(calls) == [0]
    assert calls[0]["name"] == whole.function.name
    assert json.loads(calls[0]["arguments"]) == json.loads(whole.function.arguments)


def test_logprobs_are_the_same_with_and_without_drafts(served):
    server, client = served
    got = {}
    for drafter in ("none", None):
        extra = {} if drafter is None else {"dflash2": {"drafter": drafter}}
        reply = client.chat.completions.create(model=server.model, messages=EXTRACT, temperature=0, max_tokens=40,
                                               logprobs=True, top_logprobs=3, extra_body=extra)
        got[drafter] = [(e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs])
                        for e in reply.choices[0].logprobs.content]
        if drafter is None:
            assert reply.model_extra["dflash2"]["drafter"] != "none"
    assert len(got["none"]) == 40 and got["none"] == got[None]  # bitwise: row-invariant kernels
    streamed = []
    for chunk in client.chat.completions.create(model=server.model, messages=EXTRACT, temperature=0, max_tokens=40,
                                                logprobs=True, top_logprobs=3, stream=True):
        if chunk.choices and chunk.choices[0].logprobs:
            streamed += [(e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs])
                         for e in chunk.choices[0].logprobs.content]
    assert streamed == got["none"]


def test_a_browser_page_on_an_allowed_origin(served):
    server, _ = served
    preflight = httpx.options(f"{server.base_url}/v1/chat/completions", headers={
        "origin": ORIGIN, "access-control-request-method": "POST",
        "access-control-request-headers": "authorization, content-type"}, timeout=30)
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == ORIGIN
    assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
    post = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=120, headers={
        "origin": ORIGIN, "authorization": f"Bearer {server.api_key}"},
        json={"model": server.model, "messages": ASK, "max_tokens": 4})
    assert post.status_code == 200 and post.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=30, headers={
        "origin": "https://evil.example", "authorization": f"Bearer {server.api_key}"},
        json={"model": server.model, "messages": ASK, "max_tokens": 4})
    assert other.status_code == 403 and "access-control-allow-origin" not in other.headers
