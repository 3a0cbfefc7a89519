"""DFlash block drafter: lossless greedy decoding, exact context bookkeeping, block attention, save/load."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from safetensors import safe_open

from dflash2.decode.plain import plain_decode
from dflash2.decode.speculative import speculative_decode
from dflash2.decode.stats import DecodeStats
from dflash2.drafters.base import Draft
from dflash2.drafters.dflash import (
    DFlashConfig,
    DFlashDraftModel,
    DFlashDrafter,
    default_mask_token_id,
    default_target_layer_ids,
    load_dflash_drafter,
)
from dflash2.models.loading import load_transformer
from dflash2.verify.sampling import GREEDY, SamplingParams

NEW_TOKENS = 40


@pytest.fixture(scope="module")
def targets(tiny_model_dirs):
    return {key: load_transformer(tiny_model_dirs[key], "fp32") for key in ("qwen2", "llama")}


def make_model(target, block_size: int, num_layers: int = 2, seed: int = 0, **kwargs) -> DFlashDraftModel:
    torch.manual_seed(seed)
    config = DFlashConfig.for_target(target.config, num_layers=num_layers, block_size=block_size, **kwargs)
    model = DFlashDraftModel(config)
    for param in model.parameters():  # sharper than the default init, so that drafts depend on the inputs
        param.data.mul_(2.0) if param.dim() == 2 else None
    return model.eval()


def prompt_ids(seed: int = 3, length: int = 12) -> torch.Tensor:
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(seed))


def run(steps, limit: int) -> list[int]:
    return list(itertools.islice(itertools.chain.from_iterable(steps), limit))


def plain_ids(target, prompt, capacity, limit=NEW_TOKENS):
    return run(plain_decode(target, prompt, GREEDY, None, capacity, DecodeStats()), limit)


def spec_ids(target, drafter, prompt, capacity, limit=NEW_TOKENS, stats=None, params=GREEDY, generator=None):
    stats = stats if stats is not None else DecodeStats()
    return run(speculative_decode(target, drafter, prompt, params, generator, capacity, stats), limit)


def first_draft(drafter, target, prompt, capacity, params, num_draft_tokens: int = 5) -> Draft:
    """The drafter's first draft after the prompt's prefill (the pending token is the target's argmax)."""
    drafter.reset(capacity)
    with torch.inference_mode():
        out = target(prompt[None], hidden_layers=drafter.hidden_layers, logits="last")
        sequence = prompt.tolist() + [int(out.logits[0, -1].argmax())]
        drafter.observe(sequence, -1, out.hidden_states)
        return drafter.propose(sequence, num_draft_tokens, params, torch.Generator().manual_seed(0))


def test_default_target_layer_ids_follow_the_reference_spread():
    assert default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)
    assert default_target_layer_ids(36, 1) == (18,)
    assert default_target_layer_ids(28, 5) == (1, 7, 13, 19, 25)
    assert default_target_layer_ids(3, 2) == (0, 2)  # too shallow for 1 .. L - 3: all layers


def test_default_mask_token_is_never_a_stop_id(targets):
    assert default_mask_token_id(10, reserved={9}) == 8
    assert default_mask_token_id(10, reserved={9}, pad_token_id=3) == 3
    assert default_mask_token_id(10, reserved={3, 9}, pad_token_id=3) == 8  # pad == EOS is refused
    assert default_mask_token_id(10, reserved={2}, tokenizer_size=8) == 9  # an unused embedding row
    config = targets["llama"].config
    chosen = DFlashConfig.for_target(config).mask_token_id
    assert chosen not in config.eos_token_ids and chosen != config.bos_token_id
    if config.eos_token_ids:
        with pytest.raises(ValueError, match="EOS"):
            DFlashConfig.for_target(config, mask_token_id=next(iter(config.eos_token_ids)))


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("target_key", ["qwen2", "llama"])
def test_untrained_drafter_keeps_greedy_output_identical(targets, target_key, block_size):
    target, prompt = targets[target_key], prompt_ids()
    drafter = DFlashDrafter(make_model(target, block_size), target)
    assert drafter.num_draft_tokens == block_size - 1
    capacity = len(prompt) + NEW_TOKENS + block_size
    stats = DecodeStats()
    assert spec_ids(target, drafter, prompt, capacity, stats=stats) == plain_ids(target, prompt, capacity)
    assert len(stats.drafted_by_position) == block_size - 1


