"""One request can never hurt another: failures stay with their request, the loop survives, errors say nothing
internal; refusals of what cannot be computed or must not be served (tiny random model, in-process)."""

from __future__ import annotations

import pytest
import torch

from dflash2.decode.batch import BatchConfig, BatchEngine, BatchRequest, EngineStoppedError, run_to_completion
from dflash2.drafters.base import Draft, Drafter
from dflash2.verify import SamplingParams
from tests.unit.decode.test_batch_engine import engine, prompts  # noqa: F401  (the module-scoped fixture)

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from dflash2.serve.app import ServerConfig, create_app  # noqa: E402


class Broken(Exception):
    """The failure a broken drafter raises (its text must never reach a client)."""


class BrokenDrafter(Drafter):
    """Fails in ``propose`` (or in ``reset``): stands for any per-request bug or resource error."""

    name = "broken"

    def __init__(self, where: str = "propose", error: type[BaseException] = Broken) -> None:
        super().__init__(2)
        self.where, self.error = where, error

    def reset(self, capacity: int) -> None:
        if self.where == "reset":
            raise self.error("secret internal detail")

    def propose(self, sequence, num_draft_tokens, params, generator) -> Draft:
        if self.where == "propose":
            raise self.error("secret internal detail")
        return Draft(torch.zeros(0, dtype=torch.int64), None)


def batch_with(engine, drafters) -> BatchEngine:
    return BatchEngine(engine, BatchConfig(num_blocks=64, block_size=8, adaptive_drafts=False), drafters)


def outcomes(batch: BatchEngine, requests: list[BatchRequest]) -> list:
    """Run requests to completion on this thread; the last event of each (a result or an exception)."""
    events: list[list] = [[] for _ in requests]
    for request, sink in zip(requests, events):
        batch.submit(request, sink.append)
    while batch.step():
        pass
    return [e[-1] for e in events]


@pytest.mark.parametrize("where", ["propose", "reset"])
def test_a_failing_drafter_fails_only_its_own_request(engine, where):
    batch = batch_with(engine, {"broken": lambda: BrokenDrafter(where)})
    good = [BatchRequest(p, 6) for p in prompts(3)]
    bad = BatchRequest(prompts(1, seed=9)[0], 6, drafter="broken", num_draft_tokens=2)
    expected = [r.token_ids for r in run_to_completion(batch, good)]
    finals = outcomes(batch, good[:2] + [bad] + good[2:])
    assert isinstance(finals[2], Broken)
    assert [f.token_ids for f in finals[:2] + finals[3:]] == expected
    assert batch.snapshot().requests_finished["error"] == 1
    assert batch.pool.blocks_used == 0 and batch.pool.reserved == 0


def test_a_row_that_breaks_the_batched_forward_fails_alone(engine):
    """A token id past the vocabulary makes the ragged forward raise: the rows are re-run one by one, so the
    other requests finish with exactly their tokens."""
    batch = batch_with(engine, {})
    good = [BatchRequest(p, 6) for p in prompts(3)]
    expected = [r.token_ids for r in run_to_completion(batch, good)]
    bad = BatchRequest([5, 6, engine.target.config.vocab_size + 7], 6)
    finals = outcomes(batch, [good[0], bad, good[1], good[2]])
    assert isinstance(finals[1], Exception)
    assert [f.token_ids for f in (finals[0], finals[2], finals[3])] == expected
    assert batch.pool.blocks_used == 0


def test_a_tiny_temperature_means_greedy(engine):
    batch = batch_with(engine, {})
    prompt = prompts(1)[0]
    greedy = run_to_completion(batch, [BatchRequest(prompt, 8)])[0].token_ids
    tiny = run_to_completion(batch, [BatchRequest(prompt, 8, params=SamplingParams(temperature=1e-40, seed=1))])
    assert tiny[0].token_ids == greedy
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(temperature=0.5, seed=2**70)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=float("nan"))


# ---- over HTTP --------------------------------------------------------------------------------------------------

BODY = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 6, "temperature": 0}


@pytest.fixture
def served(engine):
    started: list[BatchEngine] = []

    def serve(drafters=None, **config) -> TestClient:
        batch = batch_with(engine, drafters or {})
        batch.start()
        started.append(batch)
        return TestClient(create_app(batch, ServerConfig(model_name="tiny", default_drafter="none", **config)))

    yield serve
    for batch in started:
        batch.stop()


def test_an_internal_failure_is_a_500_with_an_id_and_no_internals(served):
    client = served({"broken": BrokenDrafter})
    response = client.post("/v1/completions", json=BODY | {"dflash2": {"drafter": "broken", "num_draft_tokens": 2}})
    error = response.json()["error"]
    assert response.status_code == 500 and error["type"] == "server_error"
    assert "secret" not in response.text and "Broken" not in response.text and error["code"] in error["message"]
    ok = client.post("/v1/completions", json=BODY)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 6
    assert client.get("/health").status_code == 200


