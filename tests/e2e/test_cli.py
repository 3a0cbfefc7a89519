"""The command line: bad input gives a one-line error and a non-zero exit; --json prints the stats."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.e2e.conftest import SMOLLM2, model_dir


def dflash2(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dflash2.cli", *args], capture_output=True, text=True, timeout=600)


def assert_one_line_error(proc: subprocess.CompletedProcess, fragment: str) -> None:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and fragment in lines[0], proc.stderr


def test_unknown_model_name():
    assert_one_line_error(dflash2("generate", "hi", "--model", "no-such-model"), "no-such-model")


def test_empty_prompt():
    assert_one_line_error(dflash2("generate", "   "), "empty")


def test_non_positive_max_new_tokens():
    assert_one_line_error(dflash2("generate", "hi", "--max-new-tokens", "0"), "max-new-tokens")


@pytest.mark.model
def test_prompt_longer_than_the_context():
    model_dir(SMOLLM2, "bf16")
    proc = dflash2("generate", "word " * 9000, "--model", SMOLLM2, "--raw")
    assert_one_line_error(proc, "context")


@pytest.mark.model
def test_json_output_has_the_stats():
    model_dir(SMOLLM2, "bf16")
    proc = dflash2("generate", "Write a haiku about the sea.", "--model", SMOLLM2, "--max-new-tokens", "12",
                   "--drafter", "ngram", "--json")
    assert proc.returncode == 0, proc.stderr
    record = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in ("new_tokens", "seconds", "tokens_per_s", "prefill_seconds", "text", "tau",
                "acceptance_by_position", "target_forwards"):
        assert key in record
    assert 0 < record["new_tokens"] <= 12 and record["tau"] >= 1.0


def test_unknown_pipeline():
    assert_one_line_error(dflash2("bench", "--pipeline", "sync,sideways", "--drafters", "ngram"), "--pipeline")


@pytest.mark.model
@pytest.mark.slow  # the overlap pipeline's greedy identity is tested in the default run by tests/unit
def test_overlap_pipeline_from_the_command_line_matches_plain_decoding_in_fp32():
    model_dir(SMOLLM2, "fp32")
    common = ("generate", "Write a haiku about the sea.", "--model", SMOLLM2, "--dtype", "fp32",
              "--max-new-tokens", "24", "--json")
    plain = dflash2(*common, "--drafter", "none")
    overlap = dflash2(*common, "--drafter", "model", "--draft-model", SMOLLM2, "-k", "3", "--pipeline", "overlap",
                      "--adaptive-draft")
    assert plain.returncode == 0 and overlap.returncode == 0, plain.stderr + overlap.stderr
    plain_record, record = (json.loads(p.stdout.strip().splitlines()[-1]) for p in (plain, overlap))
    assert record["token_ids"] == plain_record["token_ids"]
    assert record["pipeline"] == "overlap" and record["predraft_hit_rate"] > 0.5  # the drafter is the target
    assert 0.0 <= record["target_idle_fraction"] <= 1.0 and 0.0 <= record["drafter_idle_fraction"] <= 1.0


def test_train_hidden_refills_what_a_fresh_clone_lacks(tiny_model_dirs, tmp_path):
    from dflash2.models.loading import load_transformer
    from dflash2.train.data import DataConfig, TokenShards, generate_training_data, shards_missing_hidden

    assert_one_line_error(dflash2("train", "hidden", "--data", str(tmp_path / "none")), "manifest.json")
    gsm8k = tmp_path / "gsm8k.jsonl"
    gsm8k.write_text("".join(json.dumps({"question": f"What is {i} plus {i}?"}) + "\n" for i in range(4)))
    config = DataConfig(str(tmp_path / "data"), 4, max_new_tokens=4, shard_size=2, batch_size=2, hidden_layers=(0, 1),
                        hidden_dir=str(tmp_path / "hidden"), sources=("gsm8k",), gsm8k_path=str(gsm8k), progress=False)
    target = load_transformer(tiny_model_dirs["qwen2"], "fp32")
    generate_training_data(config, target, lambda text: list(text.encode())[:16], stop_ids=())
    for shard in (tmp_path / "hidden").glob("*.safetensors"):
        shard.unlink()
    assert shards_missing_hidden(config.out_dir) == [0, 1]
    proc = dflash2("train", "hidden", "--model", tiny_model_dirs["qwen2"], "--data", config.out_dir, "--dtype", "fp32")
    assert proc.returncode == 0, proc.stderr
    assert "written for 2 shards" in proc.stdout and shards_missing_hidden(config.out_dir) == []
    assert all(sequence.hidden is not None for sequence in TokenShards(config.out_dir))
    assert "every shard has" in dflash2("train", "hidden", "--data", config.out_dir).stdout
