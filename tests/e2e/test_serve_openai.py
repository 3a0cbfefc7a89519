"""The official openai client (and raw HTTP for what it cannot send) against a live ``dflash2 serve``."""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.conftest import SMOLLM2, lean_engine
from tests.e2e.serve_fixture import start_server, stop_server, wait_until

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.model

CHAT = [{"role": "user", "content": "List three colors, one per line."}]


@pytest.fixture(scope="module")
def server():
    live = start_server(SMOLLM2, "--dtype", "fp32", "--max-batch-size", "4", "--kv-memory-mb", "64",
                        "--max-body-bytes", "200000", "--threads", "2")
    yield live
    stop_server(live)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=server.api_key, max_retries=0, timeout=120)


def post(server, path: str, content: bytes, key: bool = True) -> httpx.Response:
    headers = {"content-type": "application/json"}
    if key:
        headers["authorization"] = f"Bearer {server.api_key}"
    return httpx.post(f"{server.base_url}{path}", content=content, headers=headers, timeout=60)


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [SMOLLM2]


def test_the_startup_line_names_the_drafter_auto_chose(server):
    """`auto` is resolved when the server loads (ngram off the default target) and the startup line says so."""
    import threading

    lines: list[str] = []

    def read_until_the_startup_line() -> None:  # printed before /health answered: readline does not wait for it
        for line in server.process.stderr:
            lines.append(line)
            if line.startswith("dflash2: serving"):
                return

    reader = threading.Thread(target=read_until_the_startup_line, daemon=True)
    reader.start()
    reader.join(10)
    assert lines and lines[-1].startswith(f"dflash2: serving {SMOLLM2} on {server.base_url} (drafter ngram, k = 8; ")


def test_greedy_chat_equals_plain_decoding_and_counts_usage(client):
    engine = lean_engine(SMOLLM2, "fp32")
    expected = engine.generate(CHAT, max_new_tokens=24)
    reply = client.chat.completions.create(model=SMOLLM2, messages=CHAT, max_tokens=24, temperature=0)
    assert reply.choices[0].message.content == expected.text
    assert reply.choices[0].finish_reason == ("length" if expected.finish_reason == "length" else "stop")
    assert reply.usage.prompt_tokens == len(expected.prompt_ids)
    assert reply.usage.completion_tokens == len(expected.token_ids)
    assert reply.model_extra["dflash2"]["drafter"] == "ngram"  # the server's default drafter was used


def test_per_request_draft_length_through_extra_body(client):
    plain = client.chat.completions.create(model=SMOLLM2, messages=CHAT, max_tokens=20, temperature=0,
                                           extra_body={"dflash2": {"num_draft_tokens": 0}})
    drafted = client.chat.completions.create(model=SMOLLM2, messages=CHAT, max_tokens=20, temperature=0,
                                             extra_body={"dflash2": {"drafter": "ngram", "num_draft_tokens": 3}})
    assert plain.model_extra["dflash2"]["drafter"] == "none"
    assert drafted.model_extra["dflash2"]["num_draft_tokens"] == 3
    assert plain.choices[0].message.content == drafted.choices[0].message.content


def test_completion_with_stop_string(client):
    reply = client.completions.create(model=SMOLLM2, prompt="1, 2, 3, 4, 5,", max_tokens=30, temperature=0,
                                      stop=[" 8"])
    text = reply.choices[0].text
    assert reply.choices[0].finish_reason == "stop" and " 8" not in text and "7" in text


