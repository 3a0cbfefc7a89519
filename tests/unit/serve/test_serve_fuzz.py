"""Fuzzing the HTTP API with schemathesis over the server's own OpenAPI schema (/openapi.json): generated
requests, valid and invalid per the schema (wrong types, out-of-range numbers, missing and extra fields, odd
strings), never get a 5xx, and the server keeps serving afterwards (tiny random model, in-process)."""

from __future__ import annotations

from collections import Counter

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402

from dflash2.decode.batch import BatchConfig, BatchEngine, request_drafters  # noqa: E402
from dflash2.serve.app import ServerConfig, create_app  # noqa: E402
from dflash2.decode.engine import Engine  # noqa: E402
from dflash2.models.loading import load_transformer  # noqa: E402
from tests.unit.serve.test_serve_app import NoEosTokenizer  # noqa: E402

MODEL = "tiny"
STATUSES: Counter = Counter()  # what the fuzzed requests got, to check that they reached generation too


class ByteTokenizer(NoEosTokenizer):
    """Any text is a prompt (its UTF-8 bytes as ids), with a chat template: fuzzed chats reach generation."""

    has_chat_template = True

    def encode(self, text):
        return [1 + b % 250 for b in text.encode()]

    def encode_prompt(self, text):  # a raw prompt: no special tokens to add
        return self.encode(text)

    def apply_chat_template(self, messages):
        return [id_ for m in messages for id_ in [2] + self.encode(m["role"] + ": " + m["content"])]


@pytest.fixture(scope="module")
def app(tiny_model_dirs):
    engine = Engine(load_transformer(tiny_model_dirs["llama"], "fp32", "cpu"), ByteTokenizer(), name="tiny")
    batch = BatchEngine(engine, BatchConfig(num_blocks=64, block_size=16, max_queue=8), request_drafters(engine))
    batch.start()
    yield create_app(batch, ServerConfig(model_name=MODEL, default_drafter="ngram", default_num_draft_tokens=4,
                                         max_tokens=16))
    batch.stop()


def fuzzed_operations(app) -> list:
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    return [result.ok() for result in schema.get_all_operations()]


def test_the_schema_describes_the_request_bodies(app):
    spec = app.openapi()
    body = spec["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/ChatCompletionRequest"}
    assert {"ChatCompletionRequest", "CompletionRequest", "ChatMessage"} <= set(spec["components"]["schemas"])


def _served_model(case) -> None:
    """Name the served model (and a small token limit) so that valid bodies reach generation."""
    if isinstance(case.body, dict) and case.body.get("model") is not None:
        case.body["model"] = MODEL
        for limit in ("max_tokens", "max_completion_tokens"):
            if isinstance(case.body.get(limit), int) and case.body[limit] > 16:
                case.body[limit] = 16


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_fuzzed_requests_never_get_a_5xx(app, mode):
    """Schema-valid bodies (POSITIVE, most renamed to the served model) and schema-violating ones (NEGATIVE)."""
    for operation in fuzzed_operations(app):
        if mode is GenerationMode.NEGATIVE and operation.method.upper() != "POST":
            continue  # nothing to violate: no parameters, no body

        @given(case=operation.as_strategy(generation_mode=mode), rename=st.booleans())
        @settings(max_examples=15, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck),
                  database=None)
        def run(case, rename):
            if rename and mode is GenerationMode.POSITIVE:
                _served_model(case)
            response = case.call()
            STATUSES[(case.path, response.status_code)] += 1
            case.validate_response(response, checks=[not_a_server_error])

        run()


def test_the_server_still_serves_after_the_fuzzing(app):
    from fastapi.testclient import TestClient

    client = TestClient(app)
    assert client.get("/health").json() == {"status": "ok"}
    ok = client.post("/v1/completions", json={"model": MODEL, "prompt": [5, 6], "max_tokens": 3})
    assert ok.status_code == 200
    print(sorted(STATUSES.items()))
    assert any(status == 200 for (path, status) in STATUSES if path.endswith("completions")), STATUSES
    assert any(400 <= status < 500 for (_, status) in STATUSES), STATUSES
