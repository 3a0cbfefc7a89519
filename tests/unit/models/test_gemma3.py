"""Gemma 3 against transformers (the oracle) on a tiny random model in fp32, with a sliding window far shorter than
the sequences: the logits of a full forward, of prefill + decode steps over the static cache, of verification blocks
and trees, of the paged pool's ragged forward and the batch engine's prefix cache; and in bf16 a block's rows bitwise
those of one token at a time (speculation stays lossless)."""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

from dflash2.decode.ragged import RaggedRow, ragged_forward
from dflash2.kv.paged import PagedKVPool
from dflash2.models.config import FULL, SLIDING
from dflash2.models.loading import load_transformer
from dflash2.verify.tree import compile_tree, target_positions, tree_attention_mask

WINDOW = 16
LAYER_TYPES = [SLIDING, SLIDING, FULL, SLIDING, SLIDING, FULL]


def gemma3_config() -> Gemma3TextConfig:
    rope = {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}
    return Gemma3TextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=len(LAYER_TYPES),
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24,  # not head_dim
        sliding_window=WINDOW, layer_types=LAYER_TYPES, rope_parameters=rope, max_position_embeddings=512,
        final_logit_softcapping=5.0, tie_word_embeddings=True, attn_implementation="eager")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    torch.manual_seed(7)
    model = Gemma3ForCausalLM(gemma3_config()).float().eval()
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):  # offsets from one: applying them (as 1 + w) must matter
            param.data.uniform_(-0.5, 0.5)
        elif param.dim() == 2:  # sharper logits than the default init
            param.data.mul_(2.0)
    path = tmp_path_factory.mktemp("gemma3")
    model.save_pretrained(str(path))
    return path, model


@pytest.fixture(scope="module")
def lean(saved):
    return load_transformer(saved[0], "fp32")


def _ids(batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(seed))


def _one_at_a_time(model, cache, tokens: list[int]) -> torch.Tensor:
    """Logits [T, V] of ``tokens`` fed one per forward (plain decoding)."""
    return torch.cat([model(torch.tensor([[t]]), cache=cache).logits[0] for t in tokens])


def test_config_reads_the_gemma3_layout(lean):
    options = lean.config.gemma3
    assert options is not None and options.sliding_window == WINDOW and options.layer_types == tuple(LAYER_TYPES)
    assert options.query_pre_attn_scalar == 24 and options.rope_local_theta == 10_000.0
    assert lean.config.rope_theta == 1_000_000.0 and lean.config.rope_scaling["rope_type"] == "linear"
    assert lean.config.tie_word_embeddings and lean.lm_head.weight is lean.embed.weight


@torch.inference_mode()
def test_logits_match_transformers_past_the_window(saved, lean):
    ids = _ids(2, 70, 3)  # over four windows
    assert torch.allclose(lean(ids).logits, saved[1](ids).logits, atol=1e-5, rtol=1e-5)


@torch.inference_mode()
def test_prefill_then_decode_steps_match_transformers(saved, lean):
    oracle = saved[1]
    ids = _ids(1, 60, 4)
    cache = lean.new_cache(128)
    got = [lean(ids[:, :40], cache=cache).logits]
    got += [lean(ids[:, i : i + 1], cache=cache).logits for i in range(40, 60)]  # each step past the window
    assert torch.allclose(torch.cat(got, dim=1), oracle(ids).logits, atol=1e-5, rtol=1e-5)
    out = oracle(ids[:, :40], use_cache=True)  # transformers' own cached decoding agrees too
    steps, past = [], out.past_key_values
    for i in range(40, 60):
        step = oracle(ids[:, i : i + 1], cache=past, use_cache=True)
        steps.append(step.logits)
        past = step.past_key_values
    assert torch.allclose(torch.cat(steps, dim=1), torch.cat(got[1:], dim=1), atol=1e-5, rtol=1e-5)


