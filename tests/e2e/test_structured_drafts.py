"""Grammar-shaped drafts on real models (drafters/grammar.py through the batch engine, as the server runs them):
greedy constrained speculative output equals constrained plain output token for token, every reply validates
against its schema, and the grammar's forced tokens are drafted. SmolLM2 (marker ``model``) with the server's
``auto`` drafter; the default target (``qwen``, ``slow``) with its serving ``auto``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.conftest import QWEN_TARGET, SMOLLM2

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

DATA = Path(__file__).resolve().parents[2] / "data" / "eval" / "structured" / "extraction.jsonl"


class Counted:
    """Keeps the drafter the engine wrapped for the request (to read its counters)."""

    def __init__(self, constraint) -> None:
        self.constraint, self.drafter = constraint, None

    def __getattr__(self, name):
        return getattr(self.constraint, name)

    def guide(self, drafter):
        self.drafter = self.constraint.guide(drafter)
        return self.drafter


@pytest.mark.parametrize("name", [
    pytest.param(SMOLLM2, marks=pytest.mark.model, id="smollm2"),
    pytest.param(QWEN_TARGET, marks=[pytest.mark.model, pytest.mark.qwen, pytest.mark.slow], id="qwen-1.5b"),
])
def test_grammar_shaped_drafts_keep_constrained_plain_output(name):
    import dflash2
    from dflash2.decode.batch import BatchConfig, BatchEngine, BatchRequest, request_drafters, run_to_completion
    from dflash2.serve.structured import Grammars, RequestConstraint, XgrammarState

    engine = dflash2.load(name, drafter="auto", serving=True, device="cpu")
    batch = BatchEngine(engine, BatchConfig(num_blocks=128, block_size=16, adaptive_drafts=False),
                        request_drafters(engine))
    vocab = engine.target.config.vocab_size
    grammars = Grammars(engine.tokenizer.hf, vocab, engine.tokenizer.eos_token_ids)
    drafter, k = engine.drafter.name, engine.drafter.num_draft_tokens
    forced = 0
    for row in [json.loads(line) for line in DATA.read_text().splitlines()][:3]:
        prompt = engine.encode_prompt([{"role": "user", "content": row["prompt"]}])
        outputs = []
        for name_k in (("none", 0), (drafter, k)):
            constraint = Counted(RequestConstraint(XgrammarState(grammars.json_schema(row["schema"])), vocab))
            request = BatchRequest(prompt, 96, drafter=name_k[0], num_draft_tokens=name_k[1], constraint=constraint)
            outputs.append(run_to_completion(batch, [request])[0])
            forced += getattr(constraint.drafter, "forced_drafts", 0)
        plain, drafted = outputs
        assert drafted.token_ids == plain.token_ids, row["id"]
        if plain.finish_reason != "length":
            jsonschema.validate(json.loads(plain.text), row["schema"])
    assert forced > 0
