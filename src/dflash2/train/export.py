"""`dflash2 train export`: a trained drafter in the layout of the engine that serves it.

Two layouts leave the project, each checked against the loader that reads it (docs/serving-elsewhere.md names the
files and commits these rules come from):

- **PARD** (the pretrained 0.5B drafting k positions in one pass) -> a plain Hugging Face directory for vLLM's
  parallel drafting (``{"method": "draft_model", "parallel_drafting": true}``). vLLM finds the id it feeds at the
  mask positions in ``dflash_config.mask_token_id``, ``pard_token`` or ``ptd_token_id`` of config.json and raises
  without one; the export writes all three spellings. llama.cpp and SGLang have no parallel-drafting mode for a
  draft model: the export says so.
- **DFlash block drafters** -> the DFlash checkpoint layout (``DFlashDraftModel``: ``fc``, ``hidden_norm``,
  Qwen3-style layers, ``dflash_config`` with ``block_size``, ``target_layer_ids``, ``mask_token_id``) that
  llama.cpp's converter (``convert_hf_to_gguf.py --target-model-dir``) and vLLM's / SGLang's DFlash loaders read.
  Those engines build layers with q/k norms and no q/k/v biases, score the target's whole vocabulary with the
  target's head, and run their own DFlash2 formulation; a drafter outside that (a draft vocabulary, biases,
  dflash2's selector or convolution) is refused with what is missing and how to train one that fits
  (``dflash2 train dflash --qk-norm --draft-vocab 0``).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

ENGINES = ("llama.cpp", "vllm", "sglang")


class ExportError(ValueError):
    """The drafter cannot be expressed in the engine's layout; the message says what is missing."""


@dataclass(frozen=True)
class ExportResult:
    out_dir: Path
    kind: str  # "pard" or "dflash"
    engine: str
    how_to_serve: str  # the engine's command line, with placeholders for the target's files


def drafter_kind(directory: Path) -> str:
    """"pard" (pard_config.json: an adapter over a base network) or "dflash" (a DFlash config.json)."""
    from dflash2.drafters.pard import PARD_CONFIG

    if (directory / PARD_CONFIG).exists():
        return "pard"
    config = directory / "config.json"
    if config.exists() and "dflash_config" in json.loads(config.read_text()):
        return "dflash"
    raise ExportError(f"{directory}: neither a PARD adapter ({PARD_CONFIG}) nor a DFlash drafter (config.json with "
                      "dflash_config)")


def export_drafter(drafter: str | Path | None, engine: str, out_dir: str | Path, *, target: str, dtype: str = "bf16",
                   num_draft_tokens: int | None = None, base: str | None = None) -> ExportResult:
    """Write ``drafter`` (a trained drafter directory; None: the untrained PARD drafter over ``base``) for
    ``engine`` into ``out_dir``. ``base`` (PARD only) overrides the adapter's base network."""
    if engine not in ENGINES:
        raise ExportError(f"unknown engine {engine!r}: one of {', '.join(ENGINES)}")
    out_dir = Path(out_dir)
    if drafter is None or drafter_kind(Path(drafter)) == "pard":
        return _export_pard(None if drafter is None else Path(drafter), engine, out_dir, target, dtype,
                            num_draft_tokens, base)
    return _export_dflash(Path(drafter), engine, out_dir, target, dtype)


# ---- PARD -> vLLM parallel drafting ----------------------------------------------------------------------------

