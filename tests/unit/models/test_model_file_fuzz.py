"""Damaged model files end in one short error or a clean run: never another exception, a hang, a traceback, or a
clean run on a structure that cannot be whole (tests/fuzz_model_files.py: the damage kinds and the property).

Seed files are written here (tiny GGUFs with gguf-py, a tiny Hugging Face directory, a DFlash drafter, a PARD
adapter); each is damaged by a seeded generator and loaded in-process by the real loader. The default run holds
~330 cases; ``slow`` runs ~3300 and the SmolLM2 GGUF of the store; a few go through the ``dflash2`` command line in
a subprocess (its one line on stderr, a non-zero exit)."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash2.models.gguf_convert import GGUFConvertError, convert_gguf
from dflash2.models.loading import load_transformer
from dflash2.models.validate import ModelFileError
from tests.fuzz_model_files import (
    GGUF_KINDS,
    SAFETENSORS_KINDS,
    Case,
    cases,
    config_case,
    forward_once,
    gguf_case,
    map_gguf,
    outcome,
    put,
    safetensors_case,
)
from tests.unit.models.test_gguf_convert import write_tiny_gguf

DEFAULT, SLOW = 1, 10  # multiplies the cases per seed file: 80 per GGUF, 76 for the directory, 36 per drafter file
ROOT = Path(__file__).resolve().parents[3]


def _report(failures: list[str], total: int) -> None:
    assert not failures, f"{len(failures)} of {total} cases broke the property:\n" + "\n".join(failures[:20])


# ------------------------------------------------------------------------------------------------ GGUF


@pytest.fixture(scope="module")
def gguf_seeds(tmp_path_factory) -> dict[str, Path]:
    """A tied Llama in Q8_0 and an untied Qwen2 in F32 with q/k/v biases, both with a tokenizer."""
    folder = tmp_path_factory.mktemp("gguf-seeds")
    return {"llama": write_tiny_gguf(folder / "llama.gguf", "llama", layers=2),
            "qwen2": write_tiny_gguf(folder / "qwen2.gguf", "qwen2", quantize=False, layers=2)}


def _load_gguf(path: Path, out: Path):
    def load():
        try:
            convert_gguf(path, out, "fp32", tokenizer=False, progress=False)
            forward_once(load_transformer(out, "fp32"))
        finally:
            shutil.rmtree(out, ignore_errors=True)
    return load


def _fuzz_gguf(seed_file: Path, tmp_path: Path, per_kind: int, seed: int) -> None:
    data, fields = seed_file.read_bytes(), map_gguf(seed_file)
    all_cases = cases(GGUF_KINDS, 80 * per_kind, seed,
                      lambda kind, rng: gguf_case(data, fields, kind, rng))
    failures = []
    for i, case in enumerate(all_cases):
        path = tmp_path / f"case{i}.gguf"
        path.write_bytes(case.data)
        failure = outcome(case, _load_gguf(path, tmp_path / f"out{i}"), (ModelFileError, GGUFConvertError))
        if failure:
            failures.append(f"#{i} {failure}")
        path.unlink()
    _report(failures, len(all_cases))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_damaged_gguf_files(gguf_seeds, tmp_path, arch):
    _load_gguf(gguf_seeds[arch], tmp_path / "intact")()  # the intact seed loads and runs
    _fuzz_gguf(gguf_seeds[arch], tmp_path, DEFAULT, seed=1 if arch == "llama" else 2)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_damaged_gguf_files_many(gguf_seeds, tmp_path, arch):
    _fuzz_gguf(gguf_seeds[arch], tmp_path, SLOW, seed=11 if arch == "llama" else 12)


# ------------------------------------------------------------------------------------------- safetensors


@pytest.fixture(scope="module")
def hf_seed(tmp_path_factory) -> Path:
    from tests.conftest import make_hf_model

    folder = tmp_path_factory.mktemp("hf-seed")
    make_hf_model("qwen2", seed=3, num_layers=2).save_pretrained(str(folder))
    return folder


def _damaged_dir(seed_dir: Path, out: Path, file: str, data: bytes | None = None, config: dict | None = None) -> Path:
    shutil.copytree(seed_dir, out)
    if data is not None:
        (out / file).write_bytes(data)
    if config is not None:
        (out / "config.json").write_text(json.dumps(config))
    return out


def _fuzz_hf_dir(seed_dir: Path, tmp_path: Path, per_kind: int, seed: int) -> None:
    data = (seed_dir / "model.safetensors").read_bytes()
    raw = json.loads((seed_dir / "config.json").read_text())
    tensor_cases = cases(SAFETENSORS_KINDS, 60 * per_kind, seed,
                         lambda kind, rng: safetensors_case(data, kind, rng))
    config_cases = []
    for i in range(per_kind * 16):
        detail, config, must_fail = config_case(raw, random.Random(seed * 7 + i))
        config_cases.append((Case("config", detail, b"", must_fail), config))
    failures = []
    for i, (case, config) in enumerate([*((c, None) for c in tensor_cases), *config_cases]):
        out = _damaged_dir(seed_dir, tmp_path / f"case{i}", "model.safetensors",
                           case.data if config is None else None, config)
        dtype, packed = ("bf16", True) if i % 2 else ("fp32", False)  # the memory-mapped and the plain reads

        def load():
            forward_once(load_transformer(out, dtype, packed=packed))
        failure = outcome(case, load, (ModelFileError,))
        if failure:
            failures.append(f"#{i} {failure}")
        shutil.rmtree(out)
    _report(failures, len(tensor_cases) + len(config_cases))


def test_damaged_safetensors_directories(hf_seed, tmp_path):
    forward_once(load_transformer(hf_seed, "fp32"))
    _fuzz_hf_dir(hf_seed, tmp_path, DEFAULT, seed=3)


@pytest.mark.slow
def test_damaged_safetensors_directories_many(hf_seed, tmp_path):
    _fuzz_hf_dir(hf_seed, tmp_path, SLOW, seed=13)


# ------------------------------------------------------------------------------- drafter checkpoint, adapter


@pytest.fixture(scope="module")
def drafter_seed(hf_seed, tmp_path_factory) -> Path:
    from tests.unit.drafters.test_dflash_drafter import make_model

    target = load_transformer(hf_seed, "fp32")
    return make_model(target, 4).save_pretrained(tmp_path_factory.mktemp("drafter") / "d")


@pytest.fixture(scope="module")
def adapter_seed(hf_seed, tmp_path_factory) -> Path:
    from safetensors.torch import save_file

    from dflash2.drafters.lora import adapter_state, add_lora
    from dflash2.drafters.pard import ADAPTER_FILE, PardConfig

    folder = tmp_path_factory.mktemp("adapter")
    model = load_transformer(hf_seed, "fp32", packed=False)
    add_lora(model, rank=4, alpha=8.0)
    save_file(adapter_state(model, torch.randn(model.config.hidden_size)), str(folder / ADAPTER_FILE))
    PardConfig(base_model=str(hf_seed), mask_token_id=250, num_draft_tokens=4, lora_rank=4, lora_alpha=8.0
               ).save(folder)
    return folder


def _fuzz_file_in_dir(seed_dir: Path, file: str, load_dir, tmp_path: Path, count: int, seed: int) -> None:
    data = (seed_dir / file).read_bytes()
    all_cases = cases(SAFETENSORS_KINDS, count, seed, lambda kind, rng: safetensors_case(data, kind, rng))
    failures = []
    for i, case in enumerate(all_cases):
        out = _damaged_dir(seed_dir, tmp_path / f"case{i}", file, case.data)
        failure = outcome(case, lambda: load_dir(out), (ModelFileError,))
        if failure:
            failures.append(f"#{i} {failure}")
        shutil.rmtree(out)
    _report(failures, len(all_cases))


def _load_drafter(directory: Path) -> None:
    from dflash2.drafters.dflash import DFlashDraftModel

    DFlashDraftModel.from_pretrained(directory)


def _pard_loader(base: Path):
    def load(directory: Path) -> None:
        from dflash2.drafters.pard import load_pard_model

        forward_once(load_pard_model(directory, base, "fp32")[0])
    return load


def test_damaged_drafter_checkpoints(drafter_seed, tmp_path):
    _load_drafter(drafter_seed)
    _fuzz_file_in_dir(drafter_seed, "model.safetensors", _load_drafter, tmp_path, 36 * DEFAULT, seed=4)


def test_damaged_pard_adapters(adapter_seed, hf_seed, tmp_path):
    _pard_loader(hf_seed)(adapter_seed)
    _fuzz_file_in_dir(adapter_seed, "adapter.safetensors", _pard_loader(hf_seed), tmp_path, 36 * DEFAULT, seed=5)


@pytest.mark.slow
def test_damaged_drafters_and_adapters_many(drafter_seed, adapter_seed, hf_seed, tmp_path):
    _fuzz_file_in_dir(drafter_seed, "model.safetensors", _load_drafter, tmp_path / "d", 36 * SLOW, seed=14)
    _fuzz_file_in_dir(adapter_seed, "adapter.safetensors", _pard_loader(hf_seed), tmp_path / "a", 36 * SLOW, seed=15)


# ------------------------------------------------------------------------------------------- command line


def run_cli(model: Path, home: Path, *extra: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, DFLASH2_HOME=str(home), PYTHONPATH=str(ROOT / "src"))
    command = [sys.executable, "-m", "dflash2.cli", "generate", "hi", "--model", str(model), "--drafter", "none",
               "--max-new-tokens", "2", "--dtype", "fp32", *extra]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)


def assert_one_line_error(result: subprocess.CompletedProcess, model: Path) -> None:
    lines = [line for line in result.stderr.splitlines() if line.strip() and "%|" not in line]
    assert result.returncode not in (0, None), result.stdout[-500:]
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("dflash2: error: ") and str(model) in lines[0], result.stderr


def test_the_command_line_reports_a_damaged_gguf_in_one_line(gguf_seeds, tmp_path):
    data, fields = gguf_seeds["llama"].read_bytes(), map_gguf(gguf_seeds["llama"])
    for i, kind in enumerate(("truncate", "block-type", "hyperparameter")):
        case = gguf_case(data, fields, kind, random.Random(40 + i))
        path = tmp_path / f"{kind}.gguf"
        path.write_bytes(case.data)
        assert_one_line_error(run_cli(path, tmp_path / "home"), path)


# ------------------------------------------------------------------------------------------------ SmolLM2


@pytest.fixture(scope="module")
def smollm2_gguf() -> Path:
    from dflash2.models import store

    return store.assemble("smollm2", progress=False)


def _read_smollm2(path: Path):
    """What the converter does before dequantizing (the validator, gguf-py's reader, the model description and the
    tensor plan); after the validator every tensor's bytes are its own, so dequantizing them is sound."""
    def load():
        from gguf import GGUFReader

        from dflash2.models.gguf_convert import _tensor_plan, read_gguf_info
        from dflash2.models.validate_gguf import validate_gguf

        validate_gguf(path)
        reader = GGUFReader(str(path))
        _tensor_plan(reader, read_gguf_info(reader))
    return load


