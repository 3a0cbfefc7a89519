"""The record of a passed kernel self-check: written after a pass, the check skipped while it is there, run again
when the build (its directory), the CPU or the check's module differs, or after a failure."""

from __future__ import annotations

import sys
import types

import pytest

from dflash2.kernels import jit

OP = "dflash2_layer_ops.rms_norm"


@pytest.fixture
def build(tmp_path, monkeypatch):
    if jit.kernels_disabled_reason():
        pytest.skip(jit.kernels_disabled_reason())
    from dflash2.kernels import layer_ops

    if not layer_ops.layer_ops_available():  # built in the store: linked, not compiled again, below
        pytest.skip("the layer-ops kernel is unavailable")
    tag = jit.source_tag(layer_ops._SOURCE, layer_ops._CFLAGS)
    built = jit.build_dir() / f"layer-ops-{tag}" / f"dflash2_layer_ops_{tag}.so"
    monkeypatch.setattr(jit, "build_dir", lambda: tmp_path / "kernels")
    directory = tmp_path / "kernels" / built.parent.name
    directory.mkdir(parents=True)
    # A link to the library this process has loaded: the loader sees the same file and registers its ops once (a
    # copy would register the namespace again and abort).
    (directory / built.name).symlink_to(built)
    return directory


def _load(check):
    from dflash2.kernels import layer_ops

    return jit.jit_load("layer-ops", "dflash2_layer_ops", layer_ops._SOURCE, layer_ops._CFLAGS, OP, check)


def _counting(result: str = ""):
    calls = []

    def check(op):
        calls.append(op)
        return result

    return check, calls


def test_written_after_a_pass_and_the_check_skipped_then(build):
    check, calls = _counting()
    ok, _, _ = _load(check)
    assert ok and len(calls) == 1
    assert jit.self_check_record(build, check).is_file()
    ok, status, op = _load(check)
    assert ok and len(calls) == 1 and op is not None
    assert "passed before" in status


def test_a_failed_check_writes_no_record_and_removes_one(build):
    check, calls = _counting("bad")
    record = jit.self_check_record(build, check)
    assert _load(check)[0] is False and not record.exists()
    assert _load(check)[0] is False and len(calls) == 2  # no record: checked again


def test_another_cpu_checks_again(build, monkeypatch):
    check, calls = _counting()
    _load(check)
    monkeypatch.setattr(jit, "cpu_key", lambda: "AuthenticAMD|26|2|another")
    _load(check)
    assert len(calls) == 2
    assert len(list(build.glob("self-check-passed-*"))) == 2


def test_another_build_or_check_module_checks_again(build, tmp_path):
    check, calls = _counting()
    _load(check)
    assert jit.self_check_record(build, check) != jit.self_check_record(tmp_path / "kernels" / "layer-ops-0", check)
    module = types.ModuleType("dflash2_test_other_check")
    source = tmp_path / "other_check.py"
    source.write_text("# another self-check\n")
    module.__file__ = str(source)
    sys.modules[module.__name__] = module
    try:
        check.__module__ = module.__name__
        assert jit.self_check_record(build, check) != jit.self_check_record(build, _counting()[0])
        _load(check)
        assert len(calls) == 2
        source.write_text("# the check changed\n")
        _load(check)
        assert len(calls) == 3
    finally:
        del sys.modules[module.__name__]


def test_an_amx_build_refused_its_tiles_runs_its_check(monkeypatch):
    refused = types.SimpleNamespace(amx_init=lambda: False)
    monkeypatch.setattr(jit.torch, "ops", types.SimpleNamespace(ns=refused))
    assert not jit._per_process_setup("ns", "amx")
    granted = types.SimpleNamespace(gguf_tiles=lambda: False)  # a gguf build without AMX: answers False by design
    monkeypatch.setattr(jit.torch, "ops", types.SimpleNamespace(ns=granted))
    assert jit._per_process_setup("ns", "gguf-avx512-vnni")
    assert not jit._per_process_setup("ns", "gguf-amx-int8")


def test_a_record_that_cannot_be_written_costs_only_the_check(tmp_path):
    """A store that cannot be written to (here the record's directory is a file): no error, no record, nothing left
    beside it; a writable one gets the record whole."""
    blocked = tmp_path / "not-a-directory"
    blocked.write_text("")
    jit._write_record(blocked / "self-check-passed-x")
    assert [p.name for p in tmp_path.iterdir()] == ["not-a-directory"]
    jit._write_record(tmp_path / "self-check-passed-y")
    assert (tmp_path / "self-check-passed-y").read_text().strip() and len(list(tmp_path.iterdir())) == 2