@pytest.mark.parametrize("block_size", [8, 16])
def test_near_the_context_limit_drafts_are_capped_and_output_unchanged(targets, block_size):
    target, prompt = targets["qwen2"], prompt_ids()
    capacity = len(prompt) + 13
    expected = plain_ids(target, prompt, capacity, limit=10_000)
    assert len(expected) == 14
    drafter = DFlashDrafter(make_model(target, block_size), target)
    assert spec_ids(target, drafter, prompt, capacity, limit=10_000) == expected


class OracleDFlashDrafter(DFlashDrafter):
    """A real DFlash drafter whose first ``m`` drafts are then overwritten with the target's own greedy
    continuation (m cycling 0..k), so that verification accepts 0..k drafts; before drafting it checks the
    cached context against one recomputed from scratch."""

    def __init__(self, model, target, prompt_length: int, expected: list[int]) -> None:
        super().__init__(model, target)
        self.prompt_length, self.expected = prompt_length, expected
        self.calls = 0
        self.max_context_error = 0.0

    def propose(self, sequence, num_draft_tokens, params, generator):
        start = len(sequence) - 1
        assert self.context_length == start  # exactly the committed positions before the block
        self._check_context_matches_a_fresh_computation(sequence)
        draft = super().propose(sequence, num_draft_tokens, params, generator)
        generated = len(sequence) - self.prompt_length  # tokens after the prompt, the pending one included
        truth = torch.tensor(self.expected[generated : generated + len(draft.tokens)], dtype=torch.int64)
        m = min(self.calls % (num_draft_tokens + 1), len(truth))
        self.calls += 1
        tokens = draft.tokens.clone()
        tokens[:m] = truth[:m]
        return Draft(tokens=tokens, q_draft=None)

    def _check_context_matches_a_fresh_computation(self, sequence):
        start = len(sequence) - 1
        ids = torch.tensor(sequence[:start])[None]
        taps = self.target(ids, hidden_layers=self.hidden_layers, logits="none").hidden_states
        fresh = self.model.context_kv(self.model.project_context(taps), torch.arange(start)[None])
        for layer, (k, v) in enumerate(fresh):
            error = max((self.cache.keys[layer, :, :, :start] - k).abs().max().item(),
                        (self.cache.values[layer, :, :, :start] - v).abs().max().item())
            self.max_context_error = max(self.max_context_error, error)


@pytest.mark.parametrize("block_size", [8, 16])
def test_context_cache_tracks_committed_positions_through_partial_acceptance(targets, block_size):
    target, prompt = targets["llama"], prompt_ids(seed=5)
    capacity = len(prompt) + NEW_TOKENS + block_size
    expected = plain_ids(target, prompt, capacity, limit=NEW_TOKENS + block_size)
    drafter = OracleDFlashDrafter(make_model(target, block_size), target, len(prompt), expected)
    stats = DecodeStats()
    assert spec_ids(target, drafter, prompt, capacity, stats=stats) == expected[:NEW_TOKENS]
    assert sum(stats.accepted_by_position) > 5  # several partial acceptances happened
    assert drafter.max_context_error < 1e-4


def test_the_block_sees_no_cached_slot_at_or_after_its_start(targets):
    target, prompt = targets["qwen2"], prompt_ids()
    drafter = DFlashDrafter(make_model(target, 8), target)
    drafter.reset(64)
    with torch.inference_mode():
        out = target(prompt[None], hidden_layers=drafter.hidden_layers, logits="last")
        sequence = prompt.tolist() + [int(out.logits[0, -1].argmax())]
        drafter.observe(sequence, -1, out.hidden_states)
        start = len(sequence) - 1
        assert drafter.context_length == start
        before = drafter.block_logits(sequence[-1], start)
        drafter.cache.keys[:, :, :, start:] = 1e3 * torch.randn_like(drafter.cache.keys[:, :, :, start:])
        drafter.cache.values[:, :, :, start:] = 1e3 * torch.randn_like(drafter.cache.values[:, :, :, start:])
        after = drafter.block_logits(sequence[-1], start)
    assert torch.equal(before, after)