@pytest.mark.model
@pytest.mark.slow
def test_damaged_smollm2_gguf(smollm2_gguf, tmp_path):
    data, fields = smollm2_gguf.read_bytes(), map_gguf(smollm2_gguf)
    all_cases = cases(GGUF_KINDS, 400, 21, lambda kind, rng: gguf_case(data, fields, kind, rng))
    failures = []
    path = tmp_path / "case.gguf"
    for i, case in enumerate(all_cases):
        path.write_bytes(case.data)
        failure = outcome(case, _read_smollm2(path), (ModelFileError, GGUFConvertError))
        if failure:
            failures.append(f"#{i} {failure}")
    _report(failures, len(all_cases))


@pytest.mark.model
def test_the_command_line_on_damaged_smollm2(smollm2_gguf, tmp_path):
    """The damage of issue 58 (commit 3397adc): a block type that no longer fits its bytes generated with exit 0, a
    hidden size not divisible by the heads ended in a 49-line traceback, cut files in numpy's reshape errors."""
    data, fields = smollm2_gguf.read_bytes(), map_gguf(smollm2_gguf)
    hidden = fields.kv["llama.embedding_length"][3]
    name = "blk.0.ffn_norm.weight"  # F32 -> Q4_0
    damaged = {"block-type": put(data, fields.tensors[name][4], "<I", 2),
               "hidden": put(data, hidden, "<I", 577),
               "truncated": data[: len(data) // 2], "cut-header": data[:5000]}
    for label, content in damaged.items():
        path = tmp_path / f"{label}.gguf"
        path.write_bytes(content)
        assert_one_line_error(run_cli(path, tmp_path / "home", "--weights", "bf16"), path)
