"""The lean decoder against transformers (the oracle) on tiny random models, in fp32."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from dflash2.models.decoder import causal_mask
from dflash2.models.loading import load_transformer


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def pair(request, tiny_model_dirs):
    path = tiny_model_dirs[request.param]
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), load_transformer(path, "fp32")


@torch.inference_mode()
def test_logits_match_transformers(pair):
    oracle, lean = pair
    ids = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(3))
    expected = oracle(ids).logits
    assert torch.allclose(lean(ids).logits, expected, atol=1e-5, rtol=1e-5)


@torch.inference_mode()
def test_hidden_states_are_decoder_layer_outputs(pair):
    oracle, lean = pair
    ids = torch.randint(0, 256, (1, 17), generator=torch.Generator().manual_seed(4))
    # transformers: [embeddings, layer 0, layer 1, final norm(layer 2)]; the last entry is normed, so compare 0 and 1
    expected = oracle(ids, output_hidden_states=True).hidden_states
    out = lean(ids, hidden_layers=(1, 0), logits="none")
    assert out.logits is None
    assert torch.allclose(out.hidden_states[0], expected[2], atol=1e-5)
    assert torch.allclose(out.hidden_states[1], expected[1], atol=1e-5)


@torch.inference_mode()
def test_incremental_decoding_with_cache_equals_full_pass(pair):
    _, lean = pair
    ids = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(5))
    full = lean(ids).logits
    cache = lean.new_cache(64)
    pieces = [lean(ids[:, :11], cache=cache).logits]
    pieces += [lean(ids[:, i : i + 1], cache=cache).logits for i in range(11, 20)]
    pieces.append(lean(ids[:, 20:], cache=cache).logits)
    assert cache.length == 30
    assert torch.allclose(torch.cat(pieces, dim=1), full, atol=1e-5)


@torch.inference_mode()
def test_rollback_discards_rejected_positions(pair):
    _, lean = pair
    gen = torch.Generator().manual_seed(6)
    ids = torch.randint(0, 256, (1, 12), generator=gen)
    garbage = torch.randint(0, 256, (1, 7), generator=gen)
    follow = torch.randint(0, 256, (1, 3), generator=gen)
    cache = lean.new_cache(32)
    lean(ids, cache=cache)
    lean(garbage, cache=cache)  # a rejected draft block
    assert cache.length == 19
    cache.rollback(12)
    after_rollback = lean(follow, cache=cache).logits
    expected = lean(torch.cat([ids, follow], dim=1)).logits[:, 12:]
    assert torch.allclose(after_rollback, expected, atol=1e-5)


@torch.inference_mode()
def test_explicit_tree_mask_equals_causal_attention_on_each_branch(pair):
    """Two branches verified in one pass: [root, a1, a2, b1] with b1 a sibling of a1."""
    _, lean = pair
    gen = torch.Generator().manual_seed(7)
    prefix = torch.randint(0, 256, (1, 9), generator=gen)
    root, a1, a2, b1 = torch.randint(0, 256, (4,), generator=gen).tolist()
    cache = lean.new_cache(32)
    lean(prefix, cache=cache)
    visible_new = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 1]], dtype=torch.bool)
    mask = torch.cat([torch.ones(4, 9, dtype=torch.bool), visible_new], dim=1)[None]  # [1, 4, 13]
    positions = torch.tensor([[9, 10, 11, 10]])
    tree_logits = lean(torch.tensor([[root, a1, a2, b1]]), positions=positions, cache=cache, attn_mask=mask).logits
    branch_a = lean(torch.cat([prefix, torch.tensor([[root, a1, a2]])], dim=1)).logits[:, 9:]
    branch_b = lean(torch.cat([prefix, torch.tensor([[root, b1]])], dim=1)).logits[:, 9:]
    assert torch.allclose(tree_logits[:, :3], branch_a, atol=1e-5)
    assert torch.allclose(tree_logits[:, 3], branch_b[:, 1], atol=1e-5)


def test_causal_mask_offsets_queries_after_the_cached_prefix():
    mask = causal_mask(2, 5, "cpu")[0, 0]
    assert mask.tolist() == [[True, True, True, True, False], [True, True, True, True, True]]
