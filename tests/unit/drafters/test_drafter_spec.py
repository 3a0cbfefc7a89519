"""The drafter spec ``name[:k[xW]]``: one parser for the CLI, the API, the bench and the server; the default draft
lengths in one table; drafters copied per request by ``for_request``."""

from __future__ import annotations

import pytest

from dflash2.drafters import DEFAULT_NUM_DRAFT_TOKENS, DRAFTER_NAMES, DraftTarget, DrafterSpec, build_drafter
from dflash2.drafters.ngram import NgramDrafter


class EosTokenizer:
    eos_token_ids = frozenset({0})


@pytest.mark.parametrize("text, expected", [
    ("ngram", DrafterSpec("ngram")),
    ("dflash2:2", DrafterSpec("dflash2", 2)),
    ("dflash2:2x3", DrafterSpec("dflash2", 2, 3)),
    ("auto:5x1", DrafterSpec("auto", 5, 1)),
    (" model:4 ", DrafterSpec("model", 4)),
    ("pard:1+4x3", DrafterSpec("pard", 4, 3, 1)),
    ("pard+ngram:2+4", DrafterSpec("pard+ngram", 4, None, 2)),
    (None, DrafterSpec("none")),
])
def test_specs_parse(text, expected):
    assert DrafterSpec.parse(text) == expected
    assert DrafterSpec.parse(expected) is expected
    if text:
        assert DrafterSpec.parse(str(expected)) == expected  # str gives the spec back


@pytest.mark.parametrize("text, fragment", [
    ("ngarm", "unknown drafter 'ngarm'"), ("", "unknown drafter ''"), ("dflash:", "k or kxW"),
    ("dflash:0", "k or kxW"), ("dflash:-1", "k or kxW"), ("dflash:x2", "k or kxW"), ("dflash:3x", "k or kxW"),
    ("dflash:3x0", "k or kxW"), ("dflash:3x2x1", "k or kxW"), ("dflash:+3", "k or kxW"), ("dflash:3 x2", "k or kxW"),
    ("none:3", "takes no k or W"), ("pard:0+4", "L+k"), ("pard:+4", "L+k"), ("pard:1+", "L+k"),
    ("pard:1+2+3", "L+k"), ("dflash2:1+3", "lead tokens"), ("model:2+2", "lead tokens"),
])
def test_bad_specs_say_what_is_wrong(text, fragment):
    with pytest.raises(ValueError, match=fragment.replace("+", r"\+")):
        DrafterSpec.parse(text)


def test_k_and_w_given_twice_must_agree():
    spec = DrafterSpec.parse("dflash2:2x3")
    assert spec.merge(2, 3) == spec and spec.merge() == spec
    assert DrafterSpec.parse("ngram").merge(5, 2) == DrafterSpec("ngram", 5, 2)
    assert DrafterSpec.parse("ngram:5").merge(None, 2) == DrafterSpec("ngram", 5, 2)
    with pytest.raises(ValueError, match="k=2 but num_draft_tokens"):
        spec.merge(num_draft_tokens=4)
    with pytest.raises(ValueError, match="W=3 but num_candidates"):
        spec.merge(num_candidates=1)
    with pytest.raises(ValueError, match="positive"):
        DrafterSpec.parse("ngram").merge(0)
    assert DrafterSpec.parse("none").merge(4, 2) == DrafterSpec("none")  # plain decoding ignores them


def test_one_table_holds_every_drafters_default_length():
    assert set(DEFAULT_NUM_DRAFT_TOKENS) == set(DRAFTER_NAMES) - {"auto", "none"}
    target = DraftTarget(None, EosTokenizer(), "/some/local/dir")  # ngram needs only the tokenizer
    drafter = build_drafter("auto", target)  # auto: ngram off the default target
    assert isinstance(drafter, NgramDrafter) and drafter.num_draft_tokens == DEFAULT_NUM_DRAFT_TOKENS["ngram"]
    drafter = build_drafter("ngram:5x2", target)
    assert (drafter.num_draft_tokens, drafter.num_candidates, drafter.stop_ids) == (5, 2, frozenset({0}))
    assert build_drafter(DrafterSpec("ngram"), target, num_draft_tokens=3).num_draft_tokens == 3
    with pytest.raises(ValueError, match="num_draft_tokens"):
        build_drafter("ngram:5", target, num_draft_tokens=3)
    with pytest.raises(ValueError, match="drafts a chain"):  # a tree width is refused, not silently dropped
        build_drafter("model:4x2", target)


