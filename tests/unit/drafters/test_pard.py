"""PARD: one forward drafts k tokens; cache rollback; q_draft; greedy identity and T > 0 reproducibility through the
speculative loop; the training blocks equal the draft pass; LoRA merge; adapter round trip; resumable training."""

from __future__ import annotations

import itertools

import pytest
import torch

from dflash2.decode.cost_model import ForwardCost
from dflash2.decode.draft_length import AdaptiveConfig, AdaptiveDraftLength, FixedDraftLength
from dflash2.decode.plain import plain_decode
from dflash2.decode.stats import DecodeStats
from dflash2.drafters.model import ModelDrafter
from dflash2.drafters.lora import LoRALinear, adapter_state, add_lora, merge_lora
from dflash2.drafters.pard import PardDrafter, load_pard_model
from dflash2.drafters.pard_tree import Candidates, lead_tree
from dflash2.models.loading import load_transformer
from dflash2.platform import reload_settings
from dflash2.train.data import TrainingSequence, write_token_shards
from dflash2.train.labels import HardLabels, LabelConfig, LabelShards, generate_labels
from dflash2.train.pard_objective import block_hidden, build_pard_batch, row_weights, sample_blocks
from dflash2.train.pard_trainer import PardTrainConfig, latest_checkpoint, train_pard
from dflash2.verify.sampling import GREEDY, SamplingParams
from tests.pipelines import PIPELINES, speculative_steps

MASK = 255
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def models(tiny_model_dirs):
    return {key: load_transformer(path, "fp32") for key, path in tiny_model_dirs.items()}


def prompt() -> torch.Tensor:
    return torch.randint(0, 250, (13,), generator=torch.Generator().manual_seed(5))


def run(steps, limit=NEW_TOKENS) -> list[int]:
    return list(itertools.islice(itertools.chain.from_iterable(steps), limit))


def full_logits(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0]


def propose_counting_ids(drafter, sequence: list[int], k: int):
    """A greedy ``drafter.propose`` and the number of ids each forward of its network was fed."""
    fed: list[int] = []
    hook = drafter.model.embed.register_forward_hook(lambda module, args, out: fed.append(args[0].shape[1]))
    try:
        return drafter.propose(sequence, k, GREEDY, None), fed
    finally:
        hook.remove()


def test_one_forward_drafts_k_and_the_cache_keeps_committed_ids_only(models):
    model = models["qwen2_other"]
    drafter = PardDrafter(model, MASK, num_draft_tokens=4)
    drafter.reset(64)
    sequence = prompt().tolist()
    logits = drafter.draft_logits(sequence, 4)  # [4, V]
    assert logits.shape == (4, model.config.vocab_size)
    assert drafter.cache.length == len(sequence) and drafter.cached_tokens == sequence
    expected = full_logits(model, sequence + [MASK] * 3)[len(sequence) - 1 :]
    expected[:, MASK] = float("-inf")
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    # a step later: two drafts accepted plus a recovered token, the rest rejected (roll back and feed the new ids)
    sequence += [7, 8, 9]
    logits = drafter.draft_logits(sequence, 3)
    assert drafter.cache.length == len(sequence)
    expected = full_logits(model, sequence + [MASK] * 2)[len(sequence) - 1 :]
    expected[:, MASK] = float("-inf")
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    # the committed sequence diverges from what the cache holds (another request): rolled back to the shared prefix
    other = sequence[:5] + [1, 2, 3]
    logits = drafter.draft_logits(other, 2)
    expected = full_logits(model, other + [MASK])[len(other) - 1 :]
    expected[:, MASK] = float("-inf")
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    assert drafter.cached_tokens == other


@pytest.mark.parametrize("kind", ["pard", "model"])
def test_prefill_reads_the_prompt_so_the_first_pass_reads_only_the_pending_id(models, kind):
    """The prompt read during prefill: same drafts as reading it lazily, and the first draft pass feeds 1 id."""
    model = models["qwen2_other"]
    make = (lambda: PardDrafter(model, MASK, num_draft_tokens=3)) if kind == "pard" else (
        lambda: ModelDrafter(model, num_draft_tokens=3))
    sequence = prompt().tolist() + [17]  # the last id is pending (sampled from the target's prefill)
    lazy, eager = make(), make()
    lazy.reset(64), eager.reset(64)
    eager.prefill(sequence[:-1])
    assert eager.cached_tokens == sequence[:-1] and eager.cache.length == len(sequence) - 1
    drafted, fed = propose_counting_ids(eager, sequence, 3)
    assert fed[0] == (3 if kind == "pard" else 1)  # the pending id (+ 2 masks for pard), not the prompt again
    assert drafted.tokens.tolist() == lazy.propose(sequence, 3, GREEDY, None).tokens.tolist()
    eager.prefill(sequence[:4] + [1, 2])  # another prompt sharing 4 ids: rolled back to them, then extended
    assert eager.cached_tokens == sequence[:4] + [1, 2] and eager.cache.length == 6


def test_q_draft_is_each_positions_distribution(models):
    drafter = PardDrafter(models["qwen2_other"], MASK, num_draft_tokens=5)
    drafter.reset(64)
    params = SamplingParams(temperature=0.8, top_p=0.9)
    draft = drafter.propose(prompt().tolist(), 5, params, torch.Generator().manual_seed(0))
    assert draft.q_draft.shape == (5, models["qwen2_other"].config.vocab_size)
    torch.testing.assert_close(draft.q_draft.sum(-1), torch.ones(5))
    assert bool((draft.q_draft.gather(1, draft.tokens[:, None]) > 0).all())  # every draft is in its support
    assert bool((draft.q_draft[:, MASK] == 0).all())  # the mask id is never drafted
    greedy = drafter.propose(prompt().tolist(), 5, GREEDY, None)
    assert greedy.q_draft is None and len(greedy.tokens) == 5


@pytest.mark.parametrize("pipeline", PIPELINES)
@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("drafter_key", ["qwen2", "qwen2_other"])
def test_greedy_identity(models, k, drafter_key, pipeline):
    target, ids = models["qwen2"], prompt()
    capacity = len(ids) + NEW_TOKENS + k + 1
    plain = run(plain_decode(target, ids, GREEDY, None, capacity, DecodeStats()))
    stats = DecodeStats()
    drafter = PardDrafter(models[drafter_key], MASK, k)
    spec = run(speculative_steps(pipeline, target, drafter, ids, GREEDY, None, capacity, stats))
    assert spec == plain
    if drafter_key == "qwen2":  # the target itself drafts: draft 1 is its own greedy token, always accepted
        assert stats.accepted_by_position[0] == stats.drafted_by_position[0]