def test_observe_crops_context_past_the_new_taps(targets):
    """Taps for positions the cache already holds (a rewound sequence) replace them: no stale context stays."""
    target, prompt = targets["qwen2"], prompt_ids()
    drafter = DFlashDrafter(make_model(target, 8), target)
    drafter.reset(64)
    with torch.inference_mode():
        out = target(prompt[None], hidden_layers=drafter.hidden_layers, logits="none")
        sequence = prompt.tolist() + [7]
        drafter.observe(sequence, -1, out.hidden_states)
        rewound = sequence[:6] + [9]  # positions 0..5 committed, 9 pending; taps of positions 4, 5 again
        drafter.observe(rewound, 1, tuple(h[:, 4:6] for h in out.hidden_states))
        assert drafter.context_length == 6
        fresh = DFlashDrafter(drafter.model, target)
        fresh.reset(64)
        fresh.observe(rewound, -1, tuple(h[:, :6] for h in out.hidden_states))
        assert torch.allclose(drafter.block_logits(9, 6), fresh.block_logits(9, 6), atol=1e-5)
        with pytest.raises(RuntimeError, match="gap"):
            drafter.observe(rewound + [1, 2, 3], 0, tuple(h[:, :1] for h in out.hidden_states))


def test_attention_inside_the_block_is_bidirectional(targets):
    target = targets["qwen2"]
    model = make_model(target, 8)
    config = model.config
    context = model.project_context([torch.randn(1, 6, config.hidden_size) for _ in config.target_layer_ids])
    context_kv = model.context_kv(context, torch.arange(6)[None])
    embeds = torch.randn(1, 8, config.hidden_size)
    positions = torch.arange(6, 14)[None]
    with torch.no_grad():
        base = model(embeds, positions, context_kv)
        changed = embeds.clone()
        changed[0, 6] += 1.0  # a later block input
        moved = model(changed, positions, context_kv)
        other_context = model.context_kv(context + 1.0, torch.arange(6)[None])
        moved_by_context = model(embeds, positions, other_context)
    assert not torch.allclose(base[0, 1], moved[0, 1])  # an earlier position sees it
    assert not torch.allclose(base[0, 0], moved_by_context[0, 0])  # every position sees the context


def test_save_load_round_trip_gives_identical_drafts(targets, tmp_path):
    target, prompt = targets["qwen2"], prompt_ids()
    model = make_model(target, 8, target_model="tiny-qwen2")
    model.save_pretrained(tmp_path / "drafter")
    model.save_pretrained(tmp_path / "drafter")  # replacing an existing checkpoint works
    raw = json.loads((tmp_path / "drafter" / "config.json").read_text())
    assert raw["architectures"] == ["DFlashDraftModel"]
    assert raw["block_size"] == 8 and raw["target_layer_ids"] == list(model.config.target_layer_ids)
    assert raw["mask_token_id"] == model.config.mask_token_id and raw["target_model"] == "tiny-qwen2"
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "vocab_size"):
        assert key in raw
    with safe_open(str(tmp_path / "drafter" / "model.safetensors"), framework="pt") as handle:
        names = set(handle.keys())
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.self_attn.q_proj.weight",
            "layers.1.mlp.gate_proj.weight"} <= names
    assert not any("embed" in name or "lm_head" in name for name in names)

    loaded = load_dflash_drafter(tmp_path / "drafter", target)
    assert loaded.model.config == model.config
    capacity = len(prompt) + NEW_TOKENS + 8
    original = DFlashDrafter(model, target)
    for drafter in (original, loaded):
        drafter.reset(capacity)
    with torch.inference_mode():
        out = target(prompt[None], hidden_layers=original.hidden_layers, logits="last")
        sequence = prompt.tolist() + [int(out.logits[0, -1].argmax())]
        for drafter in (original, loaded):
            drafter.observe(sequence, -1, out.hidden_states)
        params = SamplingParams(temperature=0.9)
        drafts = [d.propose(sequence, 7, GREEDY, None) for d in (original, loaded)]
        sampled = [d.propose(sequence, 7, params, torch.Generator().manual_seed(1)) for d in (original, loaded)]
    assert torch.equal(drafts[0].tokens, drafts[1].tokens)
    assert torch.equal(sampled[0].tokens, sampled[1].tokens)
    assert torch.equal(sampled[0].q_draft, sampled[1].q_draft)