def _export_pard(adapter: Path | None, engine: str, out_dir: Path, target: str, dtype: str,
                 num_draft_tokens: int | None, base: str | None) -> ExportResult:
    from dflash2.drafters.pard import PardConfig
    from dflash2.models.store import DEFAULT_DRAFT, resolve_model
    from dflash2.train.pard_export import export_pard

    if engine != "vllm":
        raise ExportError(f"{engine} has no parallel-drafting mode for a draft model (it serves PARD drafters one "
                          "token per pass, which loses the parallel adaptation): export PARD for vllm, or a DFlash "
                          "drafter for llama.cpp")
    base = base or (PardConfig.load(adapter).base_model if adapter is not None else DEFAULT_DRAFT)
    export_pard(adapter, resolve_model(base, dtype), out_dir, dtype, num_draft_tokens=num_draft_tokens)
    k = json.loads((out_dir / "config.json").read_text())["block_size"]
    spec = json.dumps({"method": "draft_model", "model": str(out_dir), "num_speculative_tokens": k,
                       "parallel_drafting": True})
    return ExportResult(out_dir, "pard", engine, f"vllm serve <target> --speculative-config '{spec}'")


# ---- DFlash -> llama.cpp / vLLM / SGLang ------------------------------------------------------------------------

def dflash_layout_problems(config) -> list[str]:
    """What keeps a DFlash drafter (a :class:`DFlashConfig`) out of the layout other engines load; [] = none."""
    problems = []
    if not config.qk_norm:
        problems.append("its layers have no q/k norms (the engines' DFlash layers require attn_q_norm / attn_k_norm)")
    if config.attention_bias:
        problems.append("its q/k/v projections have biases (the engines' DFlash layers have none)")
    if config.draft_vocab_size:
        problems.append(f"it scores a {config.draft_vocab_size}-id draft vocabulary (llama.cpp's converter maps no "
                        "draft_vocab tensor; vLLM / SGLang take the target's full head)")
    if config.selector_rank or config.conv_group:
        problems.append("it has dflash2's path selector / dynamic convolution (the engines' DFlash2 is another "
                        "formulation: the convolution wraps the attention's input and output)")
    return problems


def _export_dflash(drafter: Path, engine: str, out_dir: Path, target: str, dtype: str) -> ExportResult:
    from dflash2.drafters.dflash_model import DFlashDraftModel, to_hf_state_dict
    from dflash2.models.loading import parse_dtype
    from safetensors.torch import save_file

    model = DFlashDraftModel.from_pretrained(drafter, dtype)
    problems = dflash_layout_problems(model.config)
    if problems:
        raise ExportError(f"{drafter} cannot be served by {engine}: " + "; ".join(problems) + ". Train a drafter "
                          "in that layout: dflash2 train dflash --qk-norm --draft-vocab 0 (no --selector-rank / "
                          "--conv-group)")
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().to(parse_dtype(dtype)).contiguous() for name, t in to_hf_state_dict(model).items()}
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = dflash_hf_config(model.config, dtype)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in ("README.md",):
        if (drafter / name).exists():
            shutil.copy2(drafter / name, out_dir / name)
    if engine == "llama.cpp":
        how = (f"python convert_hf_to_gguf.py {out_dir} --target-model-dir <target HF dir> --outfile drafter.gguf; "
               "llama-server -m <target.gguf> -md drafter.gguf --spec-type draft-dflash")
    else:
        spec = json.dumps({"method": "dflash", "model": str(out_dir),
                           "num_speculative_tokens": model.config.block_size - 1})
        how = (f"vllm serve <target> --speculative-config '{spec}'" if engine == "vllm" else
               f"python -m sglang.launch_server --model <target> --speculative-algorithm DFLASH "
               f"--speculative-draft-model-path {out_dir}")
    return ExportResult(out_dir, "dflash", engine, how)


def dflash_hf_config(config, dtype: str) -> dict:
    """config.json of the DFlash checkpoint layout (Qwen3-style layers; keys also top-level for older readers)."""
    raw = config.to_hf_dict()
    for key in ("draft_vocab_size", "selector_rank", "selector_top_k", "conv_group", "qk_norm"):
        raw.pop(key, None)
    raw.update({
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "attention_bias": False,
        "torch_dtype": {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[dtype],
        "max_position_embeddings": raw.get("max_position_embeddings", 32768),
    })
    return raw


__all__ = ["ENGINES", "ExportError", "ExportResult", "dflash_layout_problems", "drafter_kind", "export_drafter"]
