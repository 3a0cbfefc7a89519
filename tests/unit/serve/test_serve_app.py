"""The HTTP app in-process (FastAPI's test client) over a tiny random model: admission answers 429 / 503."""

from __future__ import annotations

import pytest

from dflash2.decode.batch import BatchConfig, BatchEngine, BatchRequest
from dflash2.decode.engine import Engine
from dflash2.models.loading import load_transformer
from tests.unit.decode.test_batch_engine import IdTokenizer

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from dflash2.serve.app import ServerConfig, create_app  # noqa: E402


class NoEosTokenizer(IdTokenizer):
    eos_token_ids = frozenset()  # generations run to max_tokens: a blocking request stays put


@pytest.fixture(scope="module")
def engine(tiny_model_dirs):
    return Engine(load_transformer(tiny_model_dirs["llama"], "fp32", "cpu"), NoEosTokenizer(), name="tiny")


def serve(engine, config: BatchConfig):
    batch = BatchEngine(engine, config)
    batch.start()
    return batch, TestClient(create_app(batch, ServerConfig(model_name="tiny", default_drafter="none")))


BODY = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 8, "temperature": 0}


def test_full_queue_is_429(engine):
    batch, client = serve(engine, BatchConfig(num_blocks=8, block_size=8, max_queue=0))
    try:
        response = client.post("/v1/completions", json=BODY)
        assert response.status_code == 429 and response.json()["error"]["code"] == "queue_full"
        assert 'dflash2_requests_rejected_total 1' in client.get("/metrics").text
    finally:
        batch.stop()


def test_kv_full_for_too_long_is_503_and_the_server_recovers(engine):
    batch, client = serve(engine, BatchConfig(num_blocks=4, block_size=64, queue_timeout_s=0.0))
    try:
        events = []
        blocker = batch.submit(BatchRequest([1, 2, 3], 250), events.append)  # reserves all 4 blocks
        response = client.post("/v1/completions", json=BODY)  # needs 1 block: none is free
        assert response.status_code == 503 and response.json()["error"]["code"] == "kv_cache_full"
        assert not events or not hasattr(events[-1], "finish_reason")  # the blocker was still running
        blocker.cancel()
        ok = client.post("/v1/completions", json=BODY)
        assert ok.status_code == 200 and ok.json()["usage"]["prompt_tokens"] == 3
    finally:
        batch.stop()


def test_token_prompt_outside_the_vocabulary_is_400(engine):
    batch, client = serve(engine, BatchConfig(num_blocks=8, block_size=8))
    try:
        response = client.post("/v1/completions", json=BODY | {"prompt": [1, 99999]})
        assert response.status_code == 400 and "vocabulary" in response.json()["error"]["message"]
        assert client.get("/health").json() == {"status": "ok"}
    finally:
        batch.stop()