def test_serving_builds_the_drafter_the_server_measured_fastest(monkeypatch):
    from dflash2.drafters import spec as spec_module

    name = "/some/local/dir"  # ngram needs only the tokenizer; the table names the drafter by its draft length
    rows = (spec_module.AutoDrafter(name, True, "amx", "ngram:7", ""),
            spec_module.AutoDrafter(name, False, "any", "ngram:3", ""),
            spec_module.AutoDrafter(name, True, "any", "ngram:5", ""))
    monkeypatch.setattr(spec_module, "AUTO_DRAFTERS", rows + spec_module.AUTO_DRAFTERS)
    target = DraftTarget(None, EosTokenizer(), name)  # no model: its layers are not on AMX tiles
    assert build_drafter("auto", target).num_draft_tokens == 3
    assert build_drafter("auto", target, serving=True).num_draft_tokens == 5
    assert build_drafter("ngram:4", target, serving=True).num_draft_tokens == 4  # a named drafter stays itself
    tiles = spec_module.DraftHardware(tile_verification=True, amx_verification=True)
    assert spec_module.default_drafter(name, serving=True, hardware=tiles) == "ngram:7"
    assert build_drafter("auto", target, serving=True, hardware=tiles).num_draft_tokens == 7


def test_stateless_drafters_are_shared_and_stateful_ones_copied(tiny_model_dirs):
    from dflash2.drafters.model import ModelDrafter
    from dflash2.models.loading import load_transformer

    from dflash2.drafters.base import for_request

    ngram = NgramDrafter(4)
    assert for_request(ngram) is ngram
    drafter = ModelDrafter(load_transformer(tiny_model_dirs["qwen2"], "fp32", "cpu"), 3, target_vocab_size=300)
    drafter.reset(16)
    copy = drafter.for_request()
    assert copy is not drafter and copy.model is drafter.model and copy.cache is None  # own cache, shared weights
    assert (copy.num_draft_tokens, copy.target_vocab_size) == (3, 300)


def test_the_cli_takes_a_spec_and_refuses_a_conflict_before_loading(capsys):
    from dflash2.cli import build_parser, main

    args = build_parser().parse_args(["generate", "hi", "--drafter", "dflash2:2x3"])
    assert args.drafter == "dflash2:2x3" and args.num_draft_tokens is None and args.num_candidates is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "hi", "--drafter", "dflash2:0"])
    assert "k or kxW" in capsys.readouterr().err
    assert main(["generate", "hi", "--model", "no-such-model", "--drafter", "ngram:4", "-k", "5"]) == 2
    assert "k=4 but num_draft_tokens" in capsys.readouterr().err  # the conflict, not the unknown model


def test_the_api_parses_the_spec_before_loading():
    import dflash2

    with pytest.raises(ValueError, match="W=3 but num_candidates"):
        dflash2.load("no-such-model", drafter="dflash2:2x3", num_candidates=2)
    with pytest.raises(ValueError, match="unknown drafter"):
        dflash2.load("no-such-model", drafter="dflash3")


def test_the_server_takes_a_tree_spec(tiny_model_dirs):
    """Trees are served too: ``--drafter ngram:3x2`` gives each request an n-gram tree of 2 continuations."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from dflash2.cli import build_parser
    from dflash2.serve.cli import build_server

    args = build_parser().parse_args(["serve", "--model", tiny_model_dirs["qwen2"], "--dtype", "fp32", "--drafter",
                                      "ngram:3x2"])
    app, batch = build_server(args)
    assert batch.drafters["ngram"]().num_candidates == 2
    batch.start()
    try:
        client = TestClient(app)
        body = {"model": tiny_model_dirs["qwen2"], "prompt": [5, 6, 7, 5, 6, 7, 5, 6], "max_tokens": 12,
                "temperature": 0}
        drafted = client.post("/v1/completions", json=body).json()
        plain = client.post("/v1/completions", json=body | {"dflash2": {"num_draft_tokens": 0}}).json()
        assert drafted["choices"][0]["text"] == plain["choices"][0]["text"]
        assert drafted["dflash2"]["drafter"] == "ngram" and drafted["dflash2"]["num_draft_tokens"] == 3
    finally:
        batch.stop()


def test_the_bench_takes_the_same_specs():
    from dflash2.bench.cli import _bench_spec
    from dflash2.cli_common import CliError

    assert _bench_spec("dflash2:2x3", 8, 1) == DrafterSpec("dflash2", 2, 3)  # an entry's own shape wins
    assert _bench_spec("ngram", 8, None) == DrafterSpec("ngram", 8)
    with pytest.raises(CliError, match="--drafters: unknown drafter"):
        _bench_spec("ngarm", None, None)
