"""The batch engine's prefix cache on a tiny random model (fp32): a request that starts from cached blocks gives
exactly the tokens (greedy and seeded sampling) and, with a block drafter, exactly the proposals it gets cold."""

from __future__ import annotations

import pytest
import torch

from dflash2.decode.batch import BatchConfig, BatchEngine, BatchRequest, request_drafters, run_to_completion
from dflash2.drafters.dflash import DFlashDrafter
from dflash2.drafters.hybrid import HybridDrafter
from dflash2.verify import SamplingParams
from tests.unit.decode.test_batch_engine import RecordingDFlash, block_model, engine, prompts  # noqa: F401 (fixture)


def turns(seed: int = 0) -> tuple[list[int], list[int]]:
    """A first prompt, and the words a second turn appends after the first turn's answer."""
    g = torch.Generator().manual_seed(seed)
    first = prompts(1, seed)[0] * 3 + torch.randint(1, 256, (7,), generator=g).tolist()
    return first, torch.randint(1, 256, (9,), generator=g).tolist()


def conversation(batch: BatchEngine, make_request) -> list:
    """Turn one, then turn two = turn one's prompt + its answer + new words; the results of both."""
    first_ids, more = turns()
    first = run_to_completion(batch, [make_request(first_ids)])[0]
    second = run_to_completion(batch, [make_request(first_ids + first.token_ids + more)])[0]
    return [first, second]


def cold(engine, make_request, drafters=None, **config) -> list:
    """The same turns on an engine without the prefix cache."""
    batch = BatchEngine(engine, BatchConfig(prefix_cache=False, **config), drafters or request_drafters(engine))
    return conversation(batch, make_request)


CONFIG = dict(num_blocks=64, block_size=4, adaptive_drafts=False, max_prefill_tokens=16)


@pytest.mark.parametrize("drafter, k, params", [
    ("none", 0, SamplingParams()),
    ("ngram", 4, SamplingParams()),
    ("ngram", 4, SamplingParams(temperature=0.9, seed=3)),
    ("none", 0, SamplingParams(temperature=1.1, top_p=0.9, seed=7)),
], ids=["plain-greedy", "ngram-greedy", "ngram-seeded", "plain-seeded"])
def test_a_second_turn_from_the_cache_equals_a_cold_one(engine, drafter, k, params):
    def make(ids):
        return BatchRequest(ids, 10, params=params, drafter=drafter, num_draft_tokens=k)

    batch = BatchEngine(engine, BatchConfig(**CONFIG), request_drafters(engine))
    warm = conversation(batch, make)
    expected = cold(engine, make, **CONFIG)
    assert [r.token_ids for r in warm] == [r.token_ids for r in expected]
    assert warm[0].stats.cached_tokens == 0 and expected[1].stats.cached_tokens == 0
    prompt = len(warm[1].prompt_ids)
    assert warm[1].stats.cached_tokens >= (len(warm[0].prompt_ids) + len(warm[0].token_ids)) // 4 * 4 - 4
    assert warm[1].stats.cached_tokens < prompt
    snap = batch.snapshot()
    assert snap.prefix_cache.hit_tokens == warm[1].stats.cached_tokens and snap.kv_blocks_used == 0
    assert snap.prefix_cache.blocks_cached > 0 and snap.prefix_cache.blocks_evictable == snap.prefix_cache.blocks_cached


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.8, seed=11)],
                         ids=["greedy", "seeded"])
def test_a_block_drafter_gets_the_cached_hidden_states(engine, kind, params):
    """The pool keeps the tapped hidden states of cached slots: the drafter of a request that starts from the
    cache proposes exactly what it proposes cold, so the tokens are the same at T > 0 as well."""
    target, k = engine.target, 3
    model = block_model(kind, target)
    engine.drafter = HybridDrafter(DFlashDrafter(model, target), stop_ids={0})  # the pool keeps its layers
    try:
        logs: dict[str, list[list]] = {"warm": [], "cold": []}

        def factories(name):
            def factory():
                logs[name].append([])
                return RecordingDFlash(model, target, k, logs[name][-1])
            return {kind: factory}

        def make(ids):
            return BatchRequest(ids, 12, params=params, drafter=kind, num_draft_tokens=k)

        batch = BatchEngine(engine, BatchConfig(**CONFIG), factories("warm"))
        assert batch.pool.tap_layers == tuple(sorted(model.config.target_layer_ids))
        warm = conversation(batch, make)
        expected = cold(engine, make, factories("cold"), **CONFIG)
    finally:
        engine.drafter = None
    assert warm[1].stats.cached_tokens > 0
    assert [r.token_ids for r in warm] == [r.token_ids for r in expected]
    assert logs["warm"] == logs["cold"] and all(logs["warm"])


def test_requests_sharing_a_prefix_run_together(engine):
    """Several running requests share the blocks of a common prefix (published while the first one runs);
    each gives its cold tokens, and every block goes back when they finish."""
    head, _ = turns(1)
    requests = [BatchRequest(head + [i + 1, i + 2], 8 + i, drafter="ngram", num_draft_tokens=3 * (i % 2))
                for i in range(4)]
    batch = BatchEngine(engine, BatchConfig(**CONFIG), request_drafters(engine))
    warm = run_to_completion(batch, requests, join_every=3)
    off = BatchEngine(engine, BatchConfig(prefix_cache=False, **CONFIG), request_drafters(engine))
    assert [r.token_ids for r in warm] == [r.token_ids for r in run_to_completion(off, requests, join_every=3)]
    assert sum(r.stats.cached_tokens for r in warm) > 0
    assert batch.pool.blocks_used == 0 and batch.pool.reserved == 0


def test_eviction_under_a_small_pool_keeps_outputs_exact(engine):
    """A pool that cannot hold every prompt evicts cached blocks (least recently used first) as requests grow;
    outputs stay those of the cache-off engine."""
    config = dict(CONFIG, num_blocks=24)
    requests = [BatchRequest(p, 10, drafter="ngram", num_draft_tokens=2) for p in prompts(5, seed=3)] * 2
    batch = BatchEngine(engine, BatchConfig(**config), request_drafters(engine))
    off = BatchEngine(engine, BatchConfig(prefix_cache=False, **config), request_drafters(engine))
    warm = [run_to_completion(batch, [r])[0] for r in requests]
    assert [r.token_ids for r in warm] == [run_to_completion(off, [r])[0].token_ids for r in requests]
    assert batch.pool.blocks_cached <= 24 and batch.pool.blocks_used == 0
