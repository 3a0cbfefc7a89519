"""llama.cpp peers on the store's 4-bit GGUF files: plain greedy decoding through llama-cpp-python; speculative
decoding through llama.cpp's ``llama-speculative-simple`` tool (the Python API has none) with the small draft model
(``llamacpp-spec``), with llama.cpp's own DFlash and a dflash2 drafter exported and converted by llama.cpp's own
converter (``llamacpp-dflash``), and with its n-gram lookup (``llamacpp-ngram``). ``scripts/build_llama_cpp.sh``
builds the library and the tool from the sources vendored in the llama-cpp-python sdist into
``~/.cache/dflash2/llama.cpp/bin``.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import sys
import subprocess
import time
from pathlib import Path
from typing import Sequence

from dflash2.atomic import atomic_path
from dflash2.peers.base import PeerError, PeerResult, PeerSetup, cut_at_eos, require_draft

SPECULATIVE_TOOL = "llama-speculative-simple"
# llama.cpp's assertion when a draft needs the target's hidden states and the target's graph does not expose them
LAYER_INPUTS_MISSING = "layer input tensor is null"
TOOL_TRAILER = "\n\n\n\n"  # the tool prints two blank lines after the generated text and two after its statistics


def llama_cpp_bin_dir() -> Path:
    """``$DFLASH2_LLAMA_CPP_BIN``, else ``~/.cache/dflash2/llama.cpp/bin`` (shared library and tools)."""
    from dflash2 import platform

    profile = platform.settings()
    return profile.llama_cpp_bin or profile.home / "llama.cpp" / "bin"


def _import_llama_cpp():
    """llama_cpp, loading the library built by scripts/build_llama_cpp.sh when the package ships none."""
    library = llama_cpp_bin_dir() / "libllama.so"
    if "LLAMA_CPP_LIB_PATH" not in os.environ and library.is_file():
        os.environ["LLAMA_CPP_LIB_PATH"] = str(library.parent)
    try:
        import llama_cpp
    except (ImportError, OSError, RuntimeError) as error:
        raise PeerError(f"llama-cpp-python is not usable ({error}); `pip install -e .[peers]` and run "
                        "scripts/build_llama_cpp.sh") from error
    return llama_cpp


def _require_file(path: Path, what: str) -> Path:
    if not path.is_file():
        raise PeerError(f"{what} {path} not found (`dflash2 models pull` assembles the GGUF files)")
    return path


class LlamaCppPlainPeer:
    """Greedy decoding one token per ``llama_decode`` through llama-cpp-python."""

    plain_sibling = None

    def __init__(self, setup: PeerSetup, name: str = "llamacpp") -> None:
        llama_cpp = _import_llama_cpp()
        self.name = name
        self.eos_ids = setup.eos_ids
        self.llm = llama_cpp.Llama(model_path=str(_require_file(setup.target_gguf, "target GGUF")),
                                   n_ctx=setup.n_ctx, n_batch=setup.n_ctx, n_threads=setup.threads,
                                   n_threads_batch=setup.threads, n_gpu_layers=0, verbose=False, seed=0)

    def _next_token(self) -> int:
        return self.llm.sample(temp=0.0, repeat_penalty=1.0)

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int) -> PeerResult:
        self.llm.reset()
        start = time.perf_counter()
        self.llm.eval(list(prompt_ids))
        token = self._next_token()
        prefill = time.perf_counter() - start
        ids, forwards = [token], 1
        start = time.perf_counter()
        while len(ids) < max_new_tokens and token not in self.eos_ids:
            self.llm.eval([token])
            forwards += 1
            token = self._next_token()
            ids.append(token)
        decode = time.perf_counter() - start
        new_ids, finish = cut_at_eos(ids, self.eos_ids)
        return PeerResult(new_ids, len(prompt_ids), prefill, decode, target_forwards=forwards, finish_reason=finish)

    def close(self) -> None:
        self.llm.close()


# its log lines may carry a "1.01.995.129 I " time prefix
_STAT = re.compile(r"\b(encoded|decoded)\s+(\d+) tokens in\s+([\d.]+) seconds")
_COUNT = re.compile(r"\b(n_draft|n_predict|n_drafted|n_accept)\s*=\s*(\d+)")


class LlamaCppSpeculativePeer:
    """``llama-speculative-simple`` with the small model drafting, greedy (``--temp 0``), one process per prompt.

    Its own timers give prefill ("encoded") and decode time (model loading is excluded); the generated text is
    re-tokenized with the target's tokenizer to compare with the other methods' token ids.
    """

    plain_sibling = "llamacpp"
    spec_type = "draft-simple"

    def __init__(self, setup: PeerSetup, name: str = "llamacpp-spec") -> None:
        from transformers import AutoTokenizer

        self.name = name
        self.setup = setup
        self.tool = llama_cpp_bin_dir() / SPECULATIVE_TOOL
        if not self.tool.is_file():
            found = shutil.which(SPECULATIVE_TOOL)
            if found is None:
                raise PeerError(f"{SPECULATIVE_TOOL} not found in {self.tool.parent} or on PATH; run "
                                "scripts/build_llama_cpp.sh")
            self.tool = Path(found)
        _require_file(setup.target_gguf, "target GGUF")
        self.draft_gguf = self.find_draft_gguf(setup, name)
        self.tokenizer = AutoTokenizer.from_pretrained(str(setup.target_dir))

    def find_draft_gguf(self, setup: PeerSetup, name: str) -> Path | None:
        return _require_file(require_draft(setup, name)[1], "draft GGUF")

    def command(self, prompt_text: str, max_new_tokens: int) -> list[str]:
        """The prompt goes in as an argument: ``-f`` would drop its final newline (the chat template's)."""
        s = self.setup
        draft = ["-md", str(self.draft_gguf)] if self.draft_gguf is not None else []
        cmd = [str(self.tool), "-m", str(s.target_gguf), *draft, "--spec-type", self.spec_type, "-p", prompt_text,
               "-n", str(max_new_tokens), "--temp", "0", "--top-k", "1", "-s", "0", "-c", str(s.n_ctx),
               "-b", str(s.n_ctx), "-ub", "512", "-t", str(s.threads), "-tb", str(s.threads)]
        if s.num_draft_tokens is not None:
            cmd += ["--spec-draft-n-max", str(s.num_draft_tokens)]
        return cmd

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int) -> PeerResult:
        prompt_text = self.tokenizer.decode(list(prompt_ids), skip_special_tokens=False)
        env = dict(os.environ, LD_LIBRARY_PATH=str(self.tool.parent))
        done = subprocess.run(self.command(prompt_text, max_new_tokens), capture_output=True, text=True, env=env,
                              errors="replace")
        if done.returncode != 0:
            if LAYER_INPUTS_MISSING in done.stderr:
                raise PeerError(f"{SPECULATIVE_TOOL} cannot run {self.spec_type} on this target: llama.cpp's graph for "
                                "its architecture exposes no layer inputs to tap (llama.cpp 0c1e570 registers them "
                                "for llama, qwen3 and newer families; scripts/build_llama_cpp.sh patches qwen2's: "
                                "rerun it)")
            raise PeerError(f"{SPECULATIVE_TOOL} failed ({done.returncode}): {done.stderr.strip()[-800:]}")
        return self._parse(done.stdout, done.stderr, prompt_text, len(prompt_ids), max_new_tokens)

    def _parse(self, stdout: str, stderr: str, prompt_text: str, prompt_tokens: int, max_new: int) -> PeerResult:
        stats = {kind: (int(n), float(s)) for kind, n, s in _STAT.findall(stderr)}
        counts = {key: int(value) for key, value in _COUNT.findall(stderr)}
        if "encoded" not in stats or "decoded" not in stats or "n_accept" not in counts:
            raise PeerError(f"cannot read {SPECULATIVE_TOOL}'s statistics from: {stderr.strip()[-800:]}")
        start = stdout.find(prompt_text)
        if start < 0:
            raise PeerError(f"{SPECULATIVE_TOOL} did not echo the prompt; cannot locate its output")
        generated = stdout[start + len(prompt_text):]
        if not generated.endswith(TOOL_TRAILER):
            raise PeerError(f"{SPECULATIVE_TOOL}'s output does not end as expected: {generated[-80:]!r}")
        ids, finish = cut_at_eos(self.tokenizer.encode(generated[: -len(TOOL_TRAILER)], add_special_tokens=False),
                                 self.setup.eos_ids)
        if counts.get("n_predict", 0) < max_new and finish == "length":
            finish = "eos"  # the tool stops at EOS without printing it
        n_predict, n_accept = counts["n_predict"], counts["n_accept"]
        return PeerResult(ids[:max_new], prompt_tokens, stats["encoded"][1], stats["decoded"][1],
                          target_forwards=max(n_predict - n_accept, 1), finish_reason=finish,
                          drafted=counts.get("n_drafted"), accepted=n_accept,
                          extra={"n_predict": n_predict, "n_draft": counts.get("n_draft")})

    def close(self) -> None:
        self.tokenizer = None


