"""End to end at T > 0 through ``Engine.generate`` with the target-conditioned PARD drafter (``dflash2``: each pass
reads the target's hidden state of the last verified position): the first four generated tokens must have exactly
the target's distribution (checks: tests/statistical/decode_paths.py), sync and overlapped, with top-p / top-k."""

from __future__ import annotations

import pytest
import torch

from dflash2.drafters.conditioned import ConditionedPardDrafter
from dflash2.drafters.conditioning import ConditioningConfig, TargetConditioning
from dflash2.verify import SamplingParams
from tests.statistical.decode_paths import (VOCAB, assert_lossless, closing_engine_samples, exact_joint, tiny_engine,
                                            tiny_target)

RUNS = 1000
SLOW_RUNS = 10_000
PROMPT = [1, 2, 3]
MASK = VOCAB - 1

CASES = {
    "conditioned-chain-top-p": (SamplingParams(temperature=0.9, top_p=0.8), "sync"),
    "conditioned-chain-overlap-top-k": (SamplingParams(temperature=1.0, top_k=4), "overlap"),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The target, the drafter's network (another tiny model, sharper) and a strong random conditioning."""
    target = tiny_target(tmp_path_factory.mktemp("cond-target"))
    draft = tiny_target(tmp_path_factory.mktemp("cond-draft"), seed=7, scale=1.5)
    conditioning = TargetConditioning(ConditioningConfig((0,), target.config.hidden_size, draft.config.hidden_size))
    conditioning.proj.weight.data.normal_(0, 1.0, generator=torch.Generator().manual_seed(3))
    return target, draft, conditioning.requires_grad_(False)


@pytest.mark.parametrize("runs", [RUNS, pytest.param(SLOW_RUNS, marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", list(CASES))
def test_conditioned_generation_has_the_target_distribution(models, name, runs):
    target, draft, conditioning = models
    params, pipeline = CASES[name]
    drafter = ConditionedPardDrafter(draft, MASK, conditioning, 3)
    samples = closing_engine_samples(tiny_engine(target, drafter, pipeline), PROMPT, params, runs)
    assert_lossless(samples, exact_joint(target, PROMPT, params))


@pytest.mark.parametrize("runs", [RUNS, pytest.param(SLOW_RUNS, marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", list(CASES))
def test_kv_conditioned_generation_has_the_target_distribution(models, name, runs):
    """The same with gated key / value conditioning (``drafters/kv_conditioned.py``), its gates open."""
    from dflash2.drafters.kv_conditioned import KVConditionedPardDrafter
    from dflash2.drafters.kv_conditioning import GatedKVConditioning, KVConditioningConfig

    target, draft, _ = models
    params, pipeline = CASES[name]
    kv = GatedKVConditioning(KVConditioningConfig((0,), target.config.hidden_size, draft.config.hidden_size,
                                                  draft.config.num_layers), seed=3)
    kv.gates.data.fill_(1.0)
    drafter = KVConditionedPardDrafter(draft, MASK, kv.requires_grad_(False), 3)
    samples = closing_engine_samples(tiny_engine(target, drafter, pipeline), PROMPT, params, runs)
    assert_lossless(samples, exact_joint(target, PROMPT, params))
