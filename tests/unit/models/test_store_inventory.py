"""``dflash2 models list | show | rm`` on a temporary store: a fake registry model (chunk wheels built locally) and a
conversion of a .gguf file given by path."""

from __future__ import annotations

import hashlib
import json

import pytest

from dflash2.cli import main
from dflash2.models import inventory, store
from dflash2.models.store import ModelStoreError
from tests.unit.models.test_store import FAKE_NAME, _helpers, fake_model, home, tiny_gguf  # noqa: F401 (fixtures)


@pytest.fixture
def stocked(fake_model, home, tmp_path):  # noqa: F811
    """The store holding the fake registry model in fp32 and bf16, and one user .gguf converted to fp32."""
    store.pull(FAKE_NAME, dtypes=("fp32", "bf16"), progress=False)
    user_gguf = _helpers.write_tiny_gguf(tmp_path / "mine.gguf", "llama")
    store.resolve_model(str(user_gguf), "fp32")
    key = "gguf-" + hashlib.sha256(user_gguf.read_bytes()).hexdigest()[:12]
    return user_gguf, key


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_list_shows_registry_models_and_converted_files_with_disk_use(stocked, home, capsys):
    user_gguf, key = stocked
    code, out, _ = run(capsys, "models", "list", "--json")
    assert code == 0
    listing = json.loads(out)
    rows = {row["name"]: row for row in listing["models"]}
    fake = rows[FAKE_NAME]
    expected = store._size_on_disk(home / "gguf" / f"{FAKE_NAME}.gguf") + store._size_on_disk(
        home / "models" / FAKE_NAME)
    assert fake["stored"] and fake["size_bytes"] == expected > 0
    assert fake["formats"] == ["gguf", "safetensors bf16", "safetensors fp32"]
    assert rows[key]["kind"] == "gguf file" and rows[key]["formats"] == ["safetensors fp32"]
    assert str(user_gguf.resolve()) in rows[key]["description"]
    assert not rows["smollm2-135m-instruct"]["stored"]  # the temporary store holds none of the real models
    assert listing["disk_bytes"]["models"] == store._size_on_disk(home / "models")

    code, out, _ = run(capsys, "models", "list")
    assert code == 0 and key in out and FAKE_NAME in out and "not pulled" in out and str(home) in out


def test_show_lists_files_sizes_formats_hashes_and_origin(stocked, home, tiny_gguf, capsys):  # noqa: F811
    code, out, _ = run(capsys, "models", "show", "tiny", "--json")
    assert code == 0
    shown = json.loads(out)
    assert shown["name"] == FAKE_NAME and shown["source"]["gguf_sha256"] == tiny_gguf[1]
    assert shown["source"]["packages"][0].startswith("dflash2-test-chunk-part1==")
    parts = {part["format"]: part for part in shown["parts"]}
    assert parts["gguf"]["files"][0]["sha256"] == tiny_gguf[1]
    files = {f["path"].rsplit("/", 1)[-1]: f for f in parts["safetensors fp32"]["files"]}
    weights = home / "models" / FAKE_NAME / "fp32" / "model.safetensors"
    assert files["model.safetensors"]["size"] == weights.stat().st_size
    assert files["model.safetensors"]["sha256"] == hashlib.sha256(weights.read_bytes()).hexdigest()

    user_gguf, key = stocked
    code, out, _ = run(capsys, "models", "show", str(user_gguf))  # a .gguf path finds its conversion
    assert code == 0 and out.startswith(f"{key} (gguf file)") and "model.safetensors" in out, out
    assert str(user_gguf.resolve()) in out


def test_rm_frees_what_it_says_and_leaves_the_others(stocked, home, capsys):
    user_gguf, key = stocked
    before = inventory.find(FAKE_NAME).size
    code, out, _ = run(capsys, "models", "rm", "tiny")
    assert code == 0 and f"removed {FAKE_NAME}" in out
    assert not (home / "gguf" / f"{FAKE_NAME}.gguf").exists() and not (home / "models" / FAKE_NAME).exists()
    from dflash2.cli import human_bytes

    assert human_bytes(before) in out
    assert inventory.find(key).parts  # the other model stays

    code, out, _ = run(capsys, "models", "rm", key)
    assert code == 0 and not (home / "models" / key).exists()
    assert user_gguf.exists()  # the user's own file is never touched

    code, _, err = run(capsys, "models", "rm", "tiny")
    assert code == 2 and "not stored" in err and len(err.strip().splitlines()) == 1


def test_unknown_name_names_what_is_stored(stocked, capsys):
    _, key = stocked
    with pytest.raises(ModelStoreError, match=key):
        inventory.find("gguf-000000000000")
    code, _, err = run(capsys, "models", "show", "no-such-model")
    assert code == 2 and "no-such-model" in err and len(err.strip().splitlines()) == 1