class PricedRows(ForwardCost):
    """Verification priced at (1 + n) / 2 plain steps for n rows whatever the tiny models' own times (next to nothing
    at any size), so that trimming a draft has something to trade."""

    def __init__(self) -> None:
        super().__init__(prior=(0.5, 0.5))

    def record(self, num_tokens: int, seconds: float) -> None:
        pass


class CountingTrims(AdaptiveDraftLength):
    """The adaptive policy over :class:`PricedRows`, keeping (nodes proposed, nodes kept) of every trim."""

    def __init__(self, k_max: int) -> None:
        super().__init__(AdaptiveConfig(k_max=k_max, per_pass=True), PricedRows())
        self.trims: list[tuple[int, int]] = []

    def trim(self, draft):
        kept = super().trim(draft)
        self.trims.append((len(draft.tokens), len(kept.tokens)))
        return kept


@pytest.mark.parametrize("width", [1, 2], ids=["chain", "tree"])
@pytest.mark.parametrize("drafter_key", ["qwen2", "qwen2_other"])
def test_drafts_trimmed_by_their_confidence_stay_lossless(models, drafter_key, width):
    """The adaptive policy trims each draft by the drafter's probabilities (decode/draft_length.py): greedy output
    equals plain decoding's, every trim keeps at least one node, and some drafts were cut."""
    target, ids = models["qwen2"], prompt()
    drafter = PardDrafter(models[drafter_key], MASK, 4, num_paths=width)
    capacity = len(ids) + NEW_TOKENS + drafter.max_draft_tokens + 1
    plain = run(plain_decode(target, ids, GREEDY, None, capacity, DecodeStats()))
    policy = CountingTrims(k_max=4)
    assert run(speculative_steps("sync", target, drafter, ids, GREEDY, None, capacity, DecodeStats(), policy)) == plain
    assert policy.trims and all(kept >= 1 for _, kept in policy.trims)
    assert any(kept < proposed for proposed, kept in policy.trims)


def test_each_draft_carries_the_drafters_probability_of_it(models):
    """Greedy: the softmax probability of each position's argmax; a tree: each node's probability at its depth;
    sampled: q_draft of the token drawn."""
    drafter_model, ids = models["qwen2_other"], prompt().tolist()
    chain, tree = PardDrafter(drafter_model, MASK, 3), PardDrafter(drafter_model, MASK, 3, num_paths=2)
    chain.reset(64), tree.reset(64)
    logits = chain.draft_logits(ids, 3)  # [3, V]
    probs = torch.softmax(logits, dim=-1)
    greedy = chain.propose(ids, 3, GREEDY, None)
    assert torch.allclose(greedy.confidence, probs.max(dim=-1).values, atol=1e-6)
    drafted = tree.propose(ids, 3, GREEDY, None)
    depths = [0, 1, 2] + [None] * 3
    for node, parent in enumerate(drafted.parents):
        depths[node] = 0 if parent < 0 else depths[parent] + 1
        assert drafted.confidence[node] == pytest.approx(float(probs[depths[node], drafted.tokens[node]]), abs=1e-6)
    sampled = chain.propose(ids, 3, SamplingParams(temperature=0.8), torch.Generator().manual_seed(1))
    assert torch.equal(sampled.confidence, sampled.q_draft.gather(1, sampled.tokens[:, None])[:, 0])


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=0.8, seed=3)], ids=["greedy", "sampled"])
def test_tree_drafts_keep_the_chain_and_stay_lossless(models, params):
    """pard:kxW: a deterministic tree of k * W nodes whose first k nodes are the greedy chain; greedy output equal to
    plain decoding's; at T > 0 the same seed gives the same tokens (the exact tree rule; distribution: the
    statistical tests of trees)."""
    target, drafter_model, ids = models["qwen2"], models["qwen2_other"], prompt()
    chain, tree = PardDrafter(drafter_model, MASK, 3), PardDrafter(drafter_model, MASK, 3, num_paths=2)
    assert tree.max_draft_tokens == 6 and tree.for_request().num_paths == 2
    chain.reset(64), tree.reset(64)
    sequence = ids.tolist()
    drafted = tree.propose(sequence, 3, GREEDY, None)
    assert len(drafted.tokens) == 6 and drafted.parents[:3] == [-1, 0, 1]
    assert drafted.tokens[:3].tolist() == chain.propose(sequence, 3, GREEDY, None).tokens.tolist()
    capacity = len(ids) + NEW_TOKENS + tree.max_draft_tokens + 1
    if params.greedy:
        plain = run(plain_decode(target, ids, GREEDY, None, capacity, DecodeStats()))
        assert run(speculative_steps("sync", target, tree, ids, GREEDY, None, capacity, DecodeStats())) == plain
        return
    runs = [run(speculative_steps("sync", target, tree.for_request(), ids, params, params.make_generator("cpu"),
                                  capacity, DecodeStats())) for _ in range(2)]
    assert runs[0] == runs[1]


def test_lead_tokens_are_drafted_one_per_pass_then_the_rest_in_one(models):
    """pard:1+3: the lead token is the next-token argmax after the sequence (a pass without masks), the other
    three are what a k = 3 pass drafts after the sequence extended by it; the cache keeps the lead token read."""
    model = models["qwen2_other"]
    lead, alone = PardDrafter(model, MASK, 4, lead_tokens=1), PardDrafter(model, MASK, 3)
    lead.reset(64), alone.reset(64)
    sequence = prompt().tolist()
    drafted, fed = propose_counting_ids(lead, sequence, 4)
    assert fed == [len(sequence), 1 + 2]  # the sequence, then the lead token + two masks
    expected = full_logits(model, sequence)[-1]
    expected[MASK] = float("-inf")
    first = int(expected.argmax())
    assert drafted.tokens[0] == first and drafted.q_draft is None and drafted.parents is None
    assert drafted.tokens[1:].tolist() == alone.propose(sequence + [first], 3, GREEDY, None).tokens.tolist()
    assert lead.cached_tokens == sequence + [first]
    assert len(lead.propose(sequence, 1, GREEDY, None).tokens) == 1  # k = 1 leaves no room for a lead: one pass


