"""The single-request engine keeps the last generation's KV cache: a second turn starts from the common prefix and
gives exactly the tokens of a cold engine (greedy and seeded sampling, every kind of drafter), tiny model, fp32."""

from __future__ import annotations

import pytest
import torch

from dflash2.decode.engine import Engine
from dflash2.drafters.dflash import DFlashDrafter
from dflash2.drafters.hybrid import HybridDrafter
from dflash2.drafters.model import ModelDrafter
from dflash2.drafters.ngram import NgramDrafter
from dflash2.models.loading import load_transformer
from tests.unit.decode.test_batch_engine import IdTokenizer, block_model, prompts


@pytest.fixture(scope="module")
def target(tiny_model_dirs):
    return load_transformer(tiny_model_dirs["qwen2"], "fp32", "cpu")


def drafter_for(kind: str, target):
    if kind == "none":
        return None
    if kind == "ngram":
        return NgramDrafter(4, stop_ids={0})
    if kind == "ngram-tree":
        return NgramDrafter(3, stop_ids={0}, num_candidates=2)
    if kind == "model":
        return ModelDrafter(target, 3)
    block = DFlashDrafter(block_model("dflash2" if kind.startswith("dflash2") else "dflash", target), target, 3)
    return HybridDrafter(block, stop_ids={0}) if kind.endswith("+ngram") else block


def chat(engine: Engine, seed: int | None, temperature: float) -> list:
    """Three turns: each prompt is the previous prompt + its answer + new words (and a last unrelated prompt)."""
    g = torch.Generator().manual_seed(1)
    text = prompts(1, seed=2)[0] * 2
    results = []
    for turn in range(3):
        result = engine.generate(" ".join(map(str, text)), max_new_tokens=10, raw=True, temperature=temperature,
                                 seed=seed)
        results.append(result)
        text = text + result.token_ids + torch.randint(1, 256, (5 + turn,), generator=g).tolist()
    results.append(engine.generate(" ".join(map(str, prompts(1, seed=9)[0])), max_new_tokens=6, raw=True,
                                   temperature=temperature, seed=seed))
    return results


@pytest.mark.parametrize("kind, temperature, seed", [
    *[(kind, 0.0, None) for kind in ("none", "ngram", "ngram-tree", "model", "dflash", "dflash2+ngram")],
    *[(kind, 0.9, 5) for kind in ("none", "model", "dflash2+ngram")],
], ids=lambda v: {0.0: "greedy", 0.9: "seeded"}.get(v, "") if not isinstance(v, str) else v)
def test_turn_after_turn_equals_cold_generations(target, kind, temperature, seed):
    warm = Engine(target, IdTokenizer(), drafter=drafter_for(kind, target))
    cold = Engine(target, IdTokenizer(), drafter=drafter_for(kind, target), prefix_cache=False)
    got, expected = chat(warm, seed, temperature), chat(cold, seed, temperature)
    assert [r.token_ids for r in got] == [r.token_ids for r in expected]
    assert [r.stats.cached_tokens for r in expected] == [0, 0, 0, 0]
    cached = [r.stats.cached_tokens for r in got]
    assert cached[0] == 0 and cached[3] == 0  # nothing kept yet; an unrelated prompt
    assert all(cached[i] >= len(got[i - 1].prompt_ids) for i in (1, 2))  # the last turn's prompt at least
    assert all(cached[i] < len(got[i].prompt_ids) for i in (1, 2))


def test_the_kept_cache_follows_the_drafter_and_can_be_cleared(target):
    engine = Engine(target, IdTokenizer(), drafter=drafter_for("dflash", target))
    text = " ".join(map(str, prompts(1, seed=4)[0] * 2))
    engine.generate(text, max_new_tokens=4, raw=True)
    assert engine.generate(text, max_new_tokens=4, raw=True).stats.cached_tokens > 0
    engine.drafter = drafter_for("ngram", target)  # reads no hidden states: the kept cache has the wrong layout
    assert engine.generate(text, max_new_tokens=4, raw=True).stats.cached_tokens == 0
    assert engine.generate(text, max_new_tokens=4, raw=True).stats.cached_tokens > 0
    engine.clear_cache()
    assert engine.generate(text, max_new_tokens=4, raw=True).stats.cached_tokens == 0


def test_an_abandoned_stream_keeps_nothing(target):
    engine = Engine(target, IdTokenizer())
    text = " ".join(map(str, prompts(1, seed=4)[0]))
    stream = engine.stream(text, max_new_tokens=8, raw=True)
    next(stream)
    stream.close()
    assert engine._kept is None
    assert engine.generate(text, max_new_tokens=4, raw=True).stats.cached_tokens == 0
