"""The dflash+ngram drafter: prompt lookup on long matches, the block drafter otherwise; lossless either way."""

from __future__ import annotations

import pytest
import torch

from dflash2.drafters.dflash import DFlashDrafter
from dflash2.drafters.hybrid import HybridDrafter
from dflash2.models.loading import load_transformer
from dflash2.verify.sampling import GREEDY, SamplingParams
from tests.unit.drafters.test_dflash_drafter import NEW_TOKENS, first_draft, make_model, plain_ids, spec_ids


@pytest.fixture(scope="module")
def target(tiny_model_dirs):
    return load_transformer(tiny_model_dirs["qwen2"], "fp32")


def hybrid(target, **kwargs) -> HybridDrafter:
    return HybridDrafter(DFlashDrafter(make_model(target, 8), target), **kwargs)


def test_a_long_match_is_drafted_by_lookup_and_a_short_one_by_the_block(target):
    motif = [21, 22, 23, 24, 25, 26, 27, 28]
    repeating = torch.tensor([5, *motif, 9, 30, 31, *motif[:3]])  # the last 3 tokens occurred before
    drafter = hybrid(target, min_match=3, min_tokens=4)
    draft = first_draft(drafter, target, repeating, len(repeating) + 24, GREEDY)
    pending = drafter.block.cache.length  # the prompt's last position; the pending token was appended
    assert drafter.ngram_steps + drafter.block_steps == 1 and pending == len(repeating)
    random_prompt = torch.tensor([90, 17, 3, 250, 41, 8])
    drafter = hybrid(target, min_match=3, min_tokens=4)
    draft = first_draft(drafter, target, random_prompt, len(random_prompt) + 24, GREEDY)
    assert drafter.block_steps == 1 and drafter.ngram_steps == 0 and len(draft.tokens) == 5


def test_lookup_drafts_continue_the_earlier_occurrence(target):
    sequence = [5, 21, 22, 23, 24, 25, 26, 9, 21, 22, 23]
    drafter = hybrid(target, min_match=3, min_tokens=2)
    draft = drafter.propose(sequence, 5, GREEDY, None)  # no block call needed: the lookup wins
    assert draft.tokens.tolist() == [24, 25, 26, 9, 21] and draft.q_draft is None and drafter.ngram_steps == 1


