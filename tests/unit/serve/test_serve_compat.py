"""What SDKs and browsers need from the server, in-process over a tiny random model: inert fields accepted and
logged, unknown ones refused by name, max_tokens defaults and caps, CORS preflight and headers, logprobs (the same
with and without drafts, streamed or whole), tool messages accepted; tool-call parsing, whole and streamed."""

from __future__ import annotations

import json
import logging

import pytest

from dflash2.decode.batch import BatchConfig, BatchEngine, request_drafters
from dflash2.decode.engine import Engine
from dflash2.models.loading import load_transformer
from dflash2.serve.tools import ToolCallStream, parse_reply
from tests.unit.serve.test_serve_fuzz import ByteTokenizer

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from dflash2.serve.app import ServerConfig, create_app  # noqa: E402

BODY = {"model": "tiny", "prompt": [5, 6, 7, 5, 6, 7], "max_tokens": 12, "temperature": 0}


@pytest.fixture(scope="module")
def engine(tiny_model_dirs):
    return Engine(load_transformer(tiny_model_dirs["llama"], "fp32", "cpu"), ByteTokenizer(), name="tiny")


@pytest.fixture
def served(engine):
    batches = []

    def make(**config) -> TestClient:
        batch = BatchEngine(engine, BatchConfig(num_blocks=80, block_size=16, adaptive_drafts=False),
                            request_drafters(engine, 4))
        batch.start()
        batches.append(batch)
        server = ServerConfig(model_name="tiny", default_drafter="ngram", default_num_draft_tokens=4, **config)
        return TestClient(create_app(batch, server))

    yield make
    for batch in batches:
        batch.stop()


