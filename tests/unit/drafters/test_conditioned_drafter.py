"""The target-conditioned PARD drafter (``dflash2``): the training blocks with conditioning compute what a draft pass
computes; greedy identity with plain decoding through every pipeline; the features + conditioned training run
(zero-initialised conditioning = the unconditioned drafter at step 0, it learns, it resumes, it ships)."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from dflash2.decode.plain import plain_decode
from dflash2.decode.stats import DecodeStats
from dflash2.drafters.conditioned import ConditionedPardDrafter
from dflash2.drafters.conditioning import ConditioningConfig, TargetConditioning
from dflash2.models.loading import load_transformer
from dflash2.train.data import TrainingSequence, write_token_shards
from dflash2.train.labels import LabelledText
from dflash2.train.pard_objective import block_hidden, block_offsets, build_pard_batch, context_offsets
from dflash2.verify.sampling import GREEDY
from tests.pipelines import PIPELINES, speculative_steps

MASK = 255
LAYERS = (0, 2)


@pytest.fixture(scope="module")
def models(tiny_model_dirs):
    return {key: load_transformer(path, "fp32") for key, path in tiny_model_dirs.items()}


def random_conditioning(target, drafter, seed: int = 0) -> TargetConditioning:
    conditioning = TargetConditioning(ConditioningConfig(LAYERS, target.config.hidden_size,
                                                         drafter.config.hidden_size))
    conditioning.proj.weight.data.normal_(0, 0.3, generator=torch.Generator().manual_seed(seed))
    return conditioning.requires_grad_(False)


def target_taps(target, ids: torch.Tensor) -> torch.Tensor:
    """[N, T * Dt] the target's tapped states at every position of ids [N]."""
    out = target(ids[None], hidden_layers=LAYERS, logits="none")
    return torch.cat([h[0] for h in out.hidden_states], dim=-1)


def assert_draft_passes_equal(target, model, conditioning, ids, logits, blocks,
                              drafter_class=ConditionedPardDrafter) -> None:
    """Each block (anchor, depth, first row in ``logits``) of a training batch's logits equals what the drafter's
    pass computes after observing the target's states of positions 0 .. anchor - 1 (the anchor pending)."""
    for anchor, depth, first in blocks:
        drafter = drafter_class(model, MASK, conditioning, depth + 1)
        drafter.reset(64)
        sequence = ids[: anchor + 1].tolist()
        with torch.no_grad():
            taps = target(ids[None, :anchor], hidden_layers=LAYERS, logits="none").hidden_states
        drafter.observe(sequence, -1, taps)
        expected = drafter.draft_logits(sequence, depth + 1)
        got = logits[first : first + depth + 1].clone()
        got[:, MASK] = float("-inf")
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_training_blocks_with_conditioning_equal_the_draft_pass(models):
    """A block of the training batch, offset by the target's taps before its anchor, computes what the drafter's
    pass computes after observing the target's states of the sequence up to that anchor."""
    target, model = models["qwen2"], models["qwen2_other"]
    conditioning = random_conditioning(target, model)
    ids = torch.randint(0, 250, (30,), generator=torch.Generator().manual_seed(1))
    text = LabelledText(ids, 4, 0, torch.zeros(25, 1, dtype=torch.int64), torch.ones(25, 1), torch.zeros(25),
                        taps=target_taps(target, ids))
    anchors, depths = torch.tensor([6, 11, 20]), torch.tensor([3, 0, 2])
    batch = build_pard_batch(4, ids, anchors, depths, MASK)
    with torch.no_grad():
        logits = model.lm_head(model.norm(block_hidden(model, ids, batch, block_offsets(conditioning, text, batch))))
        plain = model.lm_head(model.norm(block_hidden(model, ids, batch)))
    assert not torch.allclose(logits, plain, atol=1e-3)  # the conditioning is read
    assert_draft_passes_equal(target, model, conditioning, ids, logits, ((6, 3, 0), (11, 0, 4), (20, 2, 5)))


