"""The prefix cache on real weights: a prefill split into a cached part and the rest gives a cold prefill's logits
bitwise (bf16 and fp32); a chat's second turn from the cache, in the server's batch engine and in the Python API,
gives the cold tokens (greedy and seeded, with the shipped DFlash drafter); the usage and /metrics count it."""

from __future__ import annotations

import functools

import httpx
import pytest
import torch

from dflash2.decode.batch import BatchConfig, BatchEngine, BatchRequest, request_drafters, run_to_completion
from dflash2.decode.ragged import RaggedRow, ragged_forward
from dflash2.drafters import build_drafter
from dflash2.drafters.spec import DrafterSpec
from dflash2.kv.paged import PagedKVPool
from tests.e2e.conftest import QWEN_TARGET, SMOLLM2, lean_engine
from tests.e2e.serve_fixture import start_server, stop_server

TURN_1 = [{"role": "user", "content": "Write a Python function that checks whether a number is prime."}]
FOLLOW_UP = {"role": "user", "content": "Now make it faster for large numbers and explain why."}


def second_turn(answer: str) -> list[dict[str, str]]:
    return [*TURN_1, {"role": "assistant", "content": answer}, FOLLOW_UP]


def split_prefill_logits(engine, ids: list[int], cached: int) -> tuple[torch.Tensor, ...]:
    """The last prompt token's logits [V]: cold (static cache), after a cached prefix of ``cached`` ids (static
    cache), and in the paged pool fed from a table that already holds that prefix (ragged forward)."""
    target = engine.target
    with torch.inference_mode():
        cold = target(torch.tensor([ids]), cache=target.new_cache(len(ids)), logits="last").logits[0, -1]
        cache = target.new_cache(len(ids))
        target(torch.tensor([ids[:cached]]), cache=cache, logits="last")
        split = target(torch.tensor([ids[cached:]]), cache=cache, logits="last").logits[0, -1]
    c = target.config
    pool = PagedKVPool(c.num_layers, c.num_kv_heads, c.head_dim, 64, 16, dtype=target.dtype, prefix_cache=True)
    first = pool.new_table(len(ids))
    ragged_forward(target, pool, [RaggedRow(first, ids[:cached], all_logits=False)])
    first.rollback(cached)
    first.publish(ids)
    second = pool.new_table(len(ids), ids)
    assert second.length == cached
    paged = ragged_forward(target, pool, [RaggedRow(second, ids[cached:], all_logits=False)]).logits[0][-1]
    return cold, split, paged


