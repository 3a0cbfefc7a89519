"""llama.cpp's own DFlash runs a dflash2 drafter: exported by `dflash2 train export --engine llama.cpp`, converted by
llama.cpp's own convert_hf_to_gguf.py, run by llama-speculative-simple --spec-type draft-dflash with the
Qwen2.5-Coder target's GGUF. Greedy output must equal llama.cpp's plain greedy output. Skipped where
scripts/build_llama_cpp.sh has not run (the build takes 15-40 minutes on 2 cores).

The draft reads the target's layer inputs; the build script patches llama.cpp's qwen2 graph to register them
(scripts/patches/llama.cpp-qwen2-layer-inputs.patch). A build without that patch fails here with the peer's
one-line reason.

llama.cpp's own decoding is not batch-invariant: evaluating the same tokens B rows per llama_decode gives logits up to
0.9 away from one row at a time (Q4_K_M target, this build), so any of its speculative modes can leave its plain
output where the top two logits are that close. On this prompt batched rows flip the argmax at token 35 (margin
0.13; with 2 or 4 rows, depending on where the batches fall) and 59 (margin 0.004): llama.cpp's DFlash keeps 35 and
leaves the plain output at 59, so 48 tokens are compared (docs/serving-elsewhere.md has the measurement)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.qwen, pytest.mark.slow]

TARGET = "qwen2.5-coder-1.5b-instruct"
PROMPT = "Write a Python function that returns the n-th Fibonacci number."


@pytest.fixture(scope="module")
def setup():
    from dflash2.peers.llamacpp import SPECULATIVE_TOOL, llama_cpp_bin_dir, llama_cpp_source_dir

    if not (llama_cpp_bin_dir() / SPECULATIVE_TOOL).is_file():
        pytest.skip("llama.cpp is not built here (scripts/build_llama_cpp.sh)")
    llama_cpp_source_dir()  # its converter must be there too
    from dflash2.models.store import gguf_path, resolve_model
    from dflash2.models.tokenizer import Tokenizer
    from dflash2.peers import PeerSetup

    target_dir = resolve_model(TARGET, "bf16")
    eos = frozenset(Tokenizer(target_dir).eos_token_ids)
    return PeerSetup(target_dir=target_dir, target_gguf=gguf_path(TARGET), draft_dir=None, draft_gguf=None,
                     dtype="bf16", threads=torch.get_num_threads(), eos_ids=eos, n_ctx=1024)


def engine_layout_drafter(directory):
    """The shipped DFlash drafter re-laid out as llama.cpp builds DFlash layers (q/k norms at 1, no biases, the
    target's whole head): untrained in that layout, which is all a loader test needs (verification keeps the
    output the target's whatever the drafts)."""
    from dflash2.drafters import shipped_dflash_drafter
    from dflash2.drafters.dflash_config import DFlashConfig
    from dflash2.drafters.dflash_model import DFlashDraftModel
    from dflash2.train.dflash_trainer import init_from_drafter

    source = shipped_dflash_drafter(TARGET)
    config = DFlashDraftModel.from_pretrained(source, "bf16").config
    fields = {**config.__dict__, "qk_norm": True, "attention_bias": False, "draft_vocab_size": 0}
    model = DFlashDraftModel(DFlashConfig(**fields))
    init_from_drafter(model, str(source))
    return model.save_pretrained(directory)


def test_llama_cpp_dflash_runs_an_exported_drafter_with_plain_greedy_output(setup, tmp_path):
    from dataclasses import replace

    from dflash2.models.tokenizer import Tokenizer
    from dflash2.peers.llamacpp import LlamaCppDFlashPeer, LlamaCppPlainPeer

    setup = replace(setup, dflash_drafter=engine_layout_drafter(tmp_path / "drafter"))
    ids = Tokenizer(setup.target_dir).apply_chat_template([{"role": "user", "content": PROMPT}])
    plain = LlamaCppPlainPeer(setup)
    try:
        expected = plain.generate(ids, 48)
    finally:
        plain.close()
    dflash = LlamaCppDFlashPeer(setup, "llamacpp-dflash")
    try:
        got = dflash.generate(ids, 48)
    finally:
        dflash.close()
    assert len(expected.token_ids) == 48  # the comparison covers the whole length (no early EOS)
    assert got.drafted and got.drafted > 0  # llama.cpp drafted with the converted drafter
    assert got.token_ids == expected.token_ids
