"""Shared fixtures: tiny random Llama / Qwen2 models saved in HF layout (transformers is the oracle)."""

from __future__ import annotations

import pytest
import torch


def make_hf_model(kind: str, seed: int = 0, vocab_size: int = 256, num_layers: int = 3, max_positions: int = 512):
    """A tiny random transformers model (fp32): ``kind`` is "qwen2" (biases, untied head) or "llama" (tied)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions)
    if kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(rope_theta=10000.0, tie_word_embeddings=False, **common))
        for name, param in model.named_parameters():  # random biases so that their handling is tested
            if name.endswith("bias"):
                param.data.normal_(0, 0.5)
    else:
        model = LlamaForCausalLM(LlamaConfig(rope_theta=50000.0, tie_word_embeddings=True, **common))
    for param in model.parameters():  # sharper logits than the default init: fewer near-ties in argmax
        param.data.mul_(2.0) if param.dim() == 2 else None
    return model.float().eval()


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, str]:
    """HF-layout directories of tiny random models: {"qwen2": dir, "llama": dir, "qwen2_other": dir}."""
    dirs = {}
    for key, kind, seed in (("qwen2", "qwen2", 0), ("llama", "llama", 1), ("qwen2_other", "qwen2", 2)):
        path = tmp_path_factory.mktemp(key)
        make_hf_model(kind, seed).save_pretrained(str(path))
        dirs[key] = str(path)
    return dirs


@pytest.fixture(autouse=True, scope="module")
def one_thread_for_tiny_models(request):
    """Unit and statistical tests run tiny models: on a 2-core machine thread hand-offs would cost more than the
    math. End-to-end tests on real weights keep every core."""
    if "e2e" in request.node.path.parts:
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def settings_from_this_tests_environment():
    """The package parses its DFLASH2_* variables once per process (dflash2.platform.settings); a test that
    changes one calls reload_settings, and after every test (its monkeypatch undone first: this fixture is set up
    before it) they are parsed again, so that no test's switches reach the next."""
    from dflash2.platform import reload_settings

    reload_settings()
    yield
    reload_settings()


class PeakMemoryReport:
    """DFLASH2_TEST_MEMORY=1 (or =path.json): the peak resident memory of the test process and its children (the
    servers tests start) during each test, sampled every 0.2 s; the largest are printed at the end (and all are
    written to the path). `make test` keeps the whole run's peak under ~12 GB (CI and laptops must not swap)."""

    def __init__(self, out_path: str | None):
        import threading

        import psutil

        self.out_path = out_path
        self.process = psutil.Process()
        self.peaks: dict[str, float] = {}
        self.current_peak = 0
        self.stop = threading.Event()
        threading.Thread(target=self.sample, daemon=True, name="peak-memory").start()

    def tree_rss(self) -> int:
        total = 0
        for process in [self.process, *self.process.children(recursive=True)]:
            try:
                total += process.memory_info().rss
            except Exception:  # a child that ended between the listing and the read
                pass
        return total

    def sample(self) -> None:
        while not self.stop.wait(0.2):
            self.current_peak = max(self.current_peak, self.tree_rss())

    def pytest_runtest_logstart(self, nodeid, location):
        self.current_peak = self.tree_rss()

    def pytest_runtest_logfinish(self, nodeid, location):
        self.peaks[nodeid] = max(self.current_peak, self.tree_rss()) / 2**30

    def pytest_terminal_summary(self, terminalreporter):
        self.stop.set()
        if not self.peaks:
            return
        terminalreporter.write_sep("=", "peak resident memory by test (GiB, process tree)")
        for nodeid, gib in sorted(self.peaks.items(), key=lambda item: -item[1])[:15]:
            terminalreporter.write_line(f"{gib:6.2f}  {nodeid}")
        if self.out_path:
            import json

            with open(self.out_path, "w") as out:
                json.dump(self.peaks, out, indent=1)


def pytest_configure(config):
    import os

    setting = os.environ.get("DFLASH2_TEST_MEMORY", "")
    if setting and setting != "0":
        config.pluginmanager.register(PeakMemoryReport(None if setting == "1" else setting), "dflash2-peak-memory")


# Tests that decode with the fp32 Qwen2.5-Coder-1.5B engine (tests/e2e/conftest.lean_engine keeps one Qwen-sized
# engine at a time): run back to back, so the 6 GB fp32 engine loads once instead of once per file (other files load
# the bf16 one in between). The oracle comes first: it frees the cache for transformers' copy, then loads ours.
FP32_QWEN_TESTS = (
    "tests/e2e/test_oracle.py::test_logits_and_greedy_tokens_match_transformers[qwen-1.5b]",
    "tests/e2e/test_dflash_real.py::test_shipped_qwen_drafter_is_lossless_and_accepted",
    "tests/e2e/test_speculative_real.py::test_qwen_pair_is_lossless_with_the_small_model_and_ngram_drafters",
)


def pytest_collection_modifyitems(config, items):
    """Group the fp32 Qwen tests (FP32_QWEN_TESTS, in that order) where the first of them was collected."""
    def rank(item) -> int | None:
        return next((i for i, prefix in enumerate(FP32_QWEN_TESTS) if item.nodeid.startswith(prefix)), None)

    group = sorted((item for item in items if rank(item) is not None), key=rank)  # stable within a prefix
    if len(group) < 2:
        return
    first = next(i for i, item in enumerate(items) if rank(item) is not None)
    rest = [item for item in items if rank(item) is None]
    items[:] = rest[:first] + group + rest[first:]