def test_a_lead_tree_hangs_each_nodes_children_from_the_pass_that_knew_its_parent():
    """lead_tree: the top chain first (lead token, then the last pass's top drafts); the lead token's children come
    from the next pass, every other node's from its own pass's next position; the rest best-first by probability."""
    first = Candidates(rows=[[10, 11, 12], [20, 21, 22]], log_p=[[-0.1, -2.5, -3.0], [-0.5, -1.0, -4.0]])
    after_10 = Candidates(rows=[[30, 31, 32], [40, 41, 42]], log_p=[[-0.2, -2.0, -3.0], [-0.3, -1.5, -5.0]])
    assert lead_tree([first, after_10], 2) == ([10, 30], [-1, 0])
    # chain 10 -> 30 -> 40 (log P -0.1, -0.3, -0.6); then 41 under 30 (-1.8), 31 under 10 (-2.1), 40 under 31
    # (-2.4: pass 1's next position), 11 for draft 1 (-2.5), 12 (-3.0, tied with 20 under 11 and pushed earlier),
    # 20 under 11 (-3.0: pass 0's second position, which did not know the lead token)
    rows, parents = lead_tree([first, after_10], 9)
    assert rows == [10, 30, 40, 41, 31, 40, 11, 12, 20]
    assert parents == [-1, 0, 1, 1, 0, 4, -1, -1, 6]
    assert lead_tree([first], 4) == ([10, 20, 21, 11], [-1, 0, 0, -1])  # one pass: best_tree without a selector
    with pytest.raises(ValueError, match="num_nodes"):
        lead_tree([first], 0)


def test_a_lead_tree_drafts_the_chain_of_its_passes(models):
    """pard:1+3x2: two passes of 3 drafts; the tree's first nodes are the lead token and the second pass's chain
    (what pard:3 drafts after the lead token), 1 + 3 * 2 nodes in all, deterministic at T > 0 too."""
    model = models["qwen2_other"]
    lead, chain = PardDrafter(model, MASK, 4, num_paths=2, lead_tokens=1), PardDrafter(model, MASK, 3)
    assert lead.max_draft_tokens == 1 + 3 * 2 and lead.for_request().lead_tokens == 1
    assert lead.shared_pass([1, 2], 4) is None  # a lead's passes are not shared (nor a tree's)
    assert PardDrafter(model, MASK, 4, lead_tokens=1).shared_pass([1, 2], 4) is None
    lead.reset(64), chain.reset(64)
    sequence = prompt().tolist()
    drafted = lead.propose(sequence, 4, SamplingParams(temperature=0.7), torch.Generator().manual_seed(0))
    first = full_logits(model, sequence)[-1]
    first[MASK] = float("-inf")
    assert int(drafted.tokens[0]) == int(first.argmax()) and drafted.q_draft is None
    after = chain.propose(sequence + [int(drafted.tokens[0])], 3, GREEDY, None).tokens.tolist()
    assert drafted.tokens[1:4].tolist() == after and drafted.parents[:4] == [-1, 0, 1, 2]
    assert len(drafted.tokens) == 7 and lead.cached_tokens == sequence + [int(drafted.tokens[0])]
    with pytest.raises(ValueError, match="lead_tokens"):
        PardDrafter(model, MASK, 2, lead_tokens=2)


