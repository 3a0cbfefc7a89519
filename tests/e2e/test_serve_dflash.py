"""The trained DFlash drafter served: requests drafted by it (alone or with prompt lookup) in one batch."""

from __future__ import annotations

import concurrent.futures

import pytest

from tests.e2e.conftest import SMOLLM2, lean_engine
from tests.e2e.serve_fixture import start_server, stop_server

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.model

CHATS = [[{"role": "user", "content": "Write a Python function that returns the square of a number."}],
         [{"role": "user", "content": "Name three fruits."}]]


@pytest.fixture(scope="module")
def client():
    live = start_server(SMOLLM2, "--dtype", "fp32", "--drafter", "dflash+ngram", "--max-batch-size", "4",
                        "--kv-memory-mb", "64", "--threads", "2")
    yield openai.OpenAI(base_url=f"{live.base_url}/v1", api_key=live.api_key, max_retries=0, timeout=120)
    stop_server(live)


def test_dflash_drafted_replies_in_one_batch_equal_plain_decoding(client):
    engine = lean_engine(SMOLLM2, "fp32")
    expected = [engine.generate(chat, max_new_tokens=32).text for chat in CHATS]
    jobs = [(chat, drafter) for chat in CHATS for drafter in ("dflash", "dflash+ngram")]

    def ask(job):
        chat, drafter = job
        return client.chat.completions.create(model=SMOLLM2, messages=chat, max_tokens=32, temperature=0,
                                              extra_body={"dflash2": {"drafter": drafter}})

    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:  # concurrent: they share ragged forwards
        replies = list(pool.map(ask, jobs))
    for (chat, drafter), reply in zip(jobs, replies):
        assert reply.choices[0].message.content == expected[CHATS.index(chat)], drafter
        extension = reply.model_extra["dflash2"]
        assert extension["drafter"] == drafter and extension["num_draft_tokens"] > 0 and extension["tau"] >= 1.0
