"""Long prompts against the server's budgets (SmolLM2, context 8192): 16K / 32K / 40K-token prompts and one past
the KV budget are refused at once with a 400 that says why; a prompt that fits is served with the KV pool, the
prefix cache and the drafter memory inside their budgets (numbers: docs/serving.md, "Long prompts")."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.e2e.conftest import SMOLLM2
from tests.e2e.serve_fixture import spread_ids, start_server, stop_server

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.model

KV_MB = 64  # 182 blocks of 16 slots for SmolLM2 in bf16 with its prefix taps: 2912 slots


@pytest.fixture(scope="module")
def server():
    live = start_server(SMOLLM2, "--kv-memory-mb", str(KV_MB), "--drafter-memory-mb", "64", timeout=600)
    yield live
    stop_server(live)



def refused(server, prompt, **extra) -> tuple[float, str, str | None]:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=server.api_key, max_retries=0, timeout=60)
    started = time.monotonic()
    with pytest.raises(openai.BadRequestError) as error:
        if isinstance(prompt, str):
            client.chat.completions.create(model=SMOLLM2, messages=[{"role": "user", "content": prompt}],
                                           max_tokens=16, **extra)
        else:
            client.completions.create(model=SMOLLM2, prompt=prompt, max_tokens=16, **extra)
    body = error.value.body or {}
    return time.monotonic() - started, str(body.get("message", error.value)), body.get("code")


def test_prompts_past_the_context_are_refused_at_once(server):
    seconds, message, code = refused(server, "word " * 40000)  # ~40K tokens of text
    assert seconds < 1.0 and code == "context_length_exceeded" and "context is 8192" in message, (seconds, message)
    for n in (16000, 32000):  # as token ids: the client's JSON and the schema's list of ints cost more than the text
        seconds, message, code = refused(server, spread_ids(n, 40000))  # (1.3 s at a load of 16 on 2 cores, 2026-12-06)
        assert seconds < 3.0 and f"the prompt has {n} tokens" in message, (n, seconds, message)


def test_a_prompt_past_the_kv_budget_is_refused_at_once(server):
    blocks = server.metrics()["dflash2_kv_blocks_total"]
    seconds, message, _ = refused(server, spread_ids(4000, 40000))
    assert seconds < 1.0 and f"the server's budget is {int(blocks)}" in message, (seconds, message)
    assert server.process.poll() is None  # still serving


@pytest.mark.slow
def test_a_long_prompt_that_fits_is_served_inside_the_budgets(server):
    before = server.rss_kib()
    reply = httpx.post(f"{server.base_url}/v1/completions", timeout=900,
                       headers={"Authorization": f"Bearer {server.api_key}"},
                       json={"model": SMOLLM2, "prompt": spread_ids(2500, 40000), "max_tokens": 16, "temperature": 0})
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["prompt_tokens"] == 2500
    metrics = server.metrics()
    total = metrics["dflash2_kv_blocks_total"]
    assert metrics["dflash2_kv_blocks_used"] <= total and metrics["dflash2_prefix_cache_blocks"] <= total
    assert metrics["dflash2_drafter_memory_bytes"] <= metrics["dflash2_drafter_memory_budget_bytes"]
    # the pool is allocated up front: serving a prompt of 86% of it grows the process by its workspaces only
    assert server.rss_kib() - before < (KV_MB + 256) * 1024
