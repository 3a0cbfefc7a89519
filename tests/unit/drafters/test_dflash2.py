"""DFlash2: dynamic convolution, path selector (greedy walk, sparse q), losslessness, save/load, training."""

from __future__ import annotations

import json

import pytest
import torch

from dflash2.drafters.dflash import DFlashDraftModel, DFlashDrafter
from dflash2.drafters.dflash2_parts import DynamicConv, PathSelector, best_tree, select_path, selector_loss
from dflash2.models.loading import load_transformer
from dflash2.train.dflash_trainer import train_dflash
from dflash2.verify.sampling import GREEDY, SamplingParams
from tests.unit.drafters.test_dflash_drafter import NEW_TOKENS, first_draft, make_model, plain_ids, prompt_ids, spec_ids
from tests.unit.train.test_dflash_training import repetitive_data, train_config


@pytest.fixture(scope="module")
def target(tiny_model_dirs):
    return load_transformer(tiny_model_dirs["qwen2"], "fp32")


def dflash2_model(target, seed: int = 0, **kwargs) -> DFlashDraftModel:
    settings = dict(selector_rank=8, selector_top_k=4, conv_group=8)
    settings.update(kwargs)
    model = make_model(target, 8, seed=seed, **settings)
    with torch.no_grad():  # leave the identity / zero-gate init, so that the new parts change the drafts
        for module in model.modules():
            if isinstance(module, DynamicConv):
                module.taps.weight.normal_(std=0.3)
        model.selector.gate.weight.normal_(std=1.0)
        model.selector.next_codes.weight.normal_(std=1.0)
        model.selector.prev_codes.weight.normal_(std=1.0)
    return model.eval()


def random_selector(seed: int = 0) -> PathSelector:
    """A selector whose pair term matters (the gate starts at zero otherwise): 20 rows, width 8, top 5."""
    torch.manual_seed(seed)
    selector = PathSelector(vocab_rows=20, width=8, rank=4, top_k=5)
    for weight in (selector.gate.weight, selector.prev_codes.weight, selector.next_codes.weight):
        torch.nn.init.normal_(weight)
    return selector


def test_dynamic_conv_starts_as_identity_and_never_crosses_a_block_boundary():
    conv = DynamicConv(16, 4, block_size=3)
    x = torch.randn(2, 6, 16)
    assert torch.equal(conv(x), x)
    torch.nn.init.normal_(conv.taps.weight)
    changed = x.clone()
    changed[:, 2] += 5.0  # last position of block 0
    out, out_changed = conv(x), conv(changed)
    assert torch.equal(out[:, 3:], out_changed[:, 3:])  # block 1 does not see block 0
    assert not torch.equal(out[:, 2], out_changed[:, 2])
    changed = x.clone()
    changed[:, 3] += 5.0  # first position of block 1 feeds position 4 through the previous tap
    assert not torch.equal(conv(changed)[:, 4], out[:, 4])


def test_an_untrained_selector_walks_the_top1_chain():
    selector = PathSelector(vocab_rows=20, width=8, rank=4, top_k=5)
    logits, hidden = torch.randn(6, 20), torch.randn(6, 8)
    path = select_path(selector, logits, hidden, pending_row=3, temperature=0.0)
    assert path.rows.tolist() == logits.argmax(-1).tolist() and path.q is None


def test_the_greedy_walk_maximizes_each_pair_score_after_the_previous_choice():
    selector = random_selector()
    logits, hidden = torch.randn(6, 20), torch.randn(6, 8)
    path = select_path(selector, logits, hidden, pending_row=20, temperature=0.0)  # pending outside the vocab
    previous = 20
    for t in range(6):
        candidates = logits[t].topk(5).indices
        scores = [logits[t, b] + (selector.prev_codes.weight[previous] * selector.gate(hidden[t])
                                  * selector.next_codes.weight[b]).sum() for b in candidates]
        previous = int(candidates[int(torch.stack(scores).argmax())])
        assert int(path.rows[t]) == previous
    assert path.rows.tolist() != logits.argmax(-1).tolist()  # the pair term changed the path (seeded)


