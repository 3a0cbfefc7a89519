"""Gated key / value conditioning on the target (``drafters/kv_conditioning.py``) in the PARD trainer's objective:
closed gates draft exactly as without it, open gates read only the target states each row may see, and the
gradient reaches the projection and the gates."""

from __future__ import annotations

import pytest
import torch

from dflash2.drafters.kv_conditioning import GatedKVConditioning, KVConditioningConfig
from dflash2.models.loading import load_transformer
from dflash2.train.pard_objective import block_hidden, build_pard_batch

MASK = 255
LAYERS = (0, 2)


@pytest.fixture(scope="module")
def models(tiny_model_dirs):
    return {key: load_transformer(path, "fp32") for key, path in tiny_model_dirs.items()}


def kv_conditioning(target, drafter, gate: float) -> GatedKVConditioning:
    conditioning = GatedKVConditioning(KVConditioningConfig(LAYERS, target.config.hidden_size,
                                                            drafter.config.hidden_size, drafter.config.num_layers))
    conditioning.gates.data.fill_(gate)
    return conditioning


def target_taps(target, ids: torch.Tensor) -> torch.Tensor:
    """[N, T * Dt] the target's tapped states at every position of ids [N]."""
    with torch.no_grad():
        out = target(ids[None], hidden_layers=LAYERS, logits="none")
    return torch.cat([h[0] for h in out.hidden_states], dim=-1)


def rows(model, ids, anchors, depths, conditioning=None, taps=None) -> torch.Tensor:
    batch = build_pard_batch(4, ids, torch.tensor(anchors), torch.tensor(depths), MASK)
    return block_hidden(model, ids, batch, target_kv=None if conditioning is None else (conditioning, taps))


def test_closed_gates_draft_exactly_as_without_conditioning(models):
    target, model = models["qwen2"], models["qwen2_other"]
    ids = torch.randint(0, 250, (30,), generator=torch.Generator().manual_seed(1))
    taps = target_taps(target, ids)
    with torch.no_grad():
        plain = rows(model, ids, [6, 11, 20], [3, 0, 2])
        closed = rows(model, ids, [6, 11, 20], [3, 0, 2], kv_conditioning(target, model, 0.0), taps)
        opened = rows(model, ids, [6, 11, 20], [3, 0, 2], kv_conditioning(target, model, 0.5), taps)
    assert torch.equal(closed, plain)
    assert not torch.allclose(opened, plain, atol=1e-3)  # open gates read the target


def test_a_block_reads_only_the_target_states_before_its_anchor(models):
    """Each block of a batch computes what it computes alone, and changing the target's states at or after its
    anchor changes nothing in it (the states the drafter has not been given yet at that step)."""
    target, model = models["qwen2"], models["qwen2_other"]
    ids = torch.randint(0, 250, (30,), generator=torch.Generator().manual_seed(2))
    taps = target_taps(target, ids)
    conditioning = kv_conditioning(target, model, 0.7)
    anchors, depths = [6, 11, 20], [3, 0, 2]
    with torch.no_grad():
        together = rows(model, ids, anchors, depths, conditioning, taps)
        first = 0
        for anchor, depth in zip(anchors, depths):
            alone = rows(model, ids, [anchor], [depth], conditioning, taps)
            torch.testing.assert_close(together[first : first + depth + 1], alone, atol=1e-5, rtol=1e-5)
            first += depth + 1
        changed = taps.clone()
        changed[11:] += torch.randn(changed[11:].shape, generator=torch.Generator().manual_seed(3))
        moved = rows(model, ids, anchors, depths, conditioning, changed)
    torch.testing.assert_close(moved[:5], together[:5], atol=1e-5, rtol=1e-5)  # anchors 6 and 11: before 11 only
    assert not torch.allclose(moved[5:], together[5:], atol=1e-3)  # anchor 20 reads positions 11 .. 19


def test_the_gradient_reaches_the_projection_and_the_gates(models):
    target, model = models["qwen2"], models["qwen2_other"]
    ids = torch.randint(0, 250, (30,), generator=torch.Generator().manual_seed(4))
    conditioning = kv_conditioning(target, model, 0.0)
    rows(model, ids, [6, 20], [3, 2], conditioning, target_taps(target, ids)).pow(2).sum().backward()
    assert conditioning.gates.grad is not None and bool((conditioning.gates.grad != 0).all())
    assert conditioning.fc.weight.grad is None or not bool(conditioning.fc.weight.grad.any())  # closed: no signal
    conditioning.zero_grad()
    conditioning.gates.data.fill_(0.3)
    rows(model, ids, [6, 20], [3, 2], conditioning, target_taps(target, ids)).pow(2).sum().backward()
    assert bool(conditioning.fc.weight.grad.any())


def test_save_and_load_keep_every_tensor(models, tmp_path):
    target, model = models["qwen2"], models["qwen2_other"]
    conditioning = kv_conditioning(target, model, 0.25)
    conditioning.save(tmp_path, torch.float32)
    loaded = GatedKVConditioning.load(tmp_path)
    assert loaded.config == conditioning.config
    for name, tensor in conditioning.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor)


def test_training_blocks_equal_the_draft_pass(models):
    """A training block computes what the drafter's pass computes after observing the target's states of the
    sequence up to that block's anchor (the anchor pending)."""
    from dflash2.drafters.kv_conditioned import KVConditionedPardDrafter
    from tests.unit.drafters.test_conditioned_drafter import assert_draft_passes_equal

    target, model = models["qwen2"], models["qwen2_other"]
    ids = torch.randint(0, 250, (30,), generator=torch.Generator().manual_seed(5))
    conditioning = kv_conditioning(target, model, 0.6).requires_grad_(False)
    anchors, depths = [6, 11, 20], [3, 0, 2]
    with torch.no_grad():
        logits = model.lm_head(model.norm(rows(model, ids, anchors, depths, conditioning, target_taps(target, ids))))
    assert_draft_passes_equal(target, model, conditioning, ids, logits, ((6, 3, 0), (11, 0, 4), (20, 2, 5)),
                              KVConditionedPardDrafter)


@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_identity(models, k):
    import itertools

    from dflash2.decode.plain import plain_decode
    from dflash2.decode.stats import DecodeStats
    from dflash2.drafters.kv_conditioned import KVConditionedPardDrafter
    from dflash2.verify.sampling import GREEDY
    from tests.pipelines import PIPELINES, speculative_steps

    target, ids = models["qwen2"], torch.randint(0, 250, (13,), generator=torch.Generator().manual_seed(6))
    capacity = len(ids) + 40 + k + 1
    plain = list(itertools.islice(itertools.chain.from_iterable(
        plain_decode(target, ids, GREEDY, None, capacity, DecodeStats())), 40))
    conditioning = kv_conditioning(target, models["qwen2_other"], 0.8).requires_grad_(False)
    for pipeline in PIPELINES:
        drafter = KVConditionedPardDrafter(models["qwen2_other"], MASK, conditioning, k)
        spec = list(itertools.islice(itertools.chain.from_iterable(
            speculative_steps(pipeline, target, drafter, ids, GREEDY, None, capacity, DecodeStats())), 40))
        assert spec == plain, pipeline
        assert bool(drafter._observed[: len(ids) + 30].all())  # the engine fed it every committed position
