"""A bounded load test on loopback: 16 concurrent openai clients, zero failed requests, no memory growth."""

from __future__ import annotations

import threading
import time

import pytest

from tests.e2e.conftest import SMOLLM2
from tests.e2e.serve_fixture import start_server, stop_server, wait_until

openai = pytest.importorskip("openai")

CLIENTS = 16
SECONDS = 45.0  # each client stops starting new requests after this
MAX_REQUESTS_PER_CLIENT = 6
PROMPTS = ["Write a haiku about the sea.", "def fibonacci(n):", "Name three fruits.", "2 + 2 ="]


def client_loop(base_url: str, key: str, index: int, deadline: float, outcomes: list, lock: threading.Lock) -> None:
    client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=120)
    for turn in range(MAX_REQUESTS_PER_CLIENT):
        if time.monotonic() > deadline:
            return
        prompt = PROMPTS[(index + turn) % len(PROMPTS)]
        extra = {"dflash2": {"num_draft_tokens": (index + turn) % 3 * 4}}  # 0, 4 or 8 drafts
        try:
            if (index + turn) % 2:
                stream = client.chat.completions.create(model=SMOLLM2, messages=[{"role": "user", "content": prompt}],
                                                        max_tokens=12, temperature=0.7, stream=True, extra_body=extra)
                ok = any(chunk.choices and chunk.choices[0].finish_reason for chunk in stream)
            else:
                reply = client.completions.create(model=SMOLLM2, prompt=prompt, max_tokens=12, temperature=0,
                                                  extra_body=extra)
                ok = reply.usage.completion_tokens > 0
            outcome = "ok" if ok else "no finish"
        except Exception as error:  # counted as a failure, reported below
            outcome = f"{type(error).__name__}: {error}"
        with lock:
            outcomes.append(outcome)


def run_clients(server, seconds: float) -> list[str]:
    outcomes: list[str] = []
    lock = threading.Lock()
    deadline = time.monotonic() + seconds
    threads = [threading.Thread(target=client_loop, args=(f"{server.base_url}/v1", server.api_key, i, deadline,
                                                          outcomes, lock)) for i in range(CLIENTS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=seconds + 180)
    assert not any(thread.is_alive() for thread in threads), "a client hung"
    return outcomes


@pytest.mark.model
@pytest.mark.slow
def test_sixteen_clients_zero_failures_no_memory_growth():
    server = start_server(SMOLLM2, "--dtype", "fp32", "--max-batch-size", "8", "--kv-memory-mb", "64")
    try:
        warm = run_clients(server, 5.0)  # one round each: allocator pools and shapes settle
        assert warm and all(o == "ok" for o in warm), warm
        rss_before = server.rss_kib()
        outcomes = run_clients(server, SECONDS)
        failures = [o for o in outcomes if o != "ok"]
        assert len(outcomes) >= CLIENTS and not failures, failures[:5]
        assert wait_until(lambda: server.metrics()["dflash2_kv_blocks_used"] == 0, timeout=30)
        growth_mib = (server.rss_kib() - rss_before) / 1024
        assert growth_mib < 64, f"RSS grew by {growth_mib:.0f} MiB"
        metrics = server.metrics()
        assert metrics["dflash2_batch_size"] == 0 and metrics["dflash2_queue_depth"] == 0
        assert metrics.get('dflash2_requests_finished_total{reason="error"}', 0) == 0
    finally:
        stop_server(server)