class LlamaCppDFlashPeer(LlamaCppSpeculativePeer):
    """llama.cpp's own DFlash (``--spec-type draft-dflash``) with a dflash2 DFlash drafter, exported by
    ``dflash2 train export --engine llama.cpp`` and converted by llama.cpp's own ``convert_hf_to_gguf.py``."""

    spec_type = "draft-dflash"

    def find_draft_gguf(self, setup: PeerSetup, name: str) -> Path:
        if setup.dflash_drafter is None:
            raise PeerError(f"peer {name} needs a DFlash drafter in llama.cpp's layout (q/k norms, no draft "
                            "vocabulary): pass --peer-dflash-drafter DIR")
        return converted_dflash_gguf(setup.dflash_drafter, setup.target_dir)


class LlamaCppNgramPeer(LlamaCppSpeculativePeer):
    """llama.cpp's n-gram lookup over the context (``--spec-type ngram-simple``): no draft model."""

    spec_type = "ngram-simple"

    def find_draft_gguf(self, setup: PeerSetup, name: str) -> None:
        return None


def _llama_cpp_work_dir() -> Path:
    """Where scripts/build_llama_cpp.sh works: the folder holding ``bin`` (a link to ``build/bin``)."""
    return llama_cpp_bin_dir().parent


def llama_cpp_source_dir() -> Path:
    """The llama.cpp sources scripts/build_llama_cpp.sh unpacked (its converter and gguf-py live there)."""
    root = _llama_cpp_work_dir()
    found = sorted(root.glob("llama_cpp_python-*/vendor/llama.cpp/convert_hf_to_gguf.py"))
    if not found:
        raise PeerError(f"llama.cpp's sources (convert_hf_to_gguf.py) not found under {root}; run "
                        "scripts/build_llama_cpp.sh")
    return found[-1].parent