def test_inert_fields_are_accepted_and_logged_unknown_ones_refused(served, caplog):
    client = served()
    inert = {"store": True, "metadata": {"run": "a"}, "user": "u1", "service_tier": "auto",
             "parallel_tool_calls": True, "stream_options": None}
    with caplog.at_level(logging.INFO, logger="dflash2.serve"):
        ok = client.post("/v1/completions", json=BODY | inert)
    assert ok.status_code == 200, ok.text
    lines = [r.getMessage() for r in caplog.records if "ignored fields" in r.getMessage()]
    assert len(lines) == 1 and all(name in lines[0] for name in ("store", "metadata", "user", "service_tier"))
    refused = client.post("/v1/completions", json=BODY | {"reasoning_effort": "high"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "reasoning_effort"
    assert "reasoning_effort" in refused.json()["error"]["message"]
    penalty = client.post("/v1/completions", json=BODY | {"presence_penalty": 0.5})
    assert penalty.status_code == 400 and penalty.json()["error"]["param"] == "presence_penalty"


def test_max_tokens_omitted_runs_to_the_cap_or_the_context(served, engine):
    capped = served(max_tokens=7)
    body = {k: v for k, v in BODY.items() if k != "max_tokens"}
    assert capped.post("/v1/completions", json=body).json()["usage"]["completion_tokens"] == 7
    over = capped.post("/v1/completions", json=BODY | {"max_tokens": 8})
    assert over.status_code == 400 and over.json()["error"]["param"] == "max_tokens"
    whole = served().post("/v1/completions", json=body).json()  # no EOS: to the end of the context
    assert whole["usage"]["completion_tokens"] == engine.max_context - len(BODY["prompt"])
    assert whole["choices"][0]["finish_reason"] == "length"


def test_cors_preflight_and_headers(served):
    client = served()
    preflight = {"origin": "http://localhost:5173", "access-control-request-method": "POST",
                 "access-control-request-headers": "authorization, content-type"}
    answer = client.options("/v1/completions", headers=preflight)
    assert answer.status_code == 200
    assert answer.headers["access-control-allow-origin"] == "http://localhost:5173"
    assert "POST" in answer.headers["access-control-allow-methods"]
    post = client.post("/v1/completions", json=BODY, headers={"origin": "http://localhost:5173"})
    assert post.status_code == 200 and post.headers["access-control-allow-origin"] == "http://localhost:5173"
    foreign = client.options("/v1/completions", headers=preflight | {"origin": "https://evil.example"})
    assert foreign.status_code == 403 and "access-control-allow-origin" not in foreign.headers
    anyone = served(allowed_origins=("*",))
    post = anyone.post("/v1/completions", json=BODY, headers={"origin": "https://app.example"})
    assert post.status_code == 200 and post.headers["access-control-allow-origin"] == "*"


def streamed(client, body) -> list[dict]:
    with client.stream("POST", "/v1/completions", json=body | {"stream": True}) as response:
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    return [json.loads(line) for line in lines if line != "[DONE]"]


def test_logprobs_are_the_same_with_and_without_drafts_streamed_or_whole(served):
    client = served()
    body = BODY | {"logprobs": 3, "max_tokens": 16}
    plain = client.post("/v1/completions", json=body | {"dflash2": {"drafter": "none"}}).json()
    drafted = client.post("/v1/completions", json=body).json()
    assert drafted["dflash2"]["drafter"] == "ngram" and drafted["dflash2"]["tau"] > 1  # drafts were accepted
    lp_plain, lp_drafted = plain["choices"][0]["logprobs"], drafted["choices"][0]["logprobs"]
    # the same positions and tokens; values to fp32 rounding (this tiny fp32 model's products go through torch,
    # whose sums may round differently for a different number of rows; the real models' kernels are row-invariant
    # and their logprobs are compared bitwise in tests/e2e/test_serve_tools.py)
    assert len(lp_plain["token_logprobs"]) == 16 and lp_plain["tokens"] == lp_drafted["tokens"]
    assert lp_plain["token_logprobs"] == pytest.approx(lp_drafted["token_logprobs"], rel=1e-5)
    assert all(lp <= 0 for lp in lp_plain["token_logprobs"])
    assert all(len(top) == 3 and max(top.values()) >= lp for top, lp in zip(lp_plain["top_logprobs"],
                                                                           lp_plain["token_logprobs"]))
    chunks = [c["choices"][0]["logprobs"] for c in streamed(client, body) if c["choices"][0]["logprobs"]]
    assert sum((c["token_logprobs"] for c in chunks), []) == lp_drafted["token_logprobs"]


def test_chat_logprobs_and_tool_messages(served):
    client = served()
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    body = {"model": "tiny", "messages": messages, "max_tokens": 6, "temperature": 0, "logprobs": True,
            "top_logprobs": 2}  # the tool list itself is too long for this model's context (tests/e2e)
    reply = client.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    content = reply.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 6 and all(len(entry["top_logprobs"]) == 2 for entry in content)
    no_content = client.post("/v1/chat/completions", json=body | {"messages": [{"role": "user", "content": None}]})
    assert no_content.status_code == 400
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    bad_choice = client.post("/v1/chat/completions", json=body | {"tools": tools, "tool_choice": {
        "type": "function", "function": {"name": "nope"}}})
    assert bad_choice.status_code == 400 and bad_choice.json()["error"]["param"] == "tool_choice"


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_parse_reply_splits_text_and_calls():
    parsed = parse_reply(f"Let me check.\n{CALL}\n{CALL.replace('Paris', 'Rome')}")
    assert parsed.content == "Let me check."
    assert [json.loads(c["function"]["arguments"]) for c in parsed.tool_calls] == [{"city": "Paris"},
                                                                                  {"city": "Rome"}]
    assert parsed.tool_calls[0]["function"]["name"] == "get_weather"
    assert parse_reply("<tool_call>not json</tool_call>").tool_calls == []
    as_text = parse_reply('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>').tool_calls
    assert json.loads(as_text[0]["function"]["arguments"]) == {"x": 1}
    assert parse_reply("plain").content == "plain"


@pytest.mark.parametrize("size", [1, 2, 5, 13, 1000])
def test_tool_call_stream_whatever_the_chunking(size):
    text = f"Sure: <tool_ maybe {CALL}{CALL}"
    stream, content, calls = ToolCallStream(), [], []
    for start in range(0, len(text), size):
        piece, found = stream.push(text[start : start + size])
        content.append(piece)
        calls.extend(found)
    content.append(stream.flush())
    assert "".join(content) == "Sure: <tool_ maybe "
    assert [c["index"] for c in calls] == [0, 1]
    assert all(json.loads(c["function"]["arguments"]) == {"city": "Paris"} for c in calls)
