"""Export a PARD drafter (base network + trained adapter) as a plain Hugging Face directory.

``transformers.AutoModelForCausalLM.from_pretrained(out)`` loads the result with no dflash2 code: the LoRA
adapters are merged into the projections (exactly the weights ``load_pard_model`` drafts with), the learned mask
embedding is written into row ``mask_token_id`` of the embedding table, and the q/k/v and gate/up projections are
split back into the Hugging Face tensors. ``config.json`` is the base's with a ``pard`` section (and the same keys
at its top level) naming what an engine serving parallel drafters needs:

- ``mask_token_id`` (also as ``pard_token`` and ``ptd_token_id``, the names vLLM's parallel drafting reads): the id
  fed at the mask positions (for Qwen2.5: 151935, an embedding row the tokenizer never
  produces, so it has no token string); its logit must be ignored (dflash2 sets it to -inf);
- ``block_size`` / ``num_draft_tokens``: k, the drafts of one forward: input ``[pending ids..., MASK x (k - 1)]``,
  drafts = the argmax (or samples) of the last k rows' logits;
- ``taps``: the target layers whose hidden states condition the drafter (``[]``: none, this drafter reads tokens
  only).

The tokenizer files of the base are copied unchanged.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from dflash2.drafters.pard import PARD_CONFIG, PardConfig, load_pard_model
from dflash2.models.config import ModelConfig
from dflash2.models.decoder import Transformer

EXPORT_WEIGHTS = "model.safetensors"
_NOT_COPIED = ("config.json", "model.safetensors.index.json")


def lean_to_hf_state_dict(model: Transformer) -> dict[str, torch.Tensor]:
    """The inverse of :func:`dflash2.models.state_dict.hf_to_lean_state_dict` for an unpacked, unquantized model:
    Hugging Face Llama / Qwen2 tensor names, q/k/v and gate/up split back; no ``lm_head`` for tied embeddings."""
    c: ModelConfig = model.config
    q_width, kv_width = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    state = {"model.embed_tokens.weight": model.embed.weight, "model.norm.weight": model.norm.weight}
    if not c.tie_word_embeddings:
        state["lm_head.weight"] = _weight(model.lm_head)
    for i, layer in enumerate(model.layers):
        dst = f"model.layers.{i}."
        state[dst + "input_layernorm.weight"] = layer.attn_norm.weight
        state[dst + "post_attention_layernorm.weight"] = layer.ffn_norm.weight
        qkv = _weight(layer.attn.wqkv)
        for name, part in zip("qkv", qkv.split([q_width, kv_width, kv_width])):
            state[dst + f"self_attn.{name}_proj.weight"] = part
        if c.qkv_bias:
            for name, part in zip("qkv", layer.attn.wqkv.bias.split([q_width, kv_width, kv_width])):
                state[dst + f"self_attn.{name}_proj.bias"] = part
        state[dst + "self_attn.o_proj.weight"] = _weight(layer.attn.wo)
        gate, up = _weight(layer.ffn.w_gate_up).split(c.intermediate_size)
        state[dst + "mlp.gate_proj.weight"] = gate
        state[dst + "mlp.up_proj.weight"] = up
        state[dst + "mlp.down_proj.weight"] = _weight(layer.ffn.w_down)
    return {name: tensor.detach().contiguous().clone() for name, tensor in state.items()}


def _weight(linear) -> torch.Tensor:
    if type(linear) is not torch.nn.Linear:
        raise TypeError(f"export needs plain linear layers (not packed or quantized), got {type(linear).__name__}")
    return linear.weight


def export_pard(adapter_dir: str | Path | None, base_dir: str | Path, out_dir: str | Path, dtype: str = "bf16",
                *, mask_token_id: int | None = None, num_draft_tokens: int | None = None) -> Path:
    """Write ``out_dir`` (config.json with the ``pard`` section, model.safetensors, tokenizer files).

    ``adapter_dir``: a trained adapter (``pard_config.json`` + ``adapter.safetensors``), or None for the untrained
    drafter (mask embedding = the mean embedding). ``base_dir``: the base network's Hugging Face directory."""
    from safetensors.torch import save_file

    base_dir, out_dir = Path(base_dir), Path(out_dir)
    model, config = load_pard_model(adapter_dir, base_dir, dtype, packed=False, mask_token_id=mask_token_id,
                                    draft_vocab=False)  # the full head: an engine may draft any id
    k = num_draft_tokens or config.num_draft_tokens
    out_dir.mkdir(parents=True, exist_ok=True)
    for path in base_dir.iterdir():  # tokenizer, chat template, generation config (not the weights)
        if path.is_file() and path.suffix != ".safetensors" and path.name not in _NOT_COPIED \
                and not path.name.startswith("dflash2_"):
            shutil.copy2(path, out_dir / path.name)
    save_file(lean_to_hf_state_dict(model), str(out_dir / EXPORT_WEIGHTS), metadata={"format": "pt"})
    pard = {"mask_token_id": config.mask_token_id, "block_size": k, "num_draft_tokens": k, "taps": [],
            "base_model": config.base_model, "target_model": config.target_model, "lora_rank": config.lora_rank,
            "lora_alpha": config.lora_alpha, "merged": True, "trained": adapter_dir is not None,
            "drafting": "input = the ids accepted since the last pass (the pending token last) + (block_size - 1) x "
                        "mask_token_id; draft j = row j of the last block_size rows; ignore mask_token_id's logit",
            "training": config.extra}
    hf_config = json.loads((base_dir / "config.json").read_text())
    hf_config["torch_dtype"] = hf_config["dtype"] = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[dtype]
    # vLLM's parallel drafting reads the mask id as ``pard_token`` or ``ptd_token_id`` (docs/serving-elsewhere.md)
    hf_config.update({"mask_token_id": config.mask_token_id, "pard_token": config.mask_token_id,
                      "ptd_token_id": config.mask_token_id, "block_size": k, "pard": pard})
    (out_dir / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    if adapter_dir is not None:  # what the export was made from (dflash2 can reload the adapter itself)
        shutil.copy2(Path(adapter_dir) / PARD_CONFIG, out_dir / PARD_CONFIG)
    return out_dir


def shipped_or_given_adapter(adapter: str | None, target: str) -> Path | None:
    """``adapter`` ("untrained" = None), or the adapter shipped for ``target`` when ``adapter`` is empty."""
    from dflash2.drafters.pard import SHIPPED_DIR
    from dflash2.models.store import canonical_name

    if adapter == "untrained":
        return None
    if adapter:
        return Path(adapter)
    shipped = SHIPPED_DIR / f"{canonical_name(target) or target}-pard"
    if not (shipped / PARD_CONFIG).exists():
        raise ValueError(f"no pard adapter is shipped for {target!r}: pass --adapter DIR (or --adapter untrained)")
    return shipped


__all__ = ["export_pard", "lean_to_hf_state_dict", "shipped_or_given_adapter", "PardConfig"]