@torch.inference_mode()
def test_verification_blocks_and_trees_match_the_full_forward(lean):
    ids = _ids(1, 52, 5)
    full = lean(ids).logits[0]  # [52, V]
    cache = lean.new_cache(128)
    lean(ids[:, :45], cache=cache, logits="none")
    block = lean(ids[:, 45:], cache=cache).logits[0]  # k + 1 = 7 rows past the window
    assert torch.allclose(block, full[45:], atol=1e-5, rtol=1e-5)
    # a tree whose branch 0 -> 1 -> 3 continues the sequence: its nodes see their ancestors within the window
    parents = [-1, 0, -1, 1, 2]
    tokens = [int(ids[0, 45]), int(ids[0, 46]), 7, int(ids[0, 47]), 9]
    layout = compile_tree(parents)
    cache.rollback(44)
    root = int(ids[0, 44])
    logits = lean(torch.tensor([[root, *tokens]]), positions=target_positions(layout, 44)[None], cache=cache,
                  attn_mask=tree_attention_mask(layout, 44)[None]).logits[0]
    for row, position in ((0, 44), (1, 45), (2, 46), (4, 47)):  # the root and the nodes 0, 1, 3
        assert torch.allclose(logits[row], full[position], atol=1e-5, rtol=1e-5), f"row {row}"


@torch.inference_mode()
def test_ragged_paged_forward_matches_the_full_forward(lean):
    c = lean.config
    pool = PagedKVPool(c.num_layers, c.num_kv_heads, c.head_dim, num_blocks=64, block_size=4, dtype=lean.dtype)
    sequences = [_ids(1, n, 10 + n)[0].tolist() for n in (50, 23, 9)]
    tables = [pool.new_table(64) for _ in sequences]
    for table, seq in zip(tables, sequences):  # prefill all but the last 4 tokens, each alone
        ragged_forward(lean, pool, [RaggedRow(table, seq[:-4], all_logits=False)])
        table.rollback(len(seq) - 4)
    rows = [RaggedRow(table, seq[-4:], all_logits=True) for table, seq in zip(tables, sequences)]
    out = ragged_forward(lean, pool, rows).logits
    for r, seq in enumerate(sequences):
        full = lean(torch.tensor([seq])).logits[0, -4:]
        assert torch.allclose(out[r], full, atol=1e-5, rtol=1e-5), f"row {r}"


@torch.inference_mode()
def test_bf16_blocks_give_the_bits_of_one_token_at_a_time(saved):
    model = load_transformer(saved[0], "bf16")
    prompt = _ids(1, 40, 6)
    cache = model.new_cache(96)
    model(prompt, cache=cache, logits="none")
    block = _ids(1, 9, 8)[0].tolist()
    alone = _one_at_a_time(model, cache, block)
    for tokens in (1, 3, 9):
        cache.rollback(40)
        got = model(torch.tensor([block[:tokens]]), cache=cache).logits[0]
        assert torch.equal(got, alone[:tokens]), f"{tokens} tokens"


def _greedy(model, ids: list[int], new_tokens: int) -> list[int]:
    """Plain greedy decoding over the static cache, stopping at id 0 (the stand-in tokenizer's EOS)."""
    cache = model.new_cache(len(ids) + new_tokens + 1)
    logits = model(torch.tensor([ids]), cache=cache, logits="last").logits
    out: list[int] = []
    while len(out) < new_tokens:
        out.append(int(logits[0, -1].argmax()))
        if out[-1] == 0:
            break
        logits = model(torch.tensor([[out[-1]]]), cache=cache, logits="last").logits
    return out


@torch.inference_mode()
def test_server_prefix_cache_turns_equal_plain_decoding(lean):
    """The batch engine (paged pool, chunked prefill, n-gram verification) with its prefix cache: a second turn
    that starts from cached blocks far past the window gives plain decoding's tokens, as does the first."""
    from dflash2.decode.batch import BatchConfig, BatchEngine, BatchRequest, request_drafters
    from dflash2.decode.engine import Engine
    from tests.unit.decode.test_batch_engine import IdTokenizer
    from tests.unit.decode.test_batch_prefix_cache import conversation, turns

    engine = Engine(lean, IdTokenizer(), name="gemma3")
    batch = BatchEngine(engine, BatchConfig(num_blocks=64, block_size=4, adaptive_drafts=False,
                                            max_prefill_tokens=16), request_drafters(engine))
    warm = conversation(batch, lambda ids: BatchRequest(ids, 10, drafter="ngram", num_draft_tokens=4))
    assert warm[1].stats.cached_tokens > WINDOW
    first_ids, more = turns()
    assert warm[0].token_ids == _greedy(lean, first_ids, 10)
    assert warm[1].token_ids == _greedy(lean, first_ids + warm[0].token_ids + more, 10)