def test_state_dict_holds_no_embedding_or_head(targets):
    target = targets["llama"]
    model = make_model(target, 16)
    names = set(model.state_dict())
    assert not any("embed" in name or "lm_head" in name for name in names)
    c = model.config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    width = c.hidden_size
    per_layer = 2 * width + width * (q + 2 * kv) + q * width + 3 * width * c.intermediate_size
    expected = c.num_layers * per_layer + len(c.target_layer_ids) * width**2 + 2 * width
    assert sum(p.numel() for p in model.parameters()) == expected  # no vocabulary-sized table anywhere


def test_sampled_drafts_come_with_their_distributions(targets):
    target, prompt = targets["qwen2"], prompt_ids()
    drafter = DFlashDrafter(make_model(target, 8), target)
    params = SamplingParams(temperature=0.8, top_k=50)
    capacity = len(prompt) + NEW_TOKENS + 8
    draft = first_draft(drafter, target, prompt, capacity, params)
    assert draft.tokens.shape == (5,) and draft.q_draft.shape == (5, target.config.vocab_size)
    assert torch.allclose(draft.q_draft.sum(-1), torch.ones(5))
    assert bool((draft.q_draft[torch.arange(5), draft.tokens] > 0).all())
    runs = [spec_ids(target, drafter, prompt, capacity, params=params, generator=torch.Generator().manual_seed(4))
            for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == NEW_TOKENS


def test_warm_start_copies_target_layers(targets):
    target = targets["qwen2"]
    model = make_model(target, 8, num_layers=2)
    model.init_from_target(target)
    for own, index in zip(model.layers, (1, 2)):
        for name, tensor in target.layers[index].state_dict().items():
            assert torch.equal(own.state_dict()[name], tensor)
    taps = [torch.randn(1, 3, target.config.hidden_size) for _ in model.config.target_layer_ids]
    assert torch.allclose(model.fc(torch.cat(taps, -1)), sum(taps) / len(taps), atol=1e-5)


def test_warm_start_reads_the_weights_of_packed_target_layers(targets):
    """A CPU target loaded in bf16 holds its projections packed, outside the state dict; they are still copied."""
    import copy

    from dflash2.kernels import kernels_available
    from dflash2.models.loading import pack_layer_projections

    if not kernels_available():
        pytest.skip("the packed bf16 kernel is not available")
    target = targets["qwen2"]
    packed = copy.deepcopy(target)
    pack_layer_projections(packed.layers)
    model = make_model(target, 8, num_layers=2)
    model.init_from_target(packed)
    for own, index in zip(model.layers, (1, 2)):
        for name, tensor in target.layers[index].state_dict().items():
            expected = tensor.to(torch.bfloat16).to(tensor.dtype) if tensor.dim() == 2 else tensor
            assert torch.equal(own.state_dict()[name], expected), name


def test_a_saved_drafter_may_record_its_default_draft_length(targets, tmp_path):
    target = targets["qwen2"]
    directory = make_model(target, 8).save_pretrained(tmp_path / "drafter")
    assert load_dflash_drafter(directory, target).num_draft_tokens == 7  # block_size - 1
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "default_num_draft_tokens": 3}))
    assert load_dflash_drafter(directory, target).num_draft_tokens == 3
    assert load_dflash_drafter(directory, target, 5).num_draft_tokens == 5  # an explicit length wins
