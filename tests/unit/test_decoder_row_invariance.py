"""Row invariance of the whole decoder in bf16 (tiny random models, packed linear layers, the invariant attention):
a block of tokens, a tree, a chunked prefill and the server's ragged batch give every token bitwise the logits of
plain one-token-at-a-time decoding, so greedy speculative decoding equals plain greedy decoding in bf16 too."""

from __future__ import annotations

import pytest
import torch

from dflash2.decode.batch import BatchConfig, BatchEngine, BatchRequest, request_drafters, run_to_completion
from dflash2.decode.engine import Engine
from dflash2.decode.ragged import RaggedRow, WorkspaceCost, build_layout, ragged_forward
from dflash2.decode.stats import DecodeStats
from dflash2.drafters.model import ModelDrafter
from dflash2.drafters.ngram import NgramDrafter
from dflash2.kernels.attention import attention_kernel_available, attention_kernel_status
from dflash2.kv.paged import PagedKVPool
from dflash2.models.loading import load_transformer
from dflash2.verify import SamplingParams
from dflash2.verify.tree import compile_tree, target_positions, tree_attention_mask
from tests.pipelines import PIPELINES
from tests.unit.test_batch_engine import IdTokenizer, prompts, single
from tests.unit.test_speculative_greedy import NEW_TOKENS, RandomDrafter, plain_ids, repetitive_prompt, spec_ids

pytestmark = pytest.mark.skipif(not attention_kernel_available(),
                                reason=f"attention kernel unavailable: {attention_kernel_status()}")


@pytest.fixture(scope="module")
def models(tiny_model_dirs):
    return {key: load_transformer(path, "bf16") for key, path in tiny_model_dirs.items()}


@pytest.fixture(params=PIPELINES)
def pipeline(request) -> str:
    return request.param


def _prompt(length: int = 29) -> torch.Tensor:
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(length))


def _one_at_a_time(model, cache, tokens: list[int]) -> torch.Tensor:
    """Logits [T, V] of ``tokens`` fed one per forward (plain decoding)."""
    return torch.cat([model(torch.tensor([[t]]), cache=cache).logits[0] for t in tokens])


@pytest.mark.parametrize("key", ["qwen2", "llama"])
def test_a_block_of_1_to_17_tokens_gives_the_logits_of_one_token_at_a_time(models, key) -> None:
    model, prompt = models[key], _prompt()
    cache = model.new_cache(64)
    model(prompt[None], cache=cache, logits="none")
    block = _prompt(17).tolist()
    alone = _one_at_a_time(model, cache, block)
    for tokens in range(1, 18):
        cache.rollback(len(prompt))
        got = model(torch.tensor([block[:tokens]]), cache=cache).logits[0]
        assert torch.equal(got, alone[:tokens]), f"{tokens} tokens"


@pytest.mark.parametrize("key", ["qwen2", "llama"])
def test_chunked_prefill_equals_one_prefill(models, key) -> None:
    model, prompt = models[key], _prompt(40)
    whole = model(prompt[None], cache=model.new_cache(64)).logits[0]
    cache = model.new_cache(64)
    chunks = [model(prompt[None, start:end], cache=cache).logits[0] for start, end in ((0, 13), (13, 14), (14, 40))]
    assert torch.equal(torch.cat(chunks), whole)


def test_tree_nodes_get_the_logits_of_their_path_decoded_alone(models) -> None:
    model, prompt = models["qwen2"], _prompt()
    parents = [-1, 0, 0, 1, 2, 2, 3, 5]
    tokens = _prompt(len(parents)).tolist()
    layout = compile_tree(parents)
    cache = model.new_cache(64)
    model(prompt[None], cache=cache, logits="none")
    n = len(prompt)
    positions = target_positions(layout, n - 1)[None]  # [1, n + 1]: the root is the last prompt token
    mask = tree_attention_mask(layout, n - 1)[None]  # [1, nodes + 1, n + nodes]
    cache.rollback(n - 1)
    root = int(prompt[-1])
    tree_logits = model(torch.tensor([[root, *tokens]]), positions=positions, cache=cache, attn_mask=mask).logits[0]
    for node in range(len(parents)):
        path = [node]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        cache.rollback(n)
        alone = _one_at_a_time(model, cache, [tokens[i] for i in reversed(path)])
        assert torch.equal(tree_logits[node + 1], alone[-1]), f"node {node}"


def test_ragged_batch_rows_equal_each_row_alone_and_plain_decoding(models) -> None:
    """The server's forward: a prompt chunk, a verification block and a lone token in one padded batch."""
    model = models["llama"]
    c = model.config
    pool = PagedKVPool(c.num_layers, c.num_kv_heads, c.head_dim, num_blocks=64, block_size=4, dtype=model.dtype)
    prompts = [_prompt(n).tolist() for n in (9, 23, 14)]
    tables = [pool.new_table(64) for _ in prompts]
    for table, prompt in zip(tables, prompts):  # prefill each alone
        ragged_forward(model, pool, [RaggedRow(table, prompt, all_logits=False)])
        table.rollback(len(prompt))
    news = [_prompt(5).tolist(), _prompt(1).tolist(), _prompt(3).tolist()]
    rows = [RaggedRow(table, new, all_logits=True) for table, new in zip(tables, news)]
    batched = ragged_forward(model, pool, rows).logits
    for r, (row, prompt) in enumerate(zip(rows, prompts)):
        alone = ragged_forward(model, pool, [row]).logits[0]
        assert torch.equal(batched[r], alone), f"row {r}"
        cache = model.new_cache(64)
        model(torch.tensor([prompt]), cache=cache, logits="none")
        assert torch.equal(alone, _one_at_a_time(model, cache, news[r])), f"row {r} vs the decoder"