def converted_dflash_gguf(drafter: Path, target_dir: Path) -> Path:
    """``drafter`` exported for llama.cpp and converted by its converter, cached by the drafter's bytes."""
    from dflash2.train.export import export_drafter

    digest = hashlib.sha256()
    for name in ("config.json", "model.safetensors"):
        digest.update((Path(drafter) / name).read_bytes())
    out = _llama_cpp_work_dir() / "drafters" / f"dflash-{digest.hexdigest()[:16]}.gguf"
    if out.is_file():
        return out
    source = llama_cpp_source_dir()
    out.parent.mkdir(parents=True, exist_ok=True)
    exported = out.with_suffix(".hf")
    export_drafter(drafter, "llama.cpp", exported, target=str(target_dir), dtype="bf16")
    env = dict(os.environ, PYTHONPATH=str(source / "gguf-py"))
    with atomic_path(out) as partial:
        done = subprocess.run([sys.executable, str(source / "convert_hf_to_gguf.py"), str(exported),
                               "--target-model-dir", str(target_dir), "--outtype", "bf16", "--outfile", str(partial)],
                              capture_output=True, text=True, env=env, errors="replace")
        if done.returncode != 0:
            raise PeerError(f"llama.cpp's converter refused the exported drafter: {done.stderr.strip()[-800:]}")
    shutil.rmtree(exported, ignore_errors=True)
    return out
