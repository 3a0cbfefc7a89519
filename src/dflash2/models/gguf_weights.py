"""``--weights gguf``: the decoder's projections and head on the GGUF file's own quantized blocks.

The converted directory (``models/<name>/<dtype>/``, from the store) gives the configuration, the embedding and the
norms; its ``dflash2_source.json`` names the GGUF it was converted from, whose quantized tensors become
:class:`~dflash2.kernels.gguf_linear.GgufLinear` layers as they are (Q4_K, Q6_K, Q5_0, Q8_0, Q4_1, Q4_0: see
:mod:`dflash2.kernels.gguf_blocks`; any other type is a clear error) and whose fp32 q/k/v biases are used unrounded.
Fused projections (q/k/v, gate/up) keep one run of rows per block type.  Llama GGUFs' permuted q/k rows are put
back in Hugging Face order (rows are whole blocks, so this is exact).  The packed layers are cached in the store
(:mod:`dflash2.models.gguf_cache`).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from dflash2.kernels.gguf_blocks import BlockTensor, GGUFBlockError, concat_rows, decode_blocks, take_rows
from dflash2.kernels.gguf_packing import PackedBlocks, pack_blocks
from dflash2.models.config import ModelConfig
from dflash2.models.validate_gguf import validate_gguf

__all__ = ["gguf_file_of", "layer_sources", "load_gguf_transformer", "read_gguf_layers"]


def gguf_file_of(model_dir: Path) -> Path:
    """The GGUF file ``model_dir`` was converted from (the store's provenance file), or a clear error."""
    from dflash2.models.store import gguf_path

    source_file = model_dir / "dflash2_source.json"
    if not source_file.is_file():
        raise GGUFBlockError(f"--weights gguf needs a model converted from a GGUF (a store name or a .gguf path); "
                             f"{model_dir} has no dflash2_source.json")
    source = json.loads(source_file.read_text())
    path = Path(source["gguf_path"]) if source.get("gguf_path") else gguf_path(source.get("model", ""))
    if not path.is_file():
        raise GGUFBlockError(f"--weights gguf: the GGUF {path} that {model_dir} was converted from is missing "
                             "(`dflash2 models pull` assembles it)")
    return path


def layer_sources(config: ModelConfig) -> dict[str, list[str]]:
    """{lean layer name: its GGUF tensors (without ``.weight``), in row order}."""
    layers: dict[str, list[str]] = {}
    for i in range(config.num_layers):
        blk = f"blk.{i}."
        layers[f"layers.{i}.attn.wqkv"] = [blk + "attn_q", blk + "attn_k", blk + "attn_v"]
        layers[f"layers.{i}.attn.wo"] = [blk + "attn_output"]
        layers[f"layers.{i}.ffn.w_gate_up"] = [blk + "ffn_gate", blk + "ffn_up"]
        layers[f"layers.{i}.ffn.w_down"] = [blk + "ffn_down"]
    layers["lm_head"] = ["token_embd" if config.tie_word_embeddings else "output"]
    return layers


def _block_tensor(tensor, heads: int | None) -> BlockTensor:
    """One GGUF tensor as a BlockTensor; ``heads``: undo llama.cpp's q/k row permutation over that many heads."""
    from dflash2.models.gguf_convert import unpermute_rows

    k, n = (int(d) for d in tensor.shape)  # GGUF lists dims fastest-first: [K, N]
    blocks = decode_blocks(tensor.tensor_type.name, np.asarray(tensor.data), n, k)
    return blocks if heads is None else take_rows(blocks, unpermute_rows(np.arange(n), heads))


def _runs(parts: list[BlockTensor]) -> list[BlockTensor]:
    """Consecutive parts of the same kind concatenated (one kernel call each)."""
    runs: list[list[BlockTensor]] = []
    for part in parts:
        if runs and runs[-1][0].kind_key() == part.kind_key():
            runs[-1].append(part)
        else:
            runs.append([part])
    return [group[0] if len(group) == 1 else concat_rows(group) for group in runs]


def read_gguf_layers(gguf: Path, config: ModelConfig, architecture: str) -> dict[str, tuple[list[PackedBlocks],
                                                                                             torch.Tensor | None]]:
    """{lean layer name: (packed runs, fp32 bias or None)} read from ``gguf``."""
    from gguf import GGUFReader

    validate_gguf(gguf)  # the file may have changed since it was converted
    reader = GGUFReader(str(gguf))
    tensors = {t.name: t for t in reader.tensors}
    permuted = {"attn_q": config.num_heads, "attn_k": config.num_kv_heads} if architecture == "llama" else {}
    layers = {}
    for name, sources in layer_sources(config).items():
        parts = [_block_tensor(tensors[f"{src}.weight"], permuted.get(src.rsplit(".", 1)[-1])) for src in sources]
        biases = [tensors.get(f"{src}.bias") for src in sources]
        bias = None
        if any(b is not None for b in biases):
            if any(b is None for b in biases):
                raise GGUFBlockError(f"{name}: only some of {sources} carry a bias")
            bias = torch.from_numpy(np.concatenate([np.asarray(b.data, dtype=np.float32).reshape(-1)
                                                    for b in biases]))
        layers[name] = ([pack_blocks(run) for run in _runs(parts)], bias)
    return layers