def test_attention_groups_bound_the_padded_workspace_and_change_no_bit(models) -> None:
    """A long prompt chunk next to short rows: with a small workspace budget the rows attend in several groups,
    each within the budget (unless a row alone exceeds it), and every row's logits and hidden states are bitwise
    those of one padded group."""
    model = models["llama"]
    c = model.config
    pool = PagedKVPool(c.num_layers, c.num_kv_heads, c.head_dim, num_blocks=256, block_size=4, dtype=model.dtype)
    prompts = [_prompt(n).tolist() for n in (9, 23, 14, 31, 5)]
    tables = [pool.new_table(96) for _ in prompts]
    for table, prompt in zip(tables, prompts):
        ragged_forward(model, pool, [RaggedRow(table, prompt, all_logits=False)])
        table.rollback(len(prompt))
    news = [_prompt(5).tolist(), _prompt(1).tolist(), _prompt(3).tolist(), _prompt(47).tolist(), _prompt(1).tolist()]
    rows = [RaggedRow(table, new, all_logits=True) for table, new in zip(tables, news)]
    rows.append(RaggedRow(pool.new_table(64), _prompt(40).tolist(), all_logits=False))  # a fresh prompt
    cost = WorkspaceCost.of(model)
    whole = build_layout(rows, model.device, cost, workspace_bytes=2**40)
    assert len(whole.groups) == 1
    budget = whole.workspace_bytes // 4
    split = build_layout(rows, model.device, cost, workspace_bytes=budget)
    assert len(split.groups) >= 3
    for group in split.groups:
        assert group.workspace_bytes <= budget or len(group.query_valid) == 1
    assert sorted(torch.cat([g.flat_index for g in split.groups]).tolist()) == list(range(len(whole.input_ids)))
    one = ragged_forward(model, pool, rows, hidden_layers=(0, 2), workspace_bytes=2**40)
    grouped = ragged_forward(model, pool, rows, hidden_layers=(0, 2), workspace_bytes=budget)
    assert grouped.workspace_bytes < one.workspace_bytes
    for r in range(len(rows)):
        assert torch.equal(grouped.logits[r], one.logits[r]), f"row {r}"
        for layer in (0, 2):
            assert torch.equal(grouped.hidden[r][layer], one.hidden[r][layer]), f"row {r} layer {layer}"


@pytest.mark.parametrize("k", range(1, 9))
def test_bf16_speculative_greedy_equals_plain_greedy(models, k, pipeline) -> None:
    target, prompt = models["qwen2"], repetitive_prompt()
    capacity = len(prompt) + NEW_TOKENS + 2 * k + 2
    expected = plain_ids(target, prompt, capacity)
    assert spec_ids(target, ModelDrafter(target, k), prompt, capacity, pipeline=pipeline) == expected
    assert spec_ids(target, RandomDrafter(k), prompt, capacity, pipeline=pipeline) == expected


@pytest.mark.parametrize("k", [2, 5])
def test_bf16_ngram_trees_equal_plain_greedy(models, k, pipeline) -> None:
    target, prompt = models["llama"], repetitive_prompt()
    drafter = NgramDrafter(k, num_candidates=3)
    capacity = len(prompt) + NEW_TOKENS + drafter.max_draft_tokens + 1
    stats = DecodeStats()
    assert spec_ids(target, drafter, prompt, capacity, stats=stats, pipeline=pipeline) == plain_ids(target, prompt,
                                                                                                   capacity)


@pytest.mark.parametrize("prefill_chunk", [512, 4], ids=["whole-prefill", "chunked-prefill"])
def test_bf16_batched_requests_give_their_plain_tokens(models, prefill_chunk) -> None:
    """The batch engine (ragged forward, paged cache) with drafts of mixed lengths next to three other prompts: each
    request's tokens equal plain decoding of it alone."""
    engine = Engine(models["qwen2"], IdTokenizer(), name="tiny")
    batch = BatchEngine(engine, BatchConfig(num_blocks=64, block_size=8, max_prefill_tokens=prefill_chunk),
                        request_drafters(engine))
    requests = [BatchRequest(p, 16, drafter="ngram", num_draft_tokens=k) for p, k in zip(prompts(4), (3, 0, 8, 5))]
    for request, result in zip(requests, run_to_completion(batch, requests)):
        plain = BatchRequest(request.prompt_ids, request.max_new_tokens, num_draft_tokens=0)
        assert result.token_ids == single(engine, request.prompt_ids, plain)


def test_bf16_seeded_sampling_is_the_same_alone_and_in_a_batch(models) -> None:
    engine = Engine(models["qwen2"], IdTokenizer(), name="tiny")
    batch = BatchEngine(engine, BatchConfig(num_blocks=64, block_size=8), request_drafters(engine))
    request = BatchRequest(prompts(1)[0], 12, params=SamplingParams(temperature=0.8, seed=7), drafter="ngram",
                           num_draft_tokens=3)
    others = [BatchRequest(p, 12, params=SamplingParams(temperature=1.0)) for p in prompts(3, seed=1)]
    alone = run_to_completion(batch, [request])[0].token_ids
    assert run_to_completion(batch, others[:2] + [request] + others[2:])[2].token_ids == alone