@pytest.mark.parametrize("pipeline", PIPELINES)
@pytest.mark.parametrize("shape", [(1, 3, 1), (2, 4, 1), (1, 3, 2)], ids=["1+2", "2+2", "1+2x2"])
def test_lead_drafts_are_lossless(models, shape, pipeline):
    """Greedy output equal to plain decoding's with lead tokens (a chain and a tree below a trunk); at T > 0 the
    same seed gives the same tokens (distribution: tests/statistical/test_pard_distribution.py)."""
    lead, k, width = shape
    target, ids = models["qwen2"], prompt()
    drafter = PardDrafter(models["qwen2_other"], MASK, k, num_paths=width, lead_tokens=lead)
    capacity = len(ids) + NEW_TOKENS + drafter.max_draft_tokens + 1
    plain = run(plain_decode(target, ids, GREEDY, None, capacity, DecodeStats()))
    stats = DecodeStats()
    assert run(speculative_steps(pipeline, target, drafter, ids, GREEDY, None, capacity, stats)) == plain
    assert stats.drafted_by_position[k - 1] > 0  # drafts reached the last position
    params = SamplingParams(temperature=0.8, seed=3)
    runs = [run(speculative_steps(pipeline, target, drafter.for_request(), ids, params, params.make_generator("cpu"),
                                  capacity, DecodeStats())) for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == NEW_TOKENS


def test_sampling_is_reproducible_with_a_seed(models):
    target, ids = models["qwen2"], prompt()
    params = SamplingParams(temperature=0.9, seed=123)
    outputs = []
    for _ in range(2):
        drafter = PardDrafter(models["qwen2_other"], MASK, 4)
        steps = speculative_steps("sync", target, drafter, ids, params, params.make_generator(), len(ids) + 50,
                                  DecodeStats())
        outputs.append(run(steps))
    assert outputs[0] == outputs[1] and len(outputs[0]) == NEW_TOKENS


def test_training_blocks_equal_the_draft_pass(models):
    """A block of the training batch computes what a draft pass at its anchor computes."""
    model = models["qwen2_other"]
    ids = torch.randint(0, 250, (30,), generator=torch.Generator().manual_seed(1))
    anchors, depths = torch.tensor([6, 11, 20]), torch.tensor([3, 0, 2])
    batch = build_pard_batch(4, ids, anchors, depths, MASK)
    assert batch.input_ids.tolist() == [ids[6], MASK, MASK, MASK, ids[11], ids[20], MASK, MASK]
    assert batch.positions.tolist() == [6, 7, 8, 9, 11, 20, 21, 22]
    assert batch.label_rows.tolist() == [2, 3, 4, 5, 7, 16, 17, 18]
    with torch.no_grad():
        hidden = block_hidden(model, ids, batch)
        logits = model.lm_head(model.norm(hidden))
    for anchor, depth, first in ((6, 3, 0), (11, 0, 4), (20, 2, 5)):
        drafter = PardDrafter(model, MASK, depth + 1)
        drafter.reset(64)
        expected = drafter.draft_logits(ids[: anchor + 1].tolist(), depth + 1)
        got = logits[first : first + depth + 1].clone()
        got[:, MASK] = float("-inf")
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_conditional_drop_keeps_nested_rows_inside_the_labels():
    gen = torch.Generator().manual_seed(0)
    anchors, depths = sample_blocks(label_start=5, num_rows=40, num_anchors=500, max_depth=7, keep_ratio=0.5,
                                    generator=gen)
    assert len(anchors) == 40 and bool((anchors >= 5).all())
    assert bool((anchors + depths <= 5 + 40 - 1).all()) and int(depths.max()) <= 7


def test_row_weights_decay_and_reach():
    from dflash2.train.labels import LabelledText

    ids = torch.arange(10)
    text = LabelledText(ids, 2, 0, topk_ids=torch.stack([ids[3:], ids[3:] + 1], 1),
                        topk_probs=torch.tensor([[0.5, 0.5]] * 7), rest=torch.zeros(7))
    batch = build_pard_batch(2, ids, torch.tensor([3]), torch.tensor([2]), MASK)
    torch.testing.assert_close(row_weights(text, batch, 0.5), torch.tensor([1.0, 0.25, 0.0625]))


def test_lora_merge_by_blocks_of_rows_is_the_whole_update(monkeypatch):
    """LoRALinear.merged adds the update a block of rows at a time: every row gets W + scale * B A, rounded once."""
    from dflash2.drafters import lora

    base = torch.nn.Linear(64, 300, bias=True).to(torch.bfloat16).requires_grad_(False)
    layer = LoRALinear(base, rank=4, alpha=8.0)
    layer.lora_b.data.normal_(0, 0.5, generator=torch.Generator().manual_seed(0))
    monkeypatch.setattr(lora, "MERGE_BLOCK", 64 * 16)  # blocks of 16 rows: 19 blocks, the last one short
    merged = layer.merged()
    whole = (base.weight.float() + layer.delta()).to(torch.bfloat16)
    torch.testing.assert_close(merged.weight, whole, atol=0, rtol=2 ** -8)  # at most the bf16 rounding apart
    assert merged.weight.dtype == torch.bfloat16 and torch.equal(merged.bias, base.bias)
    x = torch.randn(3, 64).to(torch.bfloat16)
    torch.testing.assert_close(merged(x).float(), layer(x).float(), atol=0.05, rtol=0.02)


def test_lora_merge_and_adapter_round_trip(tiny_model_dirs, tmp_path):
    from safetensors.torch import save_file

    from dflash2.drafters.pard import ADAPTER_FILE, PardConfig

    model = load_transformer(tiny_model_dirs["qwen2_other"], "fp32", packed=False)
    add_lora(model, rank=4, alpha=8.0)
    for name, param in model.named_parameters():
        if "lora_b" in name:
            param.data.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    ids = torch.tensor([list(range(20, 40))])
    with torch.no_grad():
        before = model(ids).logits
        mask_embedding = torch.randn(model.config.hidden_size)
        save_file(adapter_state(model, mask_embedding), str(tmp_path / ADAPTER_FILE))
        PardConfig(base_model="tiny", mask_token_id=MASK, num_draft_tokens=4, lora_rank=4, lora_alpha=8.0
                   ).save(tmp_path)
        merge_lora(model)
        torch.testing.assert_close(model(ids).logits, before, atol=1e-4, rtol=1e-4)
        loaded, config = load_pard_model(tmp_path, tiny_model_dirs["qwen2_other"], "fp32")
        torch.testing.assert_close(loaded(ids).logits, before, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(loaded.embed.weight[MASK], mask_embedding)
    assert config.mask_token_id == MASK and config.lora_rank == 4


def test_training_learns_and_resumes(tiny_model_dirs, tmp_path):
    target = load_transformer(tiny_model_dirs["qwen2"], "fp32")
    gen = torch.Generator().manual_seed(2)
    sequences = []
    for i in range(24):  # the target's own greedy continuations: hard labels are its choices
        ids = torch.randint(0, 250, (6,), generator=gen).tolist()
        for _ in range(24):
            ids.append(int(target(torch.tensor([ids])).logits[0, -1].argmax()))
        sequences.append(TrainingSequence(torch.tensor(ids), prompt_length=6))
    regen = write_token_shards(tmp_path / "regen", sequences, shard_size=8)
    labels = tmp_path / "labels"
    generate_labels(LabelConfig(str(labels), (f"regen:{regen}",), top_k=4, progress=False), target, None)
    assert len(LabelShards(labels)) == len(HardLabels(regen)) == 24
    common = dict(base_dir=tiny_model_dirs["qwen2_other"], label_dirs=str(labels), hard_label_dirs=str(regen),
                  out_dir=str(tmp_path / "run"), num_draft_tokens=4, lora_rank=4, mask_token_id=MASK,
                  heldout_every=6, heldout_sequences=4, anchors_per_sequence=8, sequences_per_step=2, num_steps=30,
                  learning_rate=1e-2, mask_learning_rate=5e-2, warmup_steps=2, eval_every=0, checkpoint_every=5,
                  progress=False)
    train_pard(PardTrainConfig(stop_at_step=10, **common))
    assert latest_checkpoint(tmp_path / "run").name == "step_0000010"
    drafter_dir = train_pard(PardTrainConfig(**common))
    assert latest_checkpoint(tmp_path / "run").name == "step_0000030"
    import json

    evals = [json.loads(line) for line in (tmp_path / "run" / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 10, 30]
    first, last = evals[0]["regenerated"], evals[-1]["regenerated"]
    assert last["tau"] > first["tau"]  # it learned the target's continuations
    model, config = load_pard_model(drafter_dir, tiny_model_dirs["qwen2_other"], "fp32")
    assert config.num_draft_tokens == 4 and config.extra["steps"] == 30
    # the adapter of a checkpoint (what `ship` takes while a run goes on) is the run's own at that step
    from safetensors.torch import load_file

    from dflash2.drafters.pard import ADAPTER_FILE, PardConfig
    from dflash2.train.pard_trainer import adapter_from_checkpoint

    shipped = adapter_from_checkpoint(tmp_path / "run", tmp_path / "ship", step=30)
    expected, got = load_file(str(drafter_dir / ADAPTER_FILE)), load_file(str(shipped / ADAPTER_FILE))
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)
    record = PardConfig.load(shipped)
    assert record.mask_token_id == MASK and record.lora_rank == 4 and record.extra["steps"] == 30
    assert record.extra["heldout"]["regenerated"] == evals[-1]["regenerated"]
    assert record.default_num_draft_tokens is None  # users get the trained k unless a measured one is recorded
    measured = PardConfig.load(adapter_from_checkpoint(tmp_path / "run", tmp_path / "ship2", 30,
                                                       default_num_draft_tokens=2))
    assert measured.default_num_draft_tokens == 2 and measured.num_draft_tokens == 4
    with pytest.raises(ValueError, match="1..4"):
        adapter_from_checkpoint(tmp_path / "run", tmp_path / "ship3", 30, default_num_draft_tokens=5)
    # a fresh run can start from a shipped adapter: its LoRA weights and mask embedding, as saved
    from dflash2.train.pard_trainer import _warm_start, build_model

    warm = PardTrainConfig(**{**common, "out_dir": str(tmp_path / "warm"), "init_adapter": str(shipped)})
    model, mask_id, _, mask_embedding = build_model(warm)
    _warm_start(shipped, warm, model, mask_embedding, mask_id)
    started = adapter_state(model, mask_embedding)
    assert started.keys() == got.keys() and all(torch.equal(started[k], got[k].float()) for k in got)
    other_rank = PardTrainConfig(**{**common, "lora_rank": 2, "init_adapter": str(shipped)})
    model, mask_id, _, mask_embedding = build_model(other_rank)
    with pytest.raises(ValueError, match="lora_rank"):
        _warm_start(shipped, other_rank, model, mask_embedding, mask_id)
    # more capacity: a run of twice the rank (same alpha / rank) starts with the adapter's exact weight updates
    wider = PardTrainConfig(**{**common, "lora_rank": 8, "lora_alpha": 2 * warm.lora_alpha,
                               "init_adapter": str(shipped)})
    model, mask_id, _, mask_embedding = build_model(wider)
    _warm_start(shipped, wider, model, mask_embedding, mask_id)
    reference, _, _, _ = build_model(warm)
    _warm_start(shipped, warm, reference, mask_embedding, mask_id)
    pairs = [(m, r) for m, r in zip(model.modules(), reference.modules()) if isinstance(m, LoRALinear)]
    assert pairs and all(m.lora_a.shape[0] == 8 and torch.allclose(m.delta(), r.delta(), atol=1e-6) for m, r in pairs)
    assert all(m.lora_b[:, 4:].abs().max() == 0 and m.lora_a[4:].abs().max() > 0 for m, _ in pairs)
    same_alpha = PardTrainConfig(**{**common, "lora_rank": 8, "init_adapter": str(shipped)})  # alpha / rank halved
    model, mask_id, _, mask_embedding = build_model(same_alpha)
    with pytest.raises(ValueError, match="lora_scale"):
        _warm_start(shipped, same_alpha, model, mask_embedding, mask_id)


def test_for_request_shares_weights_not_the_cache(models):
    drafter = PardDrafter(models["qwen2_other"], MASK, num_draft_tokens=3)
    other = drafter.for_request()
    assert other.model is drafter.model and other.num_draft_tokens == 3 and other is not drafter
    drafter.reset(32), other.reset(32)
    drafter.propose(prompt().tolist(), 3, GREEDY, None)
    assert other.cache is not drafter.cache and other.cache.length == 0


def test_state_bytes_is_what_reset_allocates(models):
    drafter = PardDrafter(models["qwen2_other"], MASK, num_draft_tokens=3)
    drafter.reset(50)
    assert drafter.state_bytes(50) == drafter.held_bytes() > 0


@pytest.mark.parametrize("key", ["qwen2_other", "llama"])
def test_hf_export_loads_in_transformers_with_the_drafters_logits(tiny_model_dirs, tmp_path, key):
    """`dflash2 train export-pard`: transformers loads the merged directory and computes the drafter's logits on a
    draft block (pending ids + masks); the config names the mask token, the block size and the taps."""
    import json

    from transformers import AutoModelForCausalLM

    from dflash2.train.pard_export import export_pard

    base = tiny_model_dirs[key]
    adapter = write_random_adapter(base, tmp_path / "adapter", MASK, num_draft_tokens=4)
    out = export_pard(adapter, base, tmp_path / "hf", "fp32")
    config = json.loads((out / "config.json").read_text())
    assert config["pard"]["mask_token_id"] == config["mask_token_id"] == MASK
    assert config["pard"]["block_size"] == 4 and config["pard"]["taps"] == []
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    drafted, _ = load_pard_model(adapter, base, "fp32")
    drafter = PardDrafter(drafted, MASK, 4)
    drafter.reset(64)
    sequence = prompt().tolist()
    expected = drafter.draft_logits(sequence, 4)  # [4, V]
    with torch.no_grad():
        got = hf(torch.tensor([sequence + [MASK] * 3])).logits[0, len(sequence) - 1 :].float()
    got[:, MASK] = float("-inf")
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def write_random_adapter(base_dir, directory, mask_id: int, num_draft_tokens: int = 8, rank: int = 4,
                         std: float = 0.05, seed: int = 3):
    """An adapter directory with random LoRA updates (rank ``rank``, B ~ N(0, std)) and a mask embedding near the
    mean embedding, on the fp32 model in ``base_dir``: what a trained adapter looks like to loading and export."""
    from safetensors.torch import save_file

    from dflash2.drafters.pard import ADAPTER_FILE, PardConfig

    model = load_transformer(base_dir, "fp32", packed=False)
    add_lora(model, rank=rank, alpha=2.0 * rank)
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if "lora_b" in name:
            param.data.normal_(0, std, generator=gen)
    mask_embedding = model.embed.weight.float().mean(0) + std * torch.randn(model.config.hidden_size, generator=gen)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(adapter_state(model, mask_embedding), str(directory / ADAPTER_FILE))
    PardConfig(base_model=str(base_dir), mask_token_id=mask_id, num_draft_tokens=num_draft_tokens, lora_rank=rank,
               lora_alpha=2.0 * rank).save(directory)
    return directory


def test_draft_vocab_and_int8_weights_stay_lossless(tiny_model_dirs, tmp_path):
    """A draft vocabulary (the head's rows of the listed ids only; -inf elsewhere) and int8 / q8_0 drafter weights
    change what is drafted, never what is generated."""
    from safetensors.torch import save_file

    from dflash2.drafters.pard import DRAFT_VOCAB_FILE, VocabSubsetHead

    base = tiny_model_dirs["qwen2_other"]
    adapter = write_random_adapter(base, tmp_path / "adapter", MASK, num_draft_tokens=4)
    full, _ = load_pard_model(adapter, base, "fp32")
    vocab = torch.arange(0, 250, 2)  # even ids only
    save_file({"draft_vocab": vocab.to(torch.int32)}, str(adapter / DRAFT_VOCAB_FILE))
    subset, _ = load_pard_model(adapter, base, "fp32")
    assert isinstance(subset.lm_head, VocabSubsetHead)
    ids = torch.tensor([prompt().tolist()])
    with torch.no_grad():
        expected, got = full(ids).logits[0], subset(ids).logits[0]
    torch.testing.assert_close(got[:, vocab], expected[:, vocab])
    outside = torch.ones(got.shape[-1], dtype=torch.bool)
    outside[vocab] = False
    assert bool(torch.isneginf(got[:, outside]).all())
    target, ids = load_transformer(tiny_model_dirs["qwen2"], "fp32"), prompt()
    capacity = len(ids) + NEW_TOKENS + 5
    plain = run(plain_decode(target, ids, GREEDY, None, capacity, DecodeStats()))
    for weights in ("bf16", "int8", "q8_0"):
        model, config = load_pard_model(adapter, base, "fp32", weights=weights)
        drafter = PardDrafter(model, config.mask_token_id, 4)
        drafter.reset(capacity)  # every draft lies in the draft vocabulary
        assert all(int(t) % 2 == 0 for t in drafter.propose(ids.tolist(), 4, GREEDY, None).tokens)
        stats = DecodeStats()
        spec = run(speculative_steps("sync", target, drafter, ids, GREEDY, None, capacity, stats))
        assert spec == plain


def test_a_greedy_draft_over_the_draft_vocabulary_is_the_argmax_over_the_target_vocabulary(tiny_model_dirs, tmp_path):
    """The greedy chain is drafted from the head's own rows (no [k, V_target] logits): the same ids as the argmax
    of the target-vocabulary logits, ties included (the vocabulary is held in ascending ids, whatever the file's
    order), and sampling still gets q_draft over the target vocabulary."""
    from safetensors.torch import save_file

    from dflash2.drafters.pard import DRAFT_VOCAB_FILE

    base = tiny_model_dirs["qwen2_other"]
    adapter = write_random_adapter(base, tmp_path / "adapter", MASK, num_draft_tokens=4)
    vocab = torch.randperm(250, generator=torch.Generator().manual_seed(1))[:120]  # unsorted in the file
    save_file({"draft_vocab": vocab.to(torch.int32)}, str(adapter / DRAFT_VOCAB_FILE))
    model, config = load_pard_model(adapter, base, "fp32")
    drafter = PardDrafter(model, config.mask_token_id, 4, target_vocab_size=model.config.vocab_size)
    part = torch.randn(4, 120, generator=torch.Generator().manual_seed(2)).round()  # integers: many ties
    part[1, :] = 0.0  # all tied
    expected = drafter._to_target(part).argmax(dim=-1)
    assert torch.equal(drafter._draft_from_part(part, GREEDY, None).tokens, expected)
    sampled = drafter._draft_from_part(part, SamplingParams(temperature=0.8), torch.Generator().manual_seed(0))
    assert sampled.q_draft.shape == (4, model.config.vocab_size)
    assert bool(torch.isin(sampled.tokens, vocab).all())


def test_pard_with_prompt_lookup_is_lossless(models):
    """``pard+ngram``: a long prompt-lookup match when there is one, the PARD block otherwise (HybridDrafter)."""
    from dflash2.drafters.hybrid import HybridDrafter

    target = models["qwen2"]
    ids = torch.tensor(prompt().tolist() * 3)  # repeated text: lookup matches exist
    capacity = len(ids) + NEW_TOKENS + 9
    plain = run(plain_decode(target, ids, GREEDY, None, capacity, DecodeStats()))
    drafter = HybridDrafter(PardDrafter(models["qwen2_other"], MASK, 4), 8)
    assert drafter.name == "pard+ngram"
    spec = run(speculative_steps("sync", target, drafter, ids, GREEDY, None, capacity, DecodeStats()))
    assert spec == plain and drafter.block_steps > 0


def test_the_drafters_weight_format(monkeypatch):
    """For bf16 on a CPU, also under a gguf target (no GGUF holds the merged weights): q8_0 blocks (q4_0 under a
    gguf target) where a C++ build of the gguf kernel runs (AVX2, VNNI or AMX), else int8; the quantized formats
    asked for are kept; fp32 and CUDA stay unquantized; the environment overrides the default."""
    from dflash2.drafters.pard import DEFAULT_PARD_WEIGHTS, pard_weights
    from dflash2.kernels import gguf_linear

    monkeypatch.delenv("DFLASH2_PARD_WEIGHTS", raising=False)
    monkeypatch.delenv(gguf_linear.ENV, raising=False)
    reload_settings()
    built = gguf_linear.gguf_backend() != gguf_linear.TORCH  # a C++ build runs here (else the PyTorch reference)
    assert DEFAULT_PARD_WEIGHTS == "int8"
    assert pard_weights(None, "cpu") == ("q8_0" if built else "int8")
    assert pard_weights("gguf", "cpu") == ("q4_0" if built else "int8")  # a gguf target: the target's 4-bit bytes
    if gguf_linear.gguf_kernels_available(gguf_linear.KERNEL):  # the AVX2 build too (what an AVX2-only CPU runs)
        monkeypatch.setenv(gguf_linear.ENV, "avx2")
        reload_settings()
        assert pard_weights(None, "cpu") == "q8_0" and pard_weights("gguf", "cpu") == "q4_0"
    monkeypatch.setenv(gguf_linear.ENV, "torch")
    reload_settings()
    assert pard_weights("gguf", "cpu") == pard_weights(None, "cpu") == "int8"
    monkeypatch.setenv(gguf_linear.ENV, "bogus")
    reload_settings()
    assert pard_weights(None, "cpu") == "int8"  # a bad switch is the gguf target's error, not a bf16 target's
    with pytest.raises(ValueError, match="DFLASH2_GGUF_KERNEL"):
        pard_weights("gguf", "cpu")
    monkeypatch.delenv(gguf_linear.ENV)
    reload_settings()
    assert pard_weights("int4", "cpu") == "int4"
    assert pard_weights(None, "cpu", "fp32") == pard_weights(None, "cuda") == "bf16"
    monkeypatch.setenv("DFLASH2_PARD_WEIGHTS", "bf16")
    reload_settings()
    assert pard_weights("gguf", "cpu") == "bf16"


def test_context_window_reads_the_sink_and_the_recent_ids_of_a_long_prompt(models):
    """context_window = (sink, recent): a long prompt costs the drafter sink + recent ids; each keeps its own
    position; drafts equal a forward over exactly those ids; a sequence that diverges inside the left-out part
    starts the cache over; greedy output stays plain decoding's."""
    model, target = models["qwen2_other"], models["qwen2"]
    sequence = prompt().tolist() + [17]  # 13 prompt ids + the pending one
    drafter = PardDrafter(model, MASK, 3, context_window=(2, 5))
    drafter.reset(64)
    drafter.prefill(sequence[:-1])
    assert (drafter.cache.length, drafter.skipped, drafter.cached_tokens) == (7, 6, sequence[:-1])
    logits = drafter.draft_logits(sequence, 3)
    kept = [0, 1, *range(8, 13)]  # the sink, then the recent ids, at their own positions
    feed = [sequence[i] for i in kept] + [17, MASK, MASK]
    positions = torch.tensor([kept + [13, 14, 15]])
    expected = model(torch.tensor([feed]), positions).logits[0, -3:]
    expected[:, MASK] = float("-inf")
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    drafter.draft_logits(sequence[:10] + [3, 4], 2)  # diverges after id 10 (inside the recent part): rolled back
    assert drafter.skipped == 6 and drafter.cached_tokens == sequence[:10] + [3, 4]
    drafter.draft_logits(sequence[:5] + [3, 4], 2)  # diverges inside the left-out ids: read again from scratch
    assert drafter.skipped == 0 and drafter.cached_tokens == sequence[:5] + [3, 4]
    with pytest.raises(ValueError, match="recent >= 1"):
        PardDrafter(model, MASK, 3, context_window=(2, 0))
    ids = torch.tensor(sequence[:-1])
    capacity = len(ids) + NEW_TOKENS + 4
    plain = run(plain_decode(target, ids, GREEDY, None, capacity, DecodeStats()))
    windowed = PardDrafter(model, MASK, 3, context_window=(2, 5))
    assert run(speculative_steps("sync", target, windowed, ids, GREEDY, None, capacity, DecodeStats())) == plain


def test_a_context_window_reads_prompts_up_to_its_whole_length_whole(models):
    """ContextWindow(sink, recent, whole): a prompt of at most ``whole`` ids is read whole (chat's prompts keep their
    context), a longer one through the window; greedy output stays plain decoding's either way."""
    from dflash2.drafters.model import ContextWindow

    model, target = models["qwen2_other"], models["qwen2"]
    short = prompt().tolist()  # 13 ids
    long = short * 2  # 26 ids
    for ids, read, skipped in ((short, 13, 0), (long, 7, 19)):
        drafter = PardDrafter(model, MASK, 3, context_window=ContextWindow(2, 5, whole=16))
        drafter.reset(64)
        drafter.prefill(ids)
        assert (drafter.cache.length, drafter.skipped) == (read, skipped)
    assert not ContextWindow(16, 112, whole=512).applies(512) and ContextWindow(16, 112, whole=512).applies(513)
    assert ContextWindow(32, 480).applies(513) and not ContextWindow(32, 480).applies(512)
    with pytest.raises(ValueError, match="whole >= 0"):
        ContextWindow(2, 5, whole=-1)
    ids = torch.tensor(long)
    capacity = len(ids) + NEW_TOKENS + 4
    plain = run(plain_decode(target, ids, GREEDY, None, capacity, DecodeStats()))
    windowed = PardDrafter(model, MASK, 3, context_window=ContextWindow(2, 5, whole=16))
    assert run(speculative_steps("sync", target, windowed, ids, GREEDY, None, capacity, DecodeStats())) == plain


class _EveryOtherThird(FixedDraftLength):
    """A draft-length policy that drafts k only every third step (speculation off in between: the drafter falls
    behind by several ids each time)."""

    def __init__(self, k: int) -> None:
        super().__init__(k)
        self.steps = 0

    def next_length(self, room: int) -> int:
        self.steps += 1
        return min(self.k, room) if self.steps % 3 == 0 else 0


@pytest.mark.parametrize("kind", ["pard", "model"])
def test_a_drafter_that_fell_behind_reads_only_the_last_catch_up_ids(models, kind):
    """catch_up = N: a drafter that missed more than N ids reads only the last N, each at its own position (the
    drafts equal a forward over exactly the ids it holds); a rollback inside such a gap keeps the slots before it;
    greedy output stays plain decoding's."""
    model, target = models["qwen2_other"], models["qwen2"]
    make = (lambda: PardDrafter(model, MASK, 3, catch_up=2)) if kind == "pard" else (
        lambda: ModelDrafter(model, 3, catch_up=2))
    sequence = prompt().tolist()
    drafter = make()
    drafter.reset(64)
    drafter.prefill(sequence[:-1])  # 12 ids read
    sequence += [20, 21, 22, 23, 24]  # 6 unread ids (the old pending one + 5): only the last 2 are fed
    assert drafter.unread(sequence) == 2
    if kind == "pard":
        logits = drafter.draft_logits(sequence, 3)
        kept = list(range(12)) + [16, 17]
        feed = [sequence[i] for i in kept] + [MASK, MASK]
        expected = model(torch.tensor([feed]), torch.tensor([kept + [18, 19]])).logits[0, -3:]
        expected[:, MASK] = float("-inf")
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    else:
        drafter.propose(sequence, 1, GREEDY, None)
    assert drafter.cached_tokens[: len(sequence)] == sequence and drafter.skipped == 4
    assert drafter.slot_ids[:14] == list(range(12)) + [16, 17]
    drafter.draft_logits(sequence[:14] + [9, 9], 2) if kind == "pard" else drafter.propose(
        sequence[:14] + [9, 9], 1, GREEDY, None)  # diverges inside the gap: ids 0-11 kept, the last 2 of 4 read
    assert drafter.slot_ids[:14] == list(range(12)) + [14, 15]
    assert drafter.cached_tokens[:16] == sequence[:14] + [9, 9]
    with pytest.raises(ValueError, match="catch_up"):
        PardDrafter(model, MASK, 3, catch_up=0)
    ids = torch.tensor(prompt().tolist())
    capacity = len(ids) + NEW_TOKENS + 4
    plain = run(plain_decode(target, ids, GREEDY, None, capacity, DecodeStats()))
    behind = make()
    stats = DecodeStats()
    steps = speculative_steps("sync", target, behind, ids, GREEDY, None, capacity, stats, _EveryOtherThird(3))
    assert run(steps) == plain
    assert behind.skipped > 0  # gaps were left


def test_the_catch_up_window_is_chosen_by_the_environment(monkeypatch):
    from dflash2.drafters.pard import DEFAULT_CATCH_UP, pard_catch_up

    monkeypatch.delenv("DFLASH2_PARD_CATCH_UP", raising=False)
    reload_settings()
    assert pard_catch_up() == DEFAULT_CATCH_UP
    monkeypatch.setenv("DFLASH2_PARD_CATCH_UP", "all")
    reload_settings()
    assert pard_catch_up() is None
    monkeypatch.setenv("DFLASH2_PARD_CATCH_UP", "5")
    reload_settings()
    assert pard_catch_up() == 5
    monkeypatch.setenv("DFLASH2_PARD_CATCH_UP", "0")
    reload_settings()
    with pytest.raises(ValueError, match="DFLASH2_PARD_CATCH_UP"):
        pard_catch_up()


def _drafters_in_different_states(model, make):
    """Three drafters of one network at different points: fresh with a 13-id prompt, prefilled and 3 ids behind, a
    context window over a long prompt (each a copy made by ``make``); with their sequences and draft lengths."""
    base = prompt().tolist()
    fresh, behind, windowed = make(), make(), make(context_window=(2, 5))
    for drafter in (fresh, behind, windowed):
        drafter.reset(96)
    behind.prefill(base[:-1])
    return [(fresh, base[:7], 3), (behind, base + [20, 21, 22], 4), (windowed, base + base + [9], 2)]


@pytest.fixture(scope="module")
def bf16_drafter_model(tiny_model_dirs):
    return load_transformer(tiny_model_dirs["qwen2_other"], "bf16")


@pytest.fixture(scope="module")
def q8_0_drafter_model(tiny_model_dirs):
    """The tiny drafter over Q8_0 blocks (GgufLinear): its passes run the fused one-call gguf layers."""
    from dflash2.kernels.gguf_linear import GgufLinear
    from dflash2.models.state_dict import replace_linear_layers

    model = load_transformer(tiny_model_dirs["qwen2_other"], "bf16", packed=False)
    replace_linear_layers(model, lambda linear: GgufLinear.from_linear(linear, qtype="Q8_0"))
    return model


@pytest.mark.parametrize("weights", ["bf16", "q8_0"])
@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=0.8, top_p=0.9)], ids=["greedy", "sampled"])
def test_one_batched_pass_drafts_what_each_drafter_drafts_alone(models, request, weights, params, monkeypatch):
    """propose_batch runs several requests' passes as ONE forward (segments of the token axis, each over its own
    cache): every draft, q_draft and cache afterwards equals that drafter's own propose, bit for bit (bf16: the
    row-invariant kernels; fp32 goes through PyTorch's matmul, whose rounding may depend on the row count); twice
    in a row (the second pass after the first's rollback of the mask slots). Over Q8_0 blocks the batched pass
    runs the fused layers over every segment's cache (gguf_layer_segments), a lone pass the one-cache fused layer."""
    from dflash2.drafters.pard import propose_batch
    from dflash2.kernels import gguf_layer

    model = request.getfixturevalue(f"{weights}_drafter_model")
    segmented = []
    original_segmented = gguf_layer._segmented_layers
    monkeypatch.setattr(gguf_layer, "_segmented_layers",
                        lambda *a: segmented.append(original_segmented(*a)) or segmented[-1])
    make = lambda **kw: PardDrafter(model, MASK, 4, **kw)  # noqa: E731
    alone, batched = _drafters_in_different_states(model, make), _drafters_in_different_states(model, make)
    calls = []
    original = model.forward
    model.forward = lambda *a, **kw: calls.append(1) or original(*a, **kw)
    try:
        for round_ in range(2):
            expected = [d.propose(s, k, params, torch.Generator().manual_seed(i)) for i, (d, s, k) in enumerate(alone)]
            calls.clear()
            got = propose_batch([(d, s, k, params, torch.Generator().manual_seed(i)) for i, (d, s, k) in
                                 enumerate(batched)])
            # one forward for the three requests (first round: + the windowed drafter's read of its long prompt)
            assert len(calls) == (2 if round_ == 0 else 1)
            for (a, _, _), (b, _, _), want, have in zip(alone, batched, expected, got):
                assert torch.equal(want.tokens, have.tokens)
                assert (want.q_draft is None) == (have.q_draft is None)
                if want.q_draft is not None:
                    assert torch.equal(want.q_draft, have.q_draft)
                assert (a.cache.length, a.slot_ids, a.cached_tokens) == (b.cache.length, b.slot_ids, b.cached_tokens)
                n = a.cache.length
                assert torch.equal(a.cache.keys[:, :, :, :n], b.cache.keys[:, :, :, :n])
            for entries in (alone, batched):  # the next step: two drafts accepted and a new pending id
                entries[:] = [(d, s + want.tokens[:2].tolist() + [5], k) for (d, s, k) in entries]
    finally:
        del model.forward
    # a batched pass that fails after its forward leaves every cache as it was: each drafter then drafts alone as if
    # nothing had happened
    first = batched[0][0]
    first._head_part = lambda hidden: (_ for _ in ()).throw(RuntimeError("injected"))
    with pytest.raises(RuntimeError, match="injected"):
        propose_batch([(d, s, k, params, torch.Generator()) for d, s, k in batched])
    del first._head_part
    for i, ((a, s, k), (b, _, _)) in enumerate(zip(alone, batched)):
        want = a.propose(s, k, params, torch.Generator().manual_seed(i))
        assert torch.equal(want.tokens, b.propose(s, k, params, torch.Generator().manual_seed(i)).tokens)
        assert (a.cache.length, a.slot_ids) == (b.cache.length, b.slot_ids)
    other = PardDrafter(models["qwen2"], MASK, 4)
    other.reset(32)
    with pytest.raises(ValueError, match="sharing one network"):
        propose_batch([(alone[0][0], alone[0][1], 2, GREEDY, None), (other, alone[0][1], 2, GREEDY, None)])
    assert segmented and all((runner is not None) == (weights == "q8_0") for runner in segmented)