def test_streaming_chat_matches_the_non_streaming_reply(client):
    whole = client.chat.completions.create(model=SMOLLM2, messages=CHAT, max_tokens=20, temperature=0)
    chunks = list(client.chat.completions.create(model=SMOLLM2, messages=CHAT, max_tokens=20, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_streaming_completion(client):
    stream = client.completions.create(model=SMOLLM2, prompt="def add(a, b):", max_tokens=12, temperature=0.7,
                                       seed=3, stream=True)
    pieces = [c.choices[0] for c in stream]
    assert pieces[-1].finish_reason in ("length", "stop") and "".join(p.text for p in pieces)


@pytest.mark.parametrize("kwargs, error", [
    (dict(model="no-such-model"), "NotFoundError"),
    (dict(max_tokens=-3), "BadRequestError"),
    (dict(n=5), "BadRequestError"),
    (dict(temperature="hot"), "BadRequestError"),
    (dict(top_p=0), "BadRequestError"),
    (dict(presence_penalty=1.0), "BadRequestError"),
    (dict(extra_body={"dflash2": {"drafter": "nope"}}), "BadRequestError"),
    (dict(messages=[]), "BadRequestError"),
])
def test_bad_requests_get_openai_errors(client, kwargs, error):
    args = dict(model=SMOLLM2, messages=CHAT, max_tokens=4) | kwargs
    with pytest.raises(getattr(openai, error)) as caught:
        client.chat.completions.create(**args)
    assert caught.value.body["message"]  # an OpenAI-style {"error": {"message": ...}} body


def test_wrong_api_key_is_refused(server):
    bad = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


@pytest.mark.parametrize("content, status", [
    (b'{"model": "x", "messages": [', 400),  # malformed JSON
    (b'{"model": "\xff\xfe", "messages": []}', 400),  # invalid UTF-8
    (b'[1, 2, 3]', 400),  # not an object
    (b'{"model": "' + b"a" * 300_000 + b'"}', 413),  # over --max-body-bytes
])
def test_malformed_bodies_get_json_errors(server, content, status):
    response = post(server, "/v1/chat/completions", content)
    assert response.status_code == status and response.json()["error"]["message"]


def test_prompt_longer_than_the_context_is_refused(server, client):
    too_long = list(range(100, 100 + 8300))  # SmolLM2's context is 8192 tokens
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model=SMOLLM2, prompt=too_long, max_tokens=4)


def test_disconnect_mid_stream_frees_the_request_and_the_server_keeps_serving(server, client):
    body = {"model": SMOLLM2, "messages": CHAT, "max_tokens": 400, "temperature": 0, "stream": True,
            "dflash2": {"num_draft_tokens": 0}}
    headers = {"authorization": f"Bearer {server.api_key}"}
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json=body, headers=headers,
                      timeout=60) as response:
        lines = response.iter_lines()
        received = [next(lines) for _ in range(6)]  # a few events, then hang up
    assert any(line.startswith("data: ") for line in received)

    def freed() -> bool:
        m = server.metrics()
        return (m["dflash2_batch_size"] == 0 and m["dflash2_kv_blocks_used"] == 0
                and m.get('dflash2_requests_finished_total{reason="cancelled"}', 0) >= 1)

    assert wait_until(freed, timeout=30)
    after = client.chat.completions.create(model=SMOLLM2, messages=CHAT, max_tokens=4, temperature=0)
    assert after.choices[0].message.content


def test_disconnect_while_waiting_for_a_whole_body_cancels_the_request(server, client):
    before = server.metrics().get('dflash2_requests_finished_total{reason="cancelled"}', 0)
    body = {"model": SMOLLM2, "prompt": "Once upon a time", "max_tokens": 400, "temperature": 0,
            "dflash2": {"num_draft_tokens": 0}}
    headers = {"authorization": f"Bearer {server.api_key}"}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(f"{server.base_url}/v1/completions", json=body, headers=headers, timeout=2.0)

    def cancelled() -> bool:
        m = server.metrics()
        return (m.get('dflash2_requests_finished_total{reason="cancelled"}', 0) > before
                and m["dflash2_kv_blocks_used"] == 0)

    assert wait_until(cancelled, timeout=30)
    assert client.completions.create(model=SMOLLM2, prompt="Hi", max_tokens=2, temperature=0).choices[0].text
