"""A pard drafter in Q8_0 blocks reads long prompts through a bf16 twin of its network (``reading_twin``): the
twin shares everything but the projections, only long reads take it, and decoding stays lossless."""

from __future__ import annotations

import itertools

import pytest
import torch

from dflash2.decode.plain import plain_decode
from dflash2.decode.stats import DecodeStats
from dflash2.drafters.pard import PardDrafter, load_pard_networks, pard_reader
from dflash2.kernels.packed_linear import CpuLinear
from dflash2.models.loading import load_transformer
from dflash2.platform import reload_settings
from dflash2.verify.sampling import GREEDY
from tests.pipelines import speculative_steps
from tests.unit.drafters.test_pard import MASK, write_random_adapter

LONG = PardDrafter.READER_MIN_IDS + 9  # prompt ids: a read the twin takes


@pytest.fixture(scope="module")
def networks(tiny_model_dirs, tmp_path_factory):
    base = tiny_model_dirs["qwen2_other"]
    adapter = write_random_adapter(base, tmp_path_factory.mktemp("pard") / "adapter", MASK, num_draft_tokens=4)
    return load_pard_networks(adapter, base, "bf16", weights="q8_0", reader=True), adapter, base


def long_prompt() -> list[int]:
    return torch.randint(0, 250, (LONG,), generator=torch.Generator().manual_seed(11)).tolist()


def test_the_twin_shares_all_but_the_projections(networks):
    (model, _, reader), adapter, base = networks
    assert reader is not None and reader.embed.weight is model.embed.weight and reader.lm_head is model.lm_head
    assert reader.norm is not model.norm and reader.norm.weight is model.norm.weight
    layer, twin_layer = model.layers[0], reader.layers[0]
    assert twin_layer.attn.wqkv is not layer.attn.wqkv and isinstance(twin_layer.ffn.w_down, CpuLinear)
    _, _, none = load_pard_networks(adapter, base, "bf16", weights="bf16", reader=True)
    assert none is None  # bf16 weights are the twin's format already


def test_only_long_reads_go_through_the_twin(networks):
    (model, config, reader), *_ = networks
    drafter = PardDrafter(model, config.mask_token_id, 4, reader=reader).for_request()
    assert drafter.reader is reader  # copies per request share it
    calls: list[tuple[str, int]] = []
    hooks = [network.register_forward_hook(lambda module, args, out, name=name: calls.append(
        (name, args[0].shape[1]))) for network, name in ((model, "blocks"), (reader, "twin"))]
    try:
        drafter.reset(LONG + 16)
        drafter.prefill(long_prompt())
        drafter.propose(long_prompt() + [7], 4, GREEDY, None)  # the pending id and 3 masks
        drafter.prefill(long_prompt()[:10])  # rolled back to 10 ids: nothing to read
        short = drafter.for_request()
        short.reset(32)
        short.prefill(long_prompt()[: PardDrafter.READER_MIN_IDS - 1])
    finally:
        for hook in hooks:
            hook.remove()
    assert calls == [("twin", LONG), ("blocks", 1 + 3), ("blocks", PardDrafter.READER_MIN_IDS - 1)]


def test_greedy_decoding_with_the_twin_is_plain_decoding(networks, tiny_model_dirs):
    """The twin changes only the drafts' context (at T > 0 each draft still comes with the q_draft it was drawn
    from, so the verification's exactness holds as for any drafter: tests/statistical)."""
    (model, config, reader), *_ = networks
    target = load_transformer(tiny_model_dirs["qwen2"], "fp32")
    ids = torch.tensor(long_prompt())
    capacity = len(ids) + 40 + 8
    plain = list(itertools.islice(itertools.chain.from_iterable(
        plain_decode(target, ids, GREEDY, None, capacity, DecodeStats())), 40))
    reads: list[int] = []
    hook = reader.register_forward_hook(lambda module, args, out: reads.append(args[0].shape[1]))
    try:
        drafter = PardDrafter(model, config.mask_token_id, 4, reader=reader)
        drafter.reset(capacity)
        got = list(itertools.islice(itertools.chain.from_iterable(
            speculative_steps("sync", target, drafter, ids, GREEDY, None, capacity, DecodeStats())), 40))
    finally:
        hook.remove()
    assert reads == [LONG]  # the prompt went through the twin, every draft pass through the blocks
    assert got == plain


def test_the_reader_is_chosen_by_the_environment(monkeypatch):
    from dflash2.kernels.packed_linear import amx_usable

    monkeypatch.delenv("DFLASH2_PARD_READER", raising=False)
    reload_settings()
    assert pard_reader() == amx_usable()  # measured to pay on AMX tiles
    monkeypatch.setenv("DFLASH2_PARD_READER", "none")
    reload_settings()
    assert pard_reader() is False
    monkeypatch.setenv("DFLASH2_PARD_READER", "bf16")
    reload_settings()
    assert pard_reader() is True
    monkeypatch.setenv("DFLASH2_PARD_READER", "int4")
    reload_settings()
    with pytest.raises(ValueError, match="bf16 or none"):
        pard_reader()