def test_context_conditioning_offsets_every_context_row_and_trains_through_the_context(models):
    """Conditioning every context position (``ConditioningConfig.context``): a training block computes what one
    causal pass over [ids before the anchor, each offset by the target's state one position earlier; the block's
    rows, offset by the state before the anchor] computes, and the gradient reaches the projection through the
    context rows alone (the block rows given no offset)."""
    target, model = models["qwen2"], models["qwen2_other"]
    conditioning = TargetConditioning(ConditioningConfig(LAYERS, target.config.hidden_size,
                                                         model.config.hidden_size, context=True))
    conditioning.proj.weight.data.normal_(0, 0.3, generator=torch.Generator().manual_seed(0))
    ids = torch.randint(0, 250, (30,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        taps = target_taps(target, ids)
    text = LabelledText(ids, 4, 0, torch.zeros(25, 1, dtype=torch.int64), torch.ones(25, 1), torch.zeros(25),
                        taps=taps)
    anchors, depths = torch.tensor([6, 20]), torch.tensor([3, 2])
    batch = build_pard_batch(4, ids, anchors, depths, MASK)
    with torch.no_grad():
        got = block_hidden(model, ids, batch, block_offsets(conditioning, text, batch),
                           context_offsets(conditioning, text, batch.context_length))
        without = block_hidden(model, ids, batch, block_offsets(conditioning, text, batch))
        offset = conditioning(taps)  # [N, D]: row i + 1's offset
        for anchor, depth, first in ((6, 3, 0), (20, 2, 4)):
            rows = torch.cat([ids[: anchor + 1], torch.full((depth,), MASK)])
            offsets = torch.cat([torch.zeros(1, offset.shape[1]), offset[: anchor - 1],
                                 offset[anchor - 1 : anchor].expand(depth + 1, -1)])  # [anchor + depth + 1, D]
            cache = model.new_cache(64)
            out = model(rows[None], cache=cache, input_offsets=offsets[None], logits="none",
                        hidden_layers=(model.config.num_layers - 1,))
            torch.testing.assert_close(got[first : first + depth + 1], out.hidden_states[0][0, anchor:],
                                       atol=1e-4, rtol=1e-4)
    assert not torch.allclose(got, without, atol=1e-3)  # the context rows' offsets are read

    conditioning.requires_grad_(False)
    assert_draft_passes_equal(target, model, conditioning, ids, model.lm_head(model.norm(got)),
                              ((6, 3, 0), (20, 2, 4)))

    conditioning.requires_grad_(True)
    block_hidden(model, ids, batch, None, context_offsets(conditioning, text, batch.context_length)).sum().backward()
    assert conditioning.proj.weight.grad is not None and conditioning.proj.weight.grad.abs().sum() > 0


def test_context_conditioning_of_a_long_prompt_projects_only_what_the_window_reads(models):
    """Past the context window's reach only the sink's and the recent ids' offsets are made (the drafter never
    reads the others), and the window's read carries them."""
    target, model = models["qwen2"], models["qwen2_other"]
    conditioning = TargetConditioning(ConditioningConfig(LAYERS, target.config.hidden_size,
                                                         model.config.hidden_size, context=True))
    conditioning.proj.weight.data.normal_(0, 0.3, generator=torch.Generator().manual_seed(0))
    ids = torch.randint(0, 250, (61,), generator=torch.Generator().manual_seed(2))
    drafter = ConditionedPardDrafter(model, MASK, conditioning.requires_grad_(False), 2, context_window=(2, 5))
    drafter.reset(80)
    with torch.no_grad():
        drafter.observe(ids.tolist(), -1, target(ids[None, :60], hidden_layers=LAYERS, logits="none").hidden_states)
    have = drafter._have_offset
    assert bool(have[1:3].all()) and not bool(have[3:47].any()) and bool(have[47:61].all())
    offsets = drafter._read_offsets([0, 1, 55, 60])[0]  # [4, D]
    assert not bool(offsets[0].any()) and bool(offsets[1:].any(dim=-1).all())
    drafter.draft_logits(ids.tolist(), 2)  # the window's read and the pass run with them
    assert drafter.slot_ids == [0, 1, 55, 56, 57, 58, 59, 60]


def test_the_exact_gradient_reaches_the_weights_through_the_context(tiny_model_dirs):
    """``exact``: the same rows, and the gradient also flows through the context pass (without it, only through
    the block rows)."""
    model = load_transformer(tiny_model_dirs["qwen2_other"], "fp32")
    ids = torch.randint(0, 250, (30,), generator=torch.Generator().manual_seed(1))
    batch = build_pard_batch(4, ids, torch.tensor([6, 20]), torch.tensor([3, 2]), MASK)
    weight = model.layers[0].ffn.w_down.weight.requires_grad_(True)  # (loaded frozen; training adds LoRA)
    hidden, grads = [], []
    for exact in (False, True):
        model.zero_grad()
        rows = block_hidden(model, ids, batch, exact=exact)
        rows.sum().backward()
        hidden.append(rows.detach())
        grads.append(weight.grad.clone())
    torch.testing.assert_close(hidden[0], hidden[1])
    assert not torch.allclose(grads[0], grads[1])


def test_context_conditioning_needs_conditioning(tmp_path):
    from dflash2.train.pard_trainer import PardTrainConfig, build_conditioning

    config = PardTrainConfig(base_dir="", label_dirs="", out_dir=str(tmp_path), condition_context=True)
    with pytest.raises(ValueError, match="needs condition"):
        build_conditioning(config, None, None)


@pytest.mark.parametrize("pipeline", PIPELINES)
@pytest.mark.parametrize("k,context", [(1, False), (3, False), (6, False), (3, True)])
def test_greedy_identity(models, k, context, pipeline):
    target, ids = models["qwen2"], torch.randint(0, 250, (13,), generator=torch.Generator().manual_seed(5))
    capacity = len(ids) + 40 + k + 1
    plain = list(itertools.islice(itertools.chain.from_iterable(
        plain_decode(target, ids, GREEDY, None, capacity, DecodeStats())), 40))
    draft_model = models["qwen2_other"]
    conditioning = TargetConditioning(ConditioningConfig(LAYERS, target.config.hidden_size,
                                                         draft_model.config.hidden_size, context=context))
    conditioning.proj.weight.data.normal_(0, 0.3, generator=torch.Generator().manual_seed(0))
    drafter = ConditionedPardDrafter(draft_model, MASK, conditioning.requires_grad_(False), k)
    stats = DecodeStats()
    spec = list(itertools.islice(itertools.chain.from_iterable(
        speculative_steps(pipeline, target, drafter, ids, GREEDY, None, capacity, stats)), 40))
    assert spec == plain
    assert drafter._offset is not None  # the engine fed it the target's states
    if context:  # ... of every committed position
        assert bool(drafter._have_offset[1 : len(ids) + 30].all())


def test_features_and_conditioned_training(tiny_model_dirs, tmp_path):
    from dflash2.drafters.conditioning import has_conditioning
    from dflash2.train.pard_trainer import PardTrainConfig, latest_checkpoint, train_pard
    from dflash2.train.target_features import FeatureSet, build_features, regenerated_items

    target = load_transformer(tiny_model_dirs["qwen2"], "fp32")
    gen = torch.Generator().manual_seed(2)
    sequences = []
    for _ in range(20):  # the target's own greedy continuations
        ids = torch.randint(0, 250, (6,), generator=gen).tolist()
        for _ in range(24):
            ids.append(int(target(torch.tensor([ids])).logits[0, -1].argmax()))
        sequences.append(TrainingSequence(torch.tensor(ids), prompt_length=6))
    regen = write_token_shards(tmp_path / "regen", sequences, shard_size=8)
    features = tmp_path / "features"
    build_features(features, target, regenerated_items(str(regen), heldout=4), LAYERS, top_k=4)
    assert len(FeatureSet(features).train) == 16 and len(FeatureSet(features).heldout) == 4
    common = dict(base_dir=tiny_model_dirs["qwen2_other"], label_dirs="", features_dir=str(features),
                  num_draft_tokens=4, lora_rank=4, mask_token_id=MASK, anchors_per_sequence=8,
                  sequences_per_step=2, num_steps=20, learning_rate=1e-2, mask_learning_rate=5e-2,
                  conditioning_learning_rate=1e-2, warmup_steps=2, eval_every=0, checkpoint_every=5, progress=False)
    train_pard(PardTrainConfig(out_dir=str(tmp_path / "plain"), **common))
    ordered = dict(condition=True, train_sequences=16)  # the features in order, each once per epoch
    train_pard(PardTrainConfig(out_dir=str(tmp_path / "cond"), stop_at_step=10, **ordered, **common))
    assert latest_checkpoint(tmp_path / "cond").name == "step_0000010"
    drafter_dir = train_pard(PardTrainConfig(out_dir=str(tmp_path / "cond"), **ordered, **common))
    plain_evals = [json.loads(line) for line in (tmp_path / "plain" / "eval.jsonl").read_text().splitlines()]
    cond_evals = [json.loads(line) for line in (tmp_path / "cond" / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in cond_evals] == [0, 10, 20]
    assert cond_evals[0]["code"] == plain_evals[0]["code"]  # zero-initialised: step 0 drafts as without it
    assert cond_evals[-1]["code"]["tau"] > cond_evals[0]["code"]["tau"]
    assert has_conditioning(drafter_dir)
    loaded = TargetConditioning.load(drafter_dir)
    assert loaded.config.target_layers == LAYERS and loaded.proj.weight.abs().max() > 0 and not loaded.config.context

    # every context position conditioned: the same start, it learns, and its drafter says where it reads
    context_dir = train_pard(PardTrainConfig(out_dir=str(tmp_path / "context"), condition_context=True, **ordered,
                                             **common))
    context_evals = [json.loads(line) for line in (tmp_path / "context" / "eval.jsonl").read_text().splitlines()]
    assert context_evals[0]["code"] == plain_evals[0]["code"]
    assert context_evals[-1]["code"]["tau"] > context_evals[0]["code"]["tau"]
    assert TargetConditioning.load(context_dir).config.context
    with pytest.raises(ValueError, match="conditions on"):  # a warm start keeps where its conditioning reads
        train_pard(PardTrainConfig(out_dir=str(tmp_path / "mixed"), init_adapter=str(context_dir), **ordered,
                                   **common))

    # gated keys / values (drafters/kv_conditioning.py): closed gates start where the plain run starts, a stopped
    # run resumes (gates and projection from the checkpoint), it learns, and a checkpoint ships both
    from dflash2.drafters.kv_conditioning import GatedKVConditioning, has_kv_conditioning
    from dflash2.train.pard_trainer import adapter_from_checkpoint

    kv = dict(condition_kv=True, train_sequences=16, gate_learning_rate=5e-2)
    train_pard(PardTrainConfig(out_dir=str(tmp_path / "kv"), stop_at_step=10, **kv, **common))
    kv_dir = train_pard(PardTrainConfig(out_dir=str(tmp_path / "kv"), **kv, **common))
    kv_evals = [json.loads(line) for line in (tmp_path / "kv" / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in kv_evals] == [0, 10, 20]
    assert kv_evals[0]["code"] == plain_evals[0]["code"]
    assert kv_evals[-1]["code"]["tau"] > kv_evals[0]["code"]["tau"]
    assert has_kv_conditioning(kv_dir) and not has_conditioning(kv_dir)
    assert bool(GatedKVConditioning.load(kv_dir).gates.abs().gt(0).all())
    shipped = adapter_from_checkpoint(tmp_path / "kv", tmp_path / "kv-shipped")
    assert torch.equal(GatedKVConditioning.load(shipped).gates, GatedKVConditioning.load(kv_dir).gates)


def test_distil_on_a_prompt_file_reports_the_held_out_gain(tiny_model_dirs, tmp_path):
    """`dflash2 train distil`'s function: a prompt file (prompts and chats), the target's answers, a run from a
    shipped adapter (by default unconditioned, with the exact gradient; conditioned when asked or when the start
    is), the held-out tau before and after."""
    from dflash2.train.distil import distil, read_prompt_file
    from dflash2.train.pard_trainer import PardTrainConfig, build_model, save_adapter
    from dflash2.train.target_features import FeatureSet, build_features

    rows = [{"prompt": f"question {i}"} for i in range(9)]
    rows += [{"messages": [{"role": "user", "content": f"hello {i}"}, {"role": "assistant", "content": "hi"},
                           {"role": "user", "content": f"more {i}"}]} for i in range(3)]
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    chats = read_prompt_file(path)
    assert len(chats) == 12 and chats[9][-1]["content"] == "more 0"
    (tmp_path / "bad.jsonl").write_text(json.dumps({"messages": [{"role": "assistant", "content": "x"}]}) + "\n")
    with pytest.raises(ValueError, match="user"):
        read_prompt_file(tmp_path / "bad.jsonl")

    base = tiny_model_dirs["qwen2_other"]
    shipped = PardTrainConfig(base_dir=base, label_dirs="", out_dir=str(tmp_path / "unused"), lora_rank=4,
                              num_draft_tokens=4, mask_token_id=MASK)
    model, mask_id, _, mask_embedding = build_model(shipped)
    init = save_adapter(tmp_path / "shipped", model, mask_embedding, shipped, mask_id)

    def encode(messages):  # a stand-in chat template: ids from the text
        text = " ".join(m["content"] for m in messages)
        return [sum(map(ord, word)) % 250 for word in text.split()] + [7]

    target = load_transformer(tiny_model_dirs["qwen2"], "fp32")
    common = dict(base_dir=base, init_adapter=str(init), layers=LAYERS, steps=20, heldout_share=0.25,
                  max_new_tokens=24, learning_rate=1e-2, mask_learning_rate=5e-2, conditioning_learning_rate=1e-2,
                  progress=False)
    report = distil(target, chats, encode, [], tmp_path / "mine", **common)
    assert set(report.before) == {"heldout"} and report.before["heldout"]["blocks"] > 0
    assert report.after["heldout"]["tau"] > report.before["heldout"]["tau"]
    assert not (report.drafter_dir / "conditioning.json").exists() and not report.conditioned
    assert not report.conditioned_start
    state = sorted((tmp_path / "mine" / "run" / "checkpoints").glob("*/trainer_state.json"))[-1]
    assert json.loads(state.read_text())["recipe"]["exact_gradient"] is True
    assert any("tau" in line for line in report.lines())
    plain_files = sorted((tmp_path / "mine" / "features").glob("*.safetensors"))
    unconditioned = {"tokens", "label_start", "topk_ids", "topk_probs", "rest"}  # no taps: nothing reads them
    assert len(plain_files) == 12 and all(_tensor_names(f) == unconditioned for f in plain_files)
    assert FeatureSet(tmp_path / "mine" / "features").target_layers == ()
    with pytest.raises(ValueError, match="no taps"):
        FeatureSet(tmp_path / "mine" / "features").read(plain_files[0].stem)
    with pytest.raises(ValueError, match="no taps"):  # a directory keeps one kind of file
        build_features(tmp_path / "mine" / "features", target, [], LAYERS)

    conditioned = distil(target, chats, encode, [], tmp_path / "cond", condition=True, **common)
    assert conditioned.after["heldout"]["tau"] > conditioned.before["heldout"]["tau"]
    assert (conditioned.drafter_dir / "conditioning.json").exists()
    assert conditioned.conditioned and not conditioned.conditioned_start
    assert all("taps" in _tensor_names(f) for f in (tmp_path / "cond" / "features").glob("*.safetensors"))
    with pytest.raises(ValueError, match="conditioned on the target"):  # a conditioned start keeps its conditioning
        distil(target, chats, encode, [], tmp_path / "again", condition=False,
               **{**common, "init_adapter": str(conditioned.drafter_dir)})
    further = distil(target, chats, encode, [], tmp_path / "further",
                     **{**common, "steps": 2, "init_adapter": str(conditioned.drafter_dir)})
    assert further.conditioned and further.conditioned_start  # (a conditioned start: conditioned by default)


def _tensor_names(path) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        return set(handle.keys())
