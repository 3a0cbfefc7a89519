"""The target-conditioned PARD drafter on real weights, built the way users build it (``--drafter dflash2
--draft-model DIR`` with a conditioned adapter directory): SmolLM2 as target and as the drafter's base, a random
adapter and a strong random conditioning, greedy identity with plain decoding in fp32 and bf16."""

from __future__ import annotations

import pytest
import torch

from dflash2.drafters import DraftTarget, build_drafter
from dflash2.drafters.conditioned import ConditionedPardDrafter
from dflash2.drafters.conditioning import ConditioningConfig, TargetConditioning
from dflash2.drafters.hybrid import HybridDrafter
from tests.e2e.conftest import SMOLLM2, lean_engine, model_dir
from tests.e2e.test_speculative_real import CODE_PROMPT, generate_with, plain_result


@pytest.fixture(scope="module")
def conditioned_dir(tmp_path_factory):
    from dflash2.train.pard_trainer import PardTrainConfig, build_model, save_adapter

    out = tmp_path_factory.mktemp("conditioned")
    config = PardTrainConfig(base_dir=str(model_dir(SMOLLM2, "fp32")), label_dirs="", out_dir=str(out / "unused"),
                             base_model=SMOLLM2, lora_rank=4, num_draft_tokens=4)
    model, mask_id, params, mask_embedding = build_model(config)
    generator = torch.Generator().manual_seed(0)
    for param in params:  # a random adapter: B is zero-initialised, so give every update some weight
        param.data.normal_(0, 0.01, generator=generator)
    conditioning = TargetConditioning(ConditioningConfig((3, 15), model.config.hidden_size, model.config.hidden_size))
    conditioning.proj.weight.data.normal_(0, 0.05, generator=generator)
    return save_adapter(out / "drafter", model, mask_embedding, config, mask_id, conditioning=conditioning)


@pytest.mark.model
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("spec", ["dflash2:4", "dflash2+ngram"])
def test_conditioned_drafter_from_its_directory_is_lossless(conditioned_dir, dtype, spec):
    engine = lean_engine(SMOLLM2, dtype)
    drafter = build_drafter(spec, DraftTarget(engine.target, engine.tokenizer, SMOLLM2),
                            draft_model=str(conditioned_dir), dtype=dtype)
    block = drafter.block if isinstance(drafter, HybridDrafter) else drafter
    assert isinstance(block, ConditionedPardDrafter) and block.hidden_layers == (3, 15)
    spec_result = generate_with(engine, drafter, CODE_PROMPT, max_new_tokens=48)
    plain = plain_result(SMOLLM2, CODE_PROMPT, 48) if dtype == "fp32" else \
        lean_engine(SMOLLM2, dtype).generate(CODE_PROMPT, max_new_tokens=48)
    assert spec_result.token_ids == plain.token_ids
    assert sum(spec_result.stats.drafted_by_position) > 0