@pytest.mark.model
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_a_split_prefill_gives_cold_logits_bitwise_smollm2(dtype):
    engine = lean_engine(SMOLLM2, dtype)
    ids = engine.encode_prompt(TURN_1 * 3)
    cold, split, paged = split_prefill_logits(engine, ids, len(ids) // 16 * 16 - 16)
    assert torch.equal(split, paged)  # the pool's cached prefix = the static cache's: the same rows, the same bits
    if dtype == "bf16":  # dflash2's own kernels: a row's result does not depend on the rows beside it
        assert torch.equal(cold, split)
    else:  # fp32 runs on torch's GEMM, which on some CPUs blocks by row count (the Intel Xeon (AMX), 2026-12-04:
        # the 76-row prefill and the 12-row suffix differ by 1.9e-5 in the logits): the same argmax, within noise
        torch.testing.assert_close(split, cold, rtol=0, atol=1e-4)
        assert split.argmax() == cold.argmax()


@pytest.mark.model
@pytest.mark.qwen
def test_a_split_prefill_gives_cold_logits_bitwise_qwen_bf16():
    engine = lean_engine(QWEN_TARGET, "bf16")
    ids = engine.encode_prompt(TURN_1 * 8)
    cold, split, paged = split_prefill_logits(engine, ids, len(ids) // 16 * 16 - 32)
    assert torch.equal(cold, split) and torch.equal(cold, paged)


@functools.lru_cache(maxsize=1)
def smollm2_dflash():
    engine = lean_engine(SMOLLM2, "bf16")
    return build_drafter(DrafterSpec.parse("dflash+ngram"), engine)


def conversation(engine, run, temperature: float, seed: int | None) -> list:
    """Two turns through ``run(prompt ids or messages, temperature, seed) -> result``."""
    first = run(TURN_1, temperature, seed)
    return [first, run(second_turn(first.text), temperature, seed)]


@pytest.mark.model
@pytest.mark.parametrize("temperature, seed", [(0.0, None), (0.8, 3)], ids=["greedy", "seeded"])
def test_the_servers_second_turn_from_the_cache_equals_a_cold_one_bf16(temperature, seed):
    engine = lean_engine(SMOLLM2, "bf16")
    engine.drafter = smollm2_dflash()
    try:
        def runner(prefix_cache: bool):
            batch = BatchEngine(engine, BatchConfig(num_blocks=256, prefix_cache=prefix_cache, adaptive_drafts=False),
                                request_drafters(engine))

            def run(messages, temperature, seed):
                request = BatchRequest(engine.encode_prompt(messages), 48, drafter="dflash+ngram", num_draft_tokens=4,
                                       params=_params(temperature, seed))
                return run_to_completion(batch, [request])[0]
            return batch, run

        batch, warm_run = runner(True)
        warm = conversation(engine, warm_run, temperature, seed)
        cold = conversation(engine, runner(False)[1], temperature, seed)
    finally:
        engine.drafter = None
    assert [r.token_ids for r in warm] == [r.token_ids for r in cold]
    assert warm[1].stats.cached_tokens >= len(warm[0].prompt_ids) - 16 and batch.pool.tap_layers


@pytest.mark.model
@pytest.mark.parametrize("temperature, seed", [(0.0, None), (0.8, 3)], ids=["greedy", "seeded"])
def test_the_api_reuses_the_last_turn_and_gives_cold_tokens_bf16(temperature, seed):
    engine = lean_engine(SMOLLM2, "bf16")
    engine.drafter = smollm2_dflash()

    def run(messages, temperature, seed):
        return engine.generate(messages, max_new_tokens=48, temperature=temperature, seed=seed)
    try:
        engine.prefix_cache = True
        engine.clear_cache()
        warm = conversation(engine, run, temperature, seed)
        engine.prefix_cache = False
        cold = conversation(engine, run, temperature, seed)
    finally:
        engine.drafter, engine.prefix_cache = None, True
        engine.clear_cache()
    assert [r.token_ids for r in warm] == [r.token_ids for r in cold]
    assert warm[1].stats.cached_tokens >= len(warm[0].prompt_ids) and cold[1].stats.cached_tokens == 0


def _params(temperature: float, seed: int | None):
    from dflash2.verify import SamplingParams

    return SamplingParams(temperature=temperature, seed=seed)


@pytest.mark.model
def test_usage_and_metrics_count_cached_tokens_through_the_openai_client():
    openai = pytest.importorskip("openai")
    live = start_server(SMOLLM2, "--dtype", "fp32", "--kv-memory-mb", "64", "--threads", "2")
    try:
        client = openai.OpenAI(base_url=f"{live.base_url}/v1", api_key=live.api_key, max_retries=0, timeout=120)
        first = client.chat.completions.create(model=SMOLLM2, messages=TURN_1, max_tokens=24, temperature=0)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        messages = second_turn(first.choices[0].message.content)
        stream = client.chat.completions.create(model=SMOLLM2, messages=messages, max_tokens=24, temperature=0,
                                                stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        usage = chunks[-1].usage
        assert usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 16
        assert usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens
        again = client.chat.completions.create(model=SMOLLM2, messages=messages, max_tokens=24, temperature=0)
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert again.choices[0].message.content == streamed  # from the cache or not, the same reply
        metrics = live.metrics()
        assert metrics["dflash2_prefix_cache_hit_tokens_total"] > 0 and metrics["dflash2_prefix_cache_blocks"] > 0
        assert 0 < metrics["dflash2_prefix_cache_hit_rate"] < 1
        assert httpx.get(f"{live.base_url}/health", timeout=10).status_code == 200
    finally:
        stop_server(live)
