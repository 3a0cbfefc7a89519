"""llama.cpp's own DFlash runs a dflash2 drafter: exported by `dflash2 train export --engine llama.cpp`, converted by
llama.cpp's own convert_hf_to_gguf.py, run by llama-speculative-simple --spec-type draft-dflash with the
Qwen2.5-Coder target's GGUF. Greedy output must equal llama.cpp's plain greedy output. Skipped where
scripts/build_llama_cpp.sh has not run (the build takes 15-40 minutes on 2 cores).

llama.cpp 0c1e570 (the one the build script takes) loads the converted drafter and starts its DFlash, then stops:
its qwen2 graph exposes no layer inputs for the draft to read (it does for llama, qwen3 and newer families). The
test records that as an expected failure with the reason, and passes once a llama.cpp that taps qwen2 is built."""

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
    from dflash2.peers import PeerError
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
    except PeerError as error:
        if "exposes no layer inputs" in str(error):  # llama.cpp's limit, not the export's: the drafter loaded
            pytest.xfail(str(error))
        raise
    assert got.drafted and got.drafted > 0  # llama.cpp drafted with the converted drafter
    assert got.token_ids == expected.token_ids