def test_sampled_walks_return_the_sparse_distribution_they_sampled_from():
    selector = PathSelector(vocab_rows=20, width=8, rank=4, top_k=5)
    torch.nn.init.normal_(selector.gate.weight)
    path = select_path(selector, torch.randn(4, 20), torch.randn(4, 8), 2, 0.7, torch.Generator().manual_seed(0))
    assert path.q.shape == (4, 5) and torch.allclose(path.q.sum(-1), torch.ones(4))
    for t in range(4):
        assert int(path.rows[t]) in path.candidates[t].tolist()


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=0.8, top_k=40)], ids=["greedy", "sampled"])
def test_dflash2_decoding_is_lossless(target, params):
    prompt = prompt_ids()
    capacity = len(prompt) + NEW_TOKENS + 8
    drafter = DFlashDrafter(dflash2_model(target), target)
    runs = [spec_ids(target, drafter, prompt, capacity, params=params, generator=torch.Generator().manual_seed(2))
            for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == NEW_TOKENS
    if params.greedy:
        assert runs[0] == plain_ids(target, prompt, capacity)
    else:
        draft = first_draft(drafter, target, prompt, capacity, params)
        assert torch.allclose(draft.q_draft.sum(-1), torch.ones(5))
        assert int((draft.q_draft > 0).sum(-1).max()) <= 4  # sparse: the selector's top-K candidates only
        assert bool((draft.q_draft[torch.arange(5), draft.tokens] > 0).all())


def test_without_a_selector_the_tree_is_the_chain_plus_the_likeliest_other_nodes():
    logits, top, k, budget = torch.randn(3, 20, generator=torch.Generator().manual_seed(1)), 4, 3, 9
    rows, parents = best_tree(None, logits, torch.zeros(3, 8), pending_row=0, num_nodes=budget, top_k=top)
    candidates = logits.topk(top, dim=-1).indices  # [3, K]
    log_probs = torch.log_softmax(logits, dim=-1)  # [3, V] independent positions
    every = {}  # every node of the lattice (a path of candidate indices from the root) -> log P(accepted)
    frontier = [()]
    for t in range(k):
        frontier = [path + (j,) for path in frontier for j in range(top)]
        for path in frontier:
            every[path] = sum(float(log_probs[d, candidates[d, j]]) for d, j in enumerate(path))
    chain = (0,) * k  # the top-1 of each position is candidate index 0
    chain_nodes = {chain[: t + 1] for t in range(k)}
    others = sorted((p for p in every if p not in chain_nodes), key=every.get, reverse=True)[: budget - k]
    expected = {tuple(int(candidates[d, j]) for d, j in enumerate(path)) for path in chain_nodes | set(others)}
    assert len(rows) == budget and rows[:k] == logits.argmax(-1).tolist() and parents[:k] == [-1, 0, 1]
    assert {node_path(rows, parents, node) for node in range(budget)} == expected


def node_path(rows: list[int], parents: list[int], node: int) -> tuple[int, ...]:
    """The rows from the root down to ``node``."""
    path = []
    while node >= 0:
        path.append(rows[node])
        node = parents[node]
    return tuple(reversed(path))


@pytest.mark.parametrize("budget", [1, 4, 11, 200])
def test_with_a_selector_the_tree_starts_with_the_greedy_walk_and_is_a_valid_trie(budget):
    selector = random_selector()
    logits, hidden = torch.randn(4, 20), torch.randn(4, 8)
    rows, parents = best_tree(selector, logits, hidden, pending_row=20, num_nodes=budget)
    walk = select_path(selector, logits, hidden, 20, 0.0).rows.tolist()
    size = min(budget, 5 + 5**2 + 5**3 + 5**4)  # a budget past the whole lattice takes all of it
    assert len(rows) == len(parents) == size
    assert rows[: min(budget, 4)] == walk[:budget] and parents[:4] == [-1, 0, 1, 2][:budget]
    assert all(-1 <= parent < node for node, parent in enumerate(parents))  # parents precede children
    paths = [node_path(rows, parents, node) for node in range(size)]
    assert len(set(paths)) == size  # no two siblings carry the same row
    top = logits.topk(5).indices.tolist()  # the selector keeps the top 5
    assert all(row in top[t] for path in paths for t, row in enumerate(path)) and max(map(len, paths)) <= 4


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=0.8, top_k=40)], ids=["greedy", "sampled"])
def test_a_draft_tree_is_lossless_and_contains_the_chain(target, kind, params):
    prompt = prompt_ids()
    capacity = len(prompt) + NEW_TOKENS + 8
    model = dflash2_model(target) if kind == "dflash2" else make_model(target, 8)
    tree_drafter = DFlashDrafter(model, target, num_draft_tokens=4, num_paths=3)
    chain = first_draft(DFlashDrafter(model, target, num_draft_tokens=4), target, prompt, capacity, GREEDY, 4)
    tree = first_draft(tree_drafter, target, prompt, capacity, params, 4)
    assert tree.parents is not None and tree.q_draft is None and tree.depth == 4
    assert tree.tokens[:4].tolist() == chain.tokens.tolist() and tree.parents[:4] == [-1, 0, 1, 2]
    assert len(tree.tokens) == tree_drafter.max_draft_tokens == 12
    runs = [spec_ids(target, tree_drafter, prompt, capacity, params=params, generator=torch.Generator().manual_seed(2))
            for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == NEW_TOKENS
    if params.greedy:  # (at T > 0 the deterministic rule's exactness is tested in tests/unit/verify/test_tree.py and tests/statistical/test_tree_distribution.py)
        assert runs[0] == plain_ids(target, prompt, capacity)


def test_dflash2_weights_survive_save_and_load(target, tmp_path):
    model = dflash2_model(target, draft_vocab_size=30)
    model.set_draft_vocab(torch.arange(100, 130))
    loaded = DFlashDraftModel.from_pretrained(model.save_pretrained(tmp_path / "d"))
    assert json.loads((tmp_path / "d" / "config.json").read_text())["selector_rank"] == 8
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    prompt = prompt_ids()
    drafts = [first_draft(DFlashDrafter(m, target), target, prompt, 40, GREEDY).tokens for m in (model, loaded)]
    assert torch.equal(*drafts) and set(drafts[0].tolist()) <= set(range(100, 130))


def test_selector_loss_prefers_the_true_candidate():
    torch.manual_seed(0)
    selector = PathSelector(vocab_rows=10, width=4, rank=3, top_k=3)
    logits = torch.tensor([[3.0, 2.9, 2.8, 0, 0, 0, 0, 0, 0, 0]]).repeat(8, 1)
    hidden, labels = torch.randn(8, 4), torch.full((8,), 2)  # the true token is the third candidate
    previous, weights = torch.full((8,), 5), torch.ones(8)
    optimizer = torch.optim.Adam(selector.parameters(), lr=0.1)
    first = None
    for _ in range(150):
        loss = selector_loss(selector, logits, hidden, labels, previous, weights)
        first = loss.item() if first is None else first
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.5 * first
    path = select_path(selector, logits[:1], hidden[:1], 5, 0.0)
    assert path.rows.tolist() == [2]  # no longer the top-1 of the logits
    assert selector_loss(selector, logits, hidden, torch.full((8,), 9), previous, weights).item() == 0.0


def test_dflash2_training_lowers_the_loss_and_can_start_from_a_dflash_drafter(target, tmp_path):
    data = repetitive_data(tmp_path / "data")
    plain = train_dflash(train_config(tmp_path, data, "dflash", num_steps=4), target=target)
    config = train_config(tmp_path, data, "dflash2", num_steps=30, learning_rate=2e-2, warmup_steps=3,
                          anchors_per_sequence=32, selector_rank=8, selector_top_k=4, conv_group=8,
                          init_from=str(plain))
    final = train_dflash(config, target=target)
    losses = [json.loads(line)["loss"] for line in (tmp_path / "dflash2" / "train_log.jsonl").read_text().splitlines()]
    assert sum(losses[-5:]) < 0.8 * sum(losses[:5])
    trained = DFlashDraftModel.from_pretrained(final)
    assert trained.selector is not None and trained.layers[0].attn_conv is not None
    with pytest.raises(ValueError, match="differ"):
        train_dflash(train_config(tmp_path, data, "bad", num_layers=2, selector_rank=8, init_from=str(plain)),
                     target=target)


def test_the_held_out_check_scores_the_drafts_the_selector_proposes(target):
    """Training's acceptance check must draft like decoding does: with a selector, its walk, not the argmax."""
    from dflash2.train.evaluate import greedy_block_drafts, target_pass
    from dflash2.train.objective import block_hidden, build_anchor_batch, position_weights

    model = dflash2_model(target)
    prompt = prompt_ids()
    expected = first_draft(DFlashDrafter(model, target), target, prompt, 40, GREEDY, 7).tokens
    with torch.inference_mode():
        pending = target(prompt[None], logits="last").logits[0, -1].argmax()
        ids = torch.cat([prompt, pending[None], torch.arange(10, 20)])
        anchors = torch.tensor([len(prompt)])
        batch = build_anchor_batch(ids, anchors, 8, model.config.mask_token_id, position_weights(8, 4.0))
        hidden = block_hidden(model, target, target_pass(target, ids, model.config.target_layer_ids).hidden_states,
                              batch)
        drafts = greedy_block_drafts(model, target, hidden, model.logits(target, hidden), ids[anchors])
    assert drafts[0].tolist() == expected.tolist()
    assert drafts[0].tolist() != model.logits(target, hidden).argmax(-1)[1:].tolist()  # the selector mattered