class LoopKiller(BaseException):
    """Not an Exception: passes every per-request guard, as an interpreter-level failure would."""


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the loop thread's death
def test_a_dead_engine_shows_in_health_and_refuses_requests(served):
    import time

    client = served({"killer": lambda: BrokenDrafter("reset", LoopKiller)})
    response = client.post("/v1/completions", json=BODY | {"dflash2": {"drafter": "killer", "num_draft_tokens": 2}})
    assert response.status_code == 503 and response.json()["error"]["code"] == "engine_stopped"
    deadline = time.monotonic() + 5
    while client.get("/health").status_code == 200 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert client.get("/health").json() == {"status": "engine stopped"}
    refused = client.post("/v1/completions", json=BODY)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_stopped"


def test_a_stopped_batch_engine_refuses_at_submit(engine):
    batch = batch_with(engine, {})
    batch.stop()
    with pytest.raises(EngineStoppedError):
        batch.submit(BatchRequest([1, 2, 3], 2), lambda event: None)


@pytest.mark.parametrize("origin, status", [
    ("https://evil.example", 403),
    ("http://localhost:3000", 200),
    ("http://127.0.0.1:8000", 200),
    (None, 200),
])
def test_foreign_origins_are_refused_by_default(served, origin, status):
    client = served()
    headers = {} if origin is None else {"origin": origin}
    response = client.post("/v1/completions", json=BODY, headers=headers)
    assert response.status_code == status, response.text
    if status == 403:
        assert response.json()["error"]["code"] == "origin_not_allowed"


def test_allowed_origins_flag(served):
    client = served(allowed_origins=("https://app.example",))
    assert client.post("/v1/completions", json=BODY, headers={"origin": "https://app.example"}).status_code == 200
    assert client.post("/v1/completions", json=BODY, headers={"origin": "http://localhost:1"}).status_code == 403
    anyone = served(allowed_origins=("*",))
    assert anyone.post("/v1/completions", json=BODY, headers={"origin": "https://x.example"}).status_code == 200


def test_a_text_plain_body_is_415(served):
    import json

    client = served()
    response = client.post("/v1/completions", content=json.dumps(BODY), headers={"content-type": "text/plain"})
    assert response.status_code == 415 and response.json()["error"]["code"] == "unsupported_media_type"


@pytest.mark.parametrize("change, param", [
    ({"seed": 2**70}, "seed"),
    ({"dflash2": {"drafter": "ngram", "num_draft_tokens": 17}}, "dflash2.num_draft_tokens"),
])
def test_values_that_cannot_be_used_are_400_naming_the_parameter(served, change, param):
    from dflash2.drafters.ngram import NgramDrafter

    client = served({"ngram": lambda: NgramDrafter(8)})
    response = client.post("/v1/completions", json=BODY | change)
    assert response.status_code == 400 and response.json()["error"]["param"] == param


def test_a_tiny_temperature_is_served_as_greedy(served):
    client = served()
    greedy = client.post("/v1/completions", json=BODY).json()["choices"][0]["text"]
    tiny = client.post("/v1/completions", json=BODY | {"temperature": 1e-40})
    assert tiny.status_code == 200 and tiny.json()["choices"][0]["text"] == greedy


def test_a_deadline_ends_a_running_request_with_what_it_has_and_fails_a_queued_one(engine):
    import time

    batch = BatchEngine(engine, BatchConfig(num_blocks=64, block_size=8, max_batch_size=1))
    running, queued = [], []
    batch.submit(BatchRequest(prompts(1)[0], 480, timeout_s=0.05), running.append)  # far from done in 0.05 s
    batch.submit(BatchRequest(prompts(1, seed=3)[0], 5, timeout_s=0.02), queued.append)
    started = time.perf_counter()
    while batch.step():
        pass
    assert time.perf_counter() - started < 5
    from dflash2.decode.batch import DeadlineError

    final = running[-1]
    assert final.finish_reason == "timeout" and 0 < len(final.token_ids) < 480
    assert isinstance(queued[-1], DeadlineError)
    assert batch.snapshot().requests_finished == {"timeout": 2} and batch.pool.reserved == 0


def test_a_request_deadline_over_http(served):
    client = served(request_timeout_s=30.0)
    body = BODY | {"max_tokens": 480, "prompt": [5, 6, 7] * 3, "dflash2": {"timeout_s": 0.05}}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    reply = response.json()
    assert reply["choices"][0]["finish_reason"] == "length" and reply["dflash2"]["finish_reason"] == "timeout"
    assert reply["usage"]["completion_tokens"] < 480


def test_the_serve_flags_reach_the_server_config(tiny_model_dirs):
    from dflash2.cli import build_parser
    from dflash2.serve.cli import build_server

    args = build_parser().parse_args(["serve", "--model", tiny_model_dirs["qwen2"], "--dtype", "fp32", "--drafter",
                                      "none", "--allowed-origins", "https://a.example, https://b.example",
                                      "--request-timeout", "30", "--max-num-draft-tokens", "4"])
    app, batch = build_server(args)
    client = TestClient(app)
    ok = {"origin": "https://b.example"}
    assert client.get("/health", headers=ok).status_code == 503  # loop not started: and the origin was allowed
    assert client.get("/health", headers={"origin": "http://localhost:1"}).status_code == 403
