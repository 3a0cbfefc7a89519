"""A DFlash drafter checkpoint is checked when it is loaded: a damaged one is refused with a clear error, never
used (a repeated draft-vocabulary id would over-accept its token at T > 0: silently lossy)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash2.drafters.dflash import DFlashDraftModel
from dflash2.models.loading import load_transformer
from tests.unit.drafters.test_dflash_draft_vocab import VOCAB
from tests.unit.drafters.test_dflash_drafter import make_model


@pytest.fixture(scope="module")
def saved(tiny_model_dirs, tmp_path_factory):
    """A saved drafter with a draft vocabulary: (directory, its weights, its config)."""
    target = load_transformer(tiny_model_dirs["qwen2"], "fp32")
    model = make_model(target, 8, draft_vocab_size=len(VOCAB))
    model.set_draft_vocab(VOCAB)
    directory = model.save_pretrained(tmp_path_factory.mktemp("drafter") / "d")
    return directory, load_file(str(directory / "model.safetensors")), json.loads((directory / "config.json").read_text())


def damaged(saved, tmp_path, weights=None, config=None):
    directory, original_weights, original_config = saved
    out = tmp_path / "damaged"
    out.mkdir(parents=True)
    save_file(weights if weights is not None else original_weights, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config if config is not None else original_config))
    return out


def test_the_intact_checkpoint_loads(saved):
    assert DFlashDraftModel.from_pretrained(saved[0]).draft_vocab.tolist() == VOCAB.tolist()


@pytest.mark.parametrize("vocab, message", [
    (torch.tensor([7, 3, 200, 11, 42, 99, 5, 0, 1, 7]), "distinct"),
    (torch.tensor([7, 3, 200, 11, 42, 99, 5, 0, 1, 256]), "outside"),
    (torch.tensor([7, 3, 200, 11, 42, 99, 5, 0, 1, -1]), "outside"),
    (torch.tensor([7, 3, 200]), "draft_vocab_size"),
    (torch.tensor([[7, 3, 200, 11, 42], [99, 5, 0, 1, 2]]), "1-D"),
])
def test_a_bad_draft_vocabulary_is_refused(saved, tmp_path, vocab, message):
    weights = dict(saved[1]) | {"draft_vocab": vocab}
    with pytest.raises(ValueError, match=message):
        DFlashDraftModel.from_pretrained(damaged(saved, tmp_path, weights=weights))


def test_a_missing_or_misshapen_weight_is_refused(saved, tmp_path):
    weights = dict(saved[1])
    name = next(n for n in weights if n.endswith("q_proj.weight"))
    with pytest.raises(ValueError, match="not a valid DFlash drafter"):
        DFlashDraftModel.from_pretrained(damaged(saved, tmp_path, weights={k: v for k, v in weights.items() if k != name}))
    weights["fc.weight"] = weights["fc.weight"][:, :-1].contiguous()
    with pytest.raises(ValueError, match="do not match"):
        DFlashDraftModel.from_pretrained(damaged(saved, tmp_path / "b", weights=weights))


def test_a_config_that_is_not_a_drafter_is_refused(saved, tmp_path):
    config = {k: v for k, v in saved[2].items() if k not in ("mask_token_id", "dflash_config")}
    with pytest.raises(ValueError, match="not a valid DFlash drafter"):
        DFlashDraftModel.from_pretrained(damaged(saved, tmp_path, config=config))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="not a valid DFlash drafter"):
        DFlashDraftModel.from_pretrained(tmp_path / "empty")