def test_the_planners_can_ask_whether_a_step_runs_the_network(target):
    """A lookup draft costs ~nothing, a block pass does: the batch planner asks before granting drafts."""
    drafter = hybrid(target, min_match=3, min_tokens=2)
    assert not drafter.runs_a_pass([5, 21, 22, 23, 24, 25, 26, 9, 21, 22, 23], 5)  # a long match: lookup
    assert drafter.runs_a_pass([90, 17, 3, 250, 41, 8], 5)  # none: the block drafter's pass
    assert drafter.unread([1, 2, 3]) == 0  # DFlash is fed the target's states, it never catches up on ids


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=0.8)], ids=["greedy", "sampled"])
def test_hybrid_decoding_is_lossless_and_deterministic(target, params):
    prompt = torch.tensor([7, 8, 9, 10, 11, 12, 7, 8, 9, 10, 11, 12, 7, 8, 9])  # lookup fires, then the block
    capacity = len(prompt) + NEW_TOKENS + 16
    drafter = hybrid(target, min_match=2, min_tokens=2)
    runs = [spec_ids(target, drafter, prompt, capacity, params=params, generator=torch.Generator().manual_seed(1))
            for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == NEW_TOKENS
    assert drafter.block_steps > 0
    if params.greedy:  # (sampled pending tokens need not repeat the pattern, so lookup may never fire there)
        assert drafter.ngram_steps > 0
        assert runs[0] == plain_ids(target, prompt, capacity)


def test_a_tree_drafting_block_keeps_the_hybrid_lossless_and_sized_for_its_tree(target):
    prompt = torch.tensor([7, 8, 9, 10, 11, 12, 7, 8, 9, 10, 11, 12, 7, 8, 9])
    capacity = len(prompt) + NEW_TOKENS + 16
    drafter = HybridDrafter(DFlashDrafter(make_model(target, 8), target, num_draft_tokens=4, num_paths=3),
                            min_match=2, min_tokens=2)
    assert drafter.max_draft_tokens == 12  # the block's tree (3 paths of 4) is larger than the lookup's 4
    assert spec_ids(target, drafter, prompt, capacity) == plain_ids(target, prompt, capacity)
    assert drafter.block_steps > 0 and drafter.ngram_steps > 0


def test_auto_means_the_drafter_measured_fastest_for_the_target():
    from dflash2.drafters import DraftHardware, default_drafter

    tiles = DraftHardware(tile_verification=True, amx_verification=True)  # bf16 / int8 on whole-K AMX tiles
    gguf_amx = DraftHardware(amx_verification=True)  # the gguf kernel's AMX build
    assert default_drafter("qwen2.5-coder-1.5b-instruct") == "pard+ngram:4x2" == default_drafter("qwen-1.5b")
    assert default_drafter("qwen2.5-coder-1.5b-instruct", serving=True) == "dflash2+ngram"
    assert default_drafter("smollm2", serving=True) == "ngram"
    assert default_drafter("smollm2") == "ngram" and default_drafter("/some/local/dir") == "ngram"
    # where the target verifies on AMX bf16 tiles (16 rows cost about 4), one request drafts a tree
    assert default_drafter("qwen-1.5b", hardware=tiles) == "pard+ngram:4x3"
    assert default_drafter("qwen-1.5b", hardware=gguf_amx) == "pard+ngram:4x2"  # rows cost more: a narrower tree
    # the server drafts with pard only where the target verifies on tiles (elsewhere its pass costs more than it saves)
    assert default_drafter("qwen-1.5b", serving=True, hardware=tiles) == "pard+ngram"
    assert default_drafter("qwen-1.5b", serving=True, hardware=gguf_amx) == "pard+ngram"
    assert default_drafter("smollm2", serving=True, hardware=tiles) == "ngram"
    assert default_drafter("smollm2", hardware=tiles) == "ngram"


def test_every_auto_row_names_its_measurement():
    from dflash2.drafters.spec import AUTO_DRAFTERS, VERIFICATION, DrafterSpec

    for row in AUTO_DRAFTERS:
        assert row.verification in VERIFICATION and DrafterSpec.parse(row.spec).name != "auto"
        assert "2026-" in row.measured and "commit" in row.measured and "`" in row.measured, row  # date, commit, command


def test_auto_resolves_to_the_tree_only_without_a_shape_of_its_own():
    from dflash2.drafters.spec import DrafterSpec
    from dflash2.platform import DraftHardware

    tiles = DraftHardware(tile_verification=True, amx_verification=True)
    auto = DrafterSpec.parse("auto")
    assert str(auto.resolved("qwen-1.5b", hardware=tiles)) == "pard+ngram:4x3"
    assert str(auto.resolved("qwen-1.5b")) == "pard+ngram:4x2"
    assert str(DrafterSpec.parse("auto:3").resolved("qwen-1.5b", hardware=tiles)) == "pard+ngram:3"
    assert str(DrafterSpec.parse("auto:2x2").resolved("qwen-1.5b", hardware=tiles)) == "pard+ngram:2x2"
    assert DrafterSpec.parse("ngram").resolved("qwen-1.5b", hardware=tiles) == DrafterSpec.parse("ngram")


def test_tile_verification_is_true_only_for_linear_layers_on_whole_k_amx_tiles():
    import pytest
    import torch

    from dflash2.kernels import packed_linear
    from dflash2.models.config import ModelConfig
    from dflash2.models.decoder import Transformer

    config = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4,
                         num_kv_heads=2, head_dim=8)
    model = Transformer(config)
    assert not packed_linear.tile_verification(model)  # nn.Linear
    if not packed_linear.amx_usable():
        pytest.skip("no AMX tiles on this CPU")
    ffn = model.layers[0].ffn
    ffn.w_gate_up = packed_linear.PackedLinear.from_linear(ffn.w_gate_up, backend=packed_linear.AMX)
    assert packed_linear.tile_verification(model)
    ffn.w_gate_up = packed_linear.PackedLinear.from_linear(torch.nn.Linear(32, 128, bias=False),
                                                           backend=packed_linear.TORCH)
    assert not packed_linear.tile_verification(model)
    from dflash2.kernels.quant_linear import QuantLinear

    ffn.w_gate_up = QuantLinear.from_linear(torch.nn.Linear(32, 128, bias=False), "int8", backend="amx")
    assert packed_linear.tile_verification(model)  # int8 widened to bf16 tiles: as flat as bf16
    from dflash2.kernels.gguf_linear import GgufLinear

    assert not GgufLinear.flat_on_tiles  # its AMX build's per-block steps grow with the rows


def test_amx_verification_counts_every_layer_on_amx_tiles_the_gguf_build_too():
    import pytest
    import torch

    from dflash2.kernels import gguf_linear, packed_linear
    from dflash2.models.config import ModelConfig
    from dflash2.models.decoder import Transformer

    config = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4,
                         num_kv_heads=2, head_dim=8)
    model = Transformer(config)
    ffn = model.layers[0].ffn
    assert not packed_linear.amx_verification(model)  # nn.Linear
    weight = torch.randn(128, 256)
    ffn.w_gate_up = gguf_linear.GgufLinear.from_weight(weight, backend=gguf_linear.TORCH)
    assert not packed_linear.amx_verification(model) and not packed_linear.tile_verification(model)
    if not packed_linear.amx_usable() or not gguf_linear.gguf_kernels_available(gguf_linear.AMX):
        pytest.skip("no AMX tiles on this CPU")
    ffn.w_gate_up = gguf_linear.GgufLinear.from_weight(weight, backend=gguf_linear.AMX)
    assert packed_linear.amx_verification(model)  # the server drafts with pard there
    assert not packed_linear.tile_verification(model)  # one request: a chain, not a tree
    ffn.w_gate_up = packed_linear.PackedLinear.from_linear(torch.nn.Linear(256, 128, bias=False),
                                                           backend=packed_linear.AMX)
    assert packed_linear.amx_verification(model) and packed_linear.tile_verification(model)
