"""Long prompts on the default server (Qwen2.5-Coder-1.5B-Instruct, context 32768, default budgets and drafter):
a 40K-token prompt is refused with a 400 in under a second, a 16K-token prompt is served with the KV pool, the
prefix cache and the drafter memory inside their budgets (numbers: docs/serving.md, "Long prompts"). Slow: the 16K
prefill of the target and of the PARD drafter takes minutes on 2 cores."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.e2e.conftest import QWEN_TARGET
from tests.e2e.serve_fixture import spread_ids, start_server, stop_server

openai = pytest.importorskip("openai")

pytestmark = [pytest.mark.model, pytest.mark.qwen, pytest.mark.slow]

KV_MB = 1024  # the server's default budgets, stated so that the bound below follows them
DRAFTER_MB = 1024


@pytest.fixture(scope="module")
def server():
    live = start_server(QWEN_TARGET, "--kv-memory-mb", str(KV_MB), "--drafter-memory-mb", str(DRAFTER_MB),
                        timeout=900)
    yield live
    stop_server(live)



def test_a_prompt_past_the_context_is_refused_at_once(server):
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=server.api_key, max_retries=0, timeout=60)
    started = time.monotonic()
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=QWEN_TARGET, max_tokens=16,
                                       messages=[{"role": "user", "content": "word " * 40000}])
    seconds = time.monotonic() - started
    body = error.value.body or {}
    print(f"40K-token prompt refused in {seconds:.2f} s: {body.get('message')}")
    assert seconds < 1.0 and body.get("code") == "context_length_exceeded", (seconds, body)


def test_a_16k_prompt_is_served_inside_the_budgets(server):
    before = server.rss_kib()
    started = time.monotonic()
    reply = httpx.post(f"{server.base_url}/v1/completions", timeout=3600,
                       headers={"Authorization": f"Bearer {server.api_key}"},
                       json={"model": QWEN_TARGET, "prompt": spread_ids(16000, 100000), "max_tokens": 16,
                             "temperature": 0})
    seconds = time.monotonic() - started
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["prompt_tokens"] == 16000
    metrics = server.metrics()
    after = server.rss_kib()
    print(f"16K-token prompt served in {seconds:.0f} s; resident memory {before / 1024:.0f} -> {after / 1024:.0f} MB; "
          + ", ".join(f"{k} {v:.0f}" for k, v in sorted(metrics.items()) if k.startswith(("dflash2_kv",
                                                                                             "dflash2_prefix",
                                                                                             "dflash2_drafter"))))
    total = metrics["dflash2_kv_blocks_total"]
    assert metrics["dflash2_kv_blocks_used"] <= total and metrics["dflash2_prefix_cache_blocks"] <= total
    assert metrics["dflash2_drafter_memory_bytes"] <= metrics["dflash2_drafter_memory_budget_bytes"]
    # the KV pool is reserved at start but becomes resident as its blocks are written; with the drafter's caches
    # and the prefill's transient workspaces (up to 1 GiB here) that is all that may grow
    assert after - before < (KV_MB + DRAFTER_MB + 1024) * 1024, (before, after)
