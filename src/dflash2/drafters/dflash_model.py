"""The DFlash drafter network (attention over [context ; block], decoder layers, the model) and its checkpoint
format: a Hugging Face style directory with ``config.json`` and ``model.safetensors`` without embedding or head.
See :mod:`dflash2.drafters.dflash` for how drafting uses it."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from dflash2.drafters.dflash2_parts import DynamicConv, PathSelector
from dflash2.drafters.dflash_config import CONFIG_FILE, WEIGHTS_FILE, DFlashConfig
from dflash2.models.attention import attend
from dflash2.models.config import ModelConfig
from dflash2.models.validate import ModelFileError, check_safetensors
from dflash2.kernels.layer_ops import apply_rope
from dflash2.models.decoder import FeedForward, RMSNorm, Transformer, rope_inverse_frequencies, rope_tables

class DFlashAttention(nn.Module):
    """Block queries over [context K/V ; block K/V]. Parameter names match the decoder's attention."""

    def __init__(self, config: ModelConfig, qk_norm: bool = False) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_width = config.num_heads * config.head_dim
        self.kv_width = config.num_kv_heads * config.head_dim
        self.wqkv = nn.Linear(config.hidden_size, self.q_width + 2 * self.kv_width, bias=config.qkv_bias)
        self.wo = nn.Linear(self.q_width, config.hidden_size, bias=False)
        self.wkv_context: nn.Module | None = None  # set by DFlashDraftModel.pack(): the k/v rows of wqkv, packed
        # Qwen3-style per-head RMSNorm on q and k before rotation: the layer layout llama.cpp's, vLLM's and
        # SGLang's DFlash loaders build (docs/serving-elsewhere.md); None = the Llama / Qwen2 layout
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if qk_norm else None

    def _heads(self, x: torch.Tensor, num_heads: int) -> torch.Tensor:  # [B, T, H * Dh] -> [B, H, T, Dh]
        return x.view(x.shape[0], x.shape[1], num_heads, self.head_dim).transpose(1, 2)

    def context_kv(
        self,
        context: torch.Tensor,  # [B, S, D] projected context
        cos: torch.Tensor,  # [B, 1, S, Dh] at the context positions
        sin: torch.Tensor,  # [B, 1, S, Dh]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's keys/values of the context: ([B, H_kv, S, Dh], [B, H_kv, S, Dh]); q is not computed."""
        if self.wkv_context is not None:
            kv = self.wkv_context(context)
        else:
            bias = None if self.wqkv.bias is None else self.wqkv.bias[self.q_width :]
            kv = F.linear(context, self.wqkv.weight[self.q_width :], bias)
        k, v = kv.split(self.kv_width, dim=-1)
        k = self._norm_heads(self._heads(k, self.num_kv_heads), self.k_norm)
        return apply_rope(k, cos, sin), self._heads(v, self.num_kv_heads)

    @staticmethod
    def _norm_heads(x: torch.Tensor, norm: nn.Module | None) -> torch.Tensor:  # [B, H, T, Dh], normed over Dh
        return x if norm is None else norm(x)

    def forward(
        self,
        x: torch.Tensor,  # [B, T, D] block (normed)
        cos: torch.Tensor,  # [B, 1, T, Dh] at the block positions
        sin: torch.Tensor,  # [B, 1, T, Dh]
        context_k: torch.Tensor,  # [B, H_kv, S, Dh]
        context_v: torch.Tensor,  # [B, H_kv, S, Dh]
        attn_mask: torch.Tensor | None,  # [B or 1, 1, T, S + T] bool, True = may attend; None = all
    ) -> torch.Tensor:
        q, k, v = self.wqkv(x).split((self.q_width, self.kv_width, self.kv_width), dim=-1)
        q, k, v = self._heads(q, self.num_heads), self._heads(k, self.num_kv_heads), self._heads(v, self.num_kv_heads)
        q, k = self._norm_heads(q, self.q_norm), self._norm_heads(k, self.k_norm)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        keys = torch.cat([context_k.to(k.dtype), k], dim=2)  # [B, H_kv, S + T, Dh]
        values = torch.cat([context_v.to(v.dtype), v], dim=2)  # [B, H_kv, S + T, Dh]
        out = attend(q, keys, values, attn_mask)  # [B, H, T, Dh]
        return self.wo(out.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1))


class DFlashLayer(nn.Module):
    """An ordinary pre-norm decoder layer (RMSNorm, attention, SwiGLU) whose attention takes the context K/V."""

    def __init__(self, config: ModelConfig, conv_group: int = 0, block_size: int = 16, qk_norm: bool = False) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = DFlashAttention(config, qk_norm)
        self.ffn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.ffn = FeedForward(config)
        # DFlash2: a dynamic convolution on the normed input of each sublayer (None = plain DFlash)
        self.attn_conv = DynamicConv(config.hidden_size, conv_group, block_size) if conv_group else None
        self.ffn_conv = DynamicConv(config.hidden_size, conv_group, block_size) if conv_group else None

    def forward(self, x, cos, sin, context_k, context_v, attn_mask):  # x: [B, T, D] -> [B, T, D]
        h = self.attn_norm(x)
        h = self.attn_conv(h) if self.attn_conv is not None else h
        x = x + self.attn(h, cos, sin, context_k, context_v, attn_mask)
        h = self.ffn_norm(x)
        return x + self.ffn(self.ffn_conv(h) if self.ffn_conv is not None else h)


ContextKV = Sequence[tuple[torch.Tensor, torch.Tensor]]  # per drafter layer: ([B, H_kv, S, Dh], [B, H_kv, S, Dh])


def dense_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` with the weights of packed / quantized projections included as dense tensors.

    Packed (bf16 kernel) and quantized layers keep their weights outside the state dict; copying a target layer
    needs them as the ``nn.Linear`` names (``<name>.weight``, ``<name>.bias``).
    """
    state = dict(module.state_dict())
    for name, child in module.named_modules():
        dense = getattr(child, "unpacked_weight", None) or getattr(child, "dequantized_weight", None)
        if dense is None or isinstance(child, nn.Linear):
            continue
        state[f"{name}.weight"] = dense()
        if child.bias is not None:
            state[f"{name}.bias"] = child.bias
    return state


class DFlashDraftModel(nn.Module):
    """The drafter network. Holds no embedding or head: the target's are passed in (:meth:`embed`, :meth:`logits`)."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.config = config
        layer_config = config.layer_config()
        width = config.hidden_size
        self.layers = nn.ModuleList(DFlashLayer(layer_config, config.conv_group, config.block_size, config.qk_norm)
                                    for _ in range(config.num_layers))
        self.fc = nn.Linear(len(config.target_layer_ids) * width, width, bias=False)
        self.hidden_norm = RMSNorm(width, config.rms_norm_eps)  # on the projected context
        self.norm = RMSNorm(width, config.rms_norm_eps)  # before the target's head
        self.register_buffer("inv_freq", rope_inverse_frequencies(layer_config), persistent=False)
        # [V'] int64 ids the head scores (ascending by rank: most frequent first); None = the whole vocabulary.
        vocab = torch.arange(config.draft_vocab_size) if config.draft_vocab_size else None
        self.register_buffer("draft_vocab", vocab)
        self._sub_head: tuple[nn.Module, nn.Module] | None = None  # (the target head it came from, its rows)
        self.selector = None  # DFlash2's path selector over the draft vocabulary (None = plain DFlash)
        if config.selector_rank:
            rows = config.draft_vocab_size or config.vocab_size
            self.selector = PathSelector(rows, width, config.selector_rank, config.selector_top_k)

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, T] -> (cos, sin), each [B, 1, T, Dh] in the model dtype (as the target's: rope_tables)."""
        return rope_tables(positions, self.inv_freq, self.dtype)

    def project_context(self, taps: Sequence[torch.Tensor]) -> torch.Tensor:
        """Tapped target hidden states, one [B, S, D] per target_layer_ids entry -> the context [B, S, D]."""
        stacked = torch.cat([t.to(self.dtype) for t in taps], dim=-1)  # [B, S, n_taps * D]
        return self.hidden_norm(self.fc(stacked))

    def context_kv(self, context: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """context [B, S, D] at positions [B, S] -> each layer's rotated context (K, V), [B, H_kv, S, Dh] each."""
        cos, sin = self.rope(positions)
        return [layer.attn.context_kv(context, cos, sin) for layer in self.layers]

    def forward(
        self,
        block_embeds: torch.Tensor,  # [B, T, D] target embeddings of the block ids
        positions: torch.Tensor,  # [B, T] int64 block positions
        context_kv: ContextKV,  # per layer, the context K/V ([B, H_kv, S, Dh] each)
        attn_mask: torch.Tensor | None = None,  # [B or 1, T, S + T] bool over [context ; block]; None = all
    ) -> torch.Tensor:
        """The block's final hidden states [B, T, D], normed by the drafter's own RMSNorm."""
        cos, sin = self.rope(positions)
        mask = attn_mask[:, None] if attn_mask is not None else None  # [B, 1, T, S + T]
        x = block_embeds.to(self.dtype)
        for layer, (context_k, context_v) in zip(self.layers, context_kv, strict=True):
            x = layer(x, cos, sin, context_k, context_v, mask)
        return self.norm(x)

    @staticmethod
    def embed(target: Transformer, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, T] -> the target's (frozen) embeddings [B, T, D]."""
        return target.embed(ids.to(target.device))

    def logits(self, target: Transformer, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., D] -> float32 logits [..., V] through the target's (frozen) LM head.

        With a draft vocabulary only its V' rows are computed; every other id gets -inf (probability 0), so
        argmax, sampling and the q_draft handed to verification stay over the target's full vocabulary.
        """
        draft = self.draft_logits(target, hidden)  # [..., V']
        if self.draft_vocab is None:
            return draft
        full = draft.new_full((*draft.shape[:-1], self.config.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.draft_vocab.to(draft.device), draft)

    def draft_logits(self, target: Transformer, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., D] -> float32 logits [..., V'] over ``draft_vocab`` (all V ids without one).

        The input is cast to the head's weight dtype when the head is an ``nn.Linear`` (a trainer may hold an fp32
        copy of a bf16 target's head); a packed head takes any float dtype.
        """
        head = target.lm_head if self.draft_vocab is None else self._draft_head(target.lm_head)
        dtype = head.weight.dtype if isinstance(head, nn.Linear) else target.dtype
        return head(hidden.to(dtype)).float()

    def draft_labels(self, labels: torch.Tensor) -> torch.Tensor:
        """Target ids [...] -> their index in ``draft_vocab`` (-1 for ids outside it); identity without one."""
        if self.draft_vocab is None:
            return labels
        index = torch.full((self.config.vocab_size,), -1, dtype=torch.int64, device=self.draft_vocab.device)
        index[self.draft_vocab] = torch.arange(self.draft_vocab.numel(), device=index.device)
        return index[labels.to(index.device)]

    def selector_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Target ids [...] -> the selector's codebook rows (ids outside the draft vocabulary share one row)."""
        rows = self.draft_labels(ids)
        return torch.where(rows >= 0, rows, torch.full_like(rows, self.selector.outside))

    def _draft_head(self, head: nn.Module) -> nn.Module:
        """The rows ``draft_vocab`` of the target's head, as a frozen module of the same kind (built once)."""
        if self._sub_head is not None and self._sub_head[0] is head:
            return self._sub_head[1]
        rows = self.draft_vocab.to("cpu")
        if hasattr(head, "unpacked_weight"):  # a packed CPU head
            from dflash2.kernels import PackedLinear

            sub = PackedLinear.from_weight(head.unpacked_weight()[rows], backend=head.backend)
        elif hasattr(head, "select_rows"):  # the GGUF's own blocks: the rows' blocks as they are
            sub = head.select_rows(rows)
        elif hasattr(head, "dequantized_weight"):  # a quantized head: its rows re-quantize to the same values
            sub = type(head).from_weight(head.dequantized_weight()[rows], weights=head.weights)
        else:
            weight = head.weight.detach()[rows.to(head.weight.device)]
            sub = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
            sub.weight = nn.Parameter(weight.clone(), requires_grad=False)
        self._sub_head = (head, sub)
        return sub

    def set_draft_vocab(self, ids: torch.Tensor) -> None:
        """Use the ids [V'] (distinct, in vocabulary) as the draft vocabulary; V' must equal draft_vocab_size."""
        self.draft_vocab = check_draft_vocab(ids, self.config).to(self.device)
        self._sub_head = None

    def pack(self) -> "DFlashDraftModel":
        """Inference on a CPU: run the projections through dflash2's packed bf16 kernel (no autograd after this)."""
        from dflash2.kernels import PackedLinear
        from dflash2.models.loading import pack_layer_projections

        for layer in self.layers:
            attn = layer.attn
            bias = None if attn.wqkv.bias is None else attn.wqkv.bias[attn.q_width :]
            attn.wkv_context = PackedLinear.from_weight(attn.wqkv.weight[attn.q_width :], bias)
        pack_layer_projections(self.layers)
        self.fc = PackedLinear.from_linear(self.fc)
        return self

    # ---- warm start, save, load ----------------------------------------------------------------------------

    @torch.no_grad()
    def init_from_target(self, target: Transformer, layer_ids: Sequence[int] | None = None) -> None:
        """Copy target layers into the drafter layers (default: the target's last ``num_layers`` layers).

        ``fc`` starts as the mean of the taps. Requires matching layer shapes. Whether this helps is unmeasured.
        """
        count = len(self.layers)
        layer_ids = tuple(layer_ids) if layer_ids is not None else tuple(range(target.config.num_layers - count,
                                                                              target.config.num_layers))
        if len(layer_ids) != count:
            raise ValueError(f"need {count} target layer ids, got {layer_ids}")
        for layer, index in zip(self.layers, layer_ids):
            source = dense_state_dict(target.layers[index])
            own = {k: v for k, v in layer.state_dict().items() if "_conv." not in k}  # DFlash2 convs stay as built
            if source.keys() != own.keys() or any(source[k].shape != own[k].shape for k in own):
                raise ValueError(f"target layer {index} does not match the drafter's layer shape")
            layer.load_state_dict({k: v.to(self.dtype) for k, v in source.items()}, strict=False)
        width, taps = self.config.hidden_size, len(self.config.target_layer_ids)
        eye = torch.eye(width, dtype=self.dtype, device=self.device) / taps
        self.fc.weight.copy_(eye.repeat(1, taps))

    def save_pretrained(self, directory: str | Path) -> Path:
        """Write ``config.json`` + ``model.safetensors`` (HF names, no embedding or head), atomically."""
        directory = Path(directory)
        directory.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.tmp-", dir=directory.parent))
        try:
            tmp.chmod(0o755)
            tensors = {name: t.detach().to("cpu").contiguous() for name, t in to_hf_state_dict(self).items()}
            save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
            raw = self.config.to_hf_dict()
            raw["torch_dtype"] = str(self.dtype).removeprefix("torch.")
            (tmp / CONFIG_FILE).write_text(json.dumps(raw, indent=2) + "\n")
            replace_directory(tmp, directory)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return directory

    @classmethod
    def from_pretrained(
        cls, directory: str | Path, dtype: str | torch.dtype = "fp32", device: str | torch.device = "cpu"
    ) -> "DFlashDraftModel":
        from dflash2.models.loading import parse_dtype

        directory = Path(directory)
        try:
            config = DFlashConfig.from_hf_dict(json.loads((directory / CONFIG_FILE).read_text()))
            check_safetensors(directory / WEIGHTS_FILE)  # offsets and sizes against the file before it is mapped
            with safe_open(str(directory / WEIGHTS_FILE), framework="pt") as handle:
                hf = {name: handle.get_tensor(name) for name in handle.keys()}
            if "draft_vocab" in hf or config.draft_vocab_size:
                check_draft_vocab(hf.get("draft_vocab"), config)
            state = from_hf_state_dict(hf, config)
        except (OSError, ValueError, KeyError, RuntimeError) as error:
            raise ModelFileError(directory, f"is not a valid DFlash drafter: {error}") from error
        torch_dtype = parse_dtype(dtype)
        state = {k: v.to(device=device, dtype=torch_dtype if v.is_floating_point() else v.dtype)
                 for k, v in state.items()}
        with torch.device("meta"):
            model = cls(config)
        try:
            model.load_state_dict(state, assign=True)
        except RuntimeError as error:  # missing / unexpected weights, wrong shapes
            raise ModelFileError(directory, f"the weights do not match its config.json: {error}") from None
        model.inv_freq = rope_inverse_frequencies(config.layer_config()).to(device)
        return model.eval()


def check_draft_vocab(ids: torch.Tensor | None, config: DFlashConfig) -> torch.Tensor:
    """The draft vocabulary as int64 [V'], checked: V' == draft_vocab_size, distinct ids inside the target's
    vocabulary. A repeated id would give its token twice the draft probability and over-accept it at T > 0."""
    if ids is None:
        raise ValueError(f"draft_vocab_size is {config.draft_vocab_size} but no draft_vocab tensor is stored")
    if ids.is_floating_point() or ids.dim() != 1:
        raise ValueError(f"draft_vocab must be a 1-D integer tensor, got {ids.dtype} {tuple(ids.shape)}")
    ids = ids.to(torch.int64)
    if ids.numel() != config.draft_vocab_size:
        raise ValueError(f"draft_vocab has {ids.numel()} ids; the config says draft_vocab_size "
                         f"{config.draft_vocab_size}")
    if ids.unique().numel() != ids.numel():
        raise ValueError(f"draft_vocab must hold distinct ids; it repeats {ids.numel() - ids.unique().numel()}")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= config.vocab_size):
        raise ValueError(f"draft_vocab has ids outside the target's vocabulary [0, {config.vocab_size})")
    return ids


def replace_directory(source: Path, destination: Path) -> None:
    """Move the finished directory ``source`` to ``destination``, replacing what was there (atomic rename)."""
    if destination.exists():
        old = destination.with_name(f".{destination.name}.old-{os.getpid()}")
        os.replace(destination, old)
        os.replace(source, destination)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(source, destination)


_LAYER_NAMES = {  # this module's per-layer names -> DFlash / HF names (q/k/v and gate/up are split on save)
    "attn_norm.weight": "input_layernorm.weight",
    "attn.wo.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn.w_down.weight": "mlp.down_proj.weight",
}
_QK_NORM_NAMES = {"attn.q_norm.weight": "self_attn.q_norm.weight", "attn.k_norm.weight": "self_attn.k_norm.weight"}


def _layer_names(config: DFlashConfig) -> dict[str, str]:
    return {**_LAYER_NAMES, **_QK_NORM_NAMES} if config.qk_norm else _LAYER_NAMES


def _is_dflash2_weight(name: str) -> bool:
    """DFlash2's selector and convolution weights: stored under this module's own names."""
    return name.startswith("selector.") or ".attn_conv." in name or ".ffn_conv." in name


def to_hf_state_dict(model: DFlashDraftModel) -> dict[str, torch.Tensor]:
    """The drafter's weights under DFlash / HF names (``layers.i.self_attn.q_proj.weight``, ``fc.weight``, ...)."""
    config, state = model.config, model.state_dict()
    q_width, kv_width = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    out = {"fc.weight": state["fc.weight"], "hidden_norm.weight": state["hidden_norm.weight"],
           "norm.weight": state["norm.weight"]}
    if model.draft_vocab is not None:
        out["draft_vocab"] = state["draft_vocab"]  # [V'] int64 target ids the head scores
    out.update({name: tensor for name, tensor in state.items() if _is_dflash2_weight(name)})
    for i in range(config.num_layers):
        src, dst = f"layers.{i}.", f"layers.{i}."
        for ours, theirs in _layer_names(config).items():
            out[dst + theirs] = state[src + ours]
        for kind in ("weight", "bias") if config.attention_bias else ("weight",):
            q, k, v = state[src + f"attn.wqkv.{kind}"].split((q_width, kv_width, kv_width))
            out.update({dst + f"self_attn.q_proj.{kind}": q, dst + f"self_attn.k_proj.{kind}": k,
                        dst + f"self_attn.v_proj.{kind}": v})
        gate, up = state[src + "ffn.w_gate_up.weight"].chunk(2)
        out[dst + "mlp.gate_proj.weight"], out[dst + "mlp.up_proj.weight"] = gate, up
    return out


def from_hf_state_dict(hf: dict[str, torch.Tensor], config: DFlashConfig) -> dict[str, torch.Tensor]:
    """Inverse of :func:`to_hf_state_dict`; refuses checkpoints carrying weights this model does not have."""
    state = {"fc.weight": hf["fc.weight"], "hidden_norm.weight": hf["hidden_norm.weight"],
             "norm.weight": hf["norm.weight"]}
    if config.draft_vocab_size:
        if "draft_vocab" not in hf or hf["draft_vocab"].numel() != config.draft_vocab_size:
            raise ValueError(f"config.json says draft_vocab_size {config.draft_vocab_size}: the weights need "
                             "a draft_vocab tensor of that many ids")
        state["draft_vocab"] = hf["draft_vocab"].to(torch.int64)
    state.update({name: tensor for name, tensor in hf.items() if _is_dflash2_weight(name)})
    used = set(state)
    for i in range(config.num_layers):
        src = f"layers.{i}."
        for ours, theirs in _layer_names(config).items():
            state[src + ours] = hf[src + theirs]
            used.add(src + theirs)
        for kind in ("weight", "bias") if config.attention_bias else ("weight",):
            names = [src + f"self_attn.{p}_proj.{kind}" for p in "qkv"]
            state[src + f"attn.wqkv.{kind}"] = torch.cat([hf[n] for n in names])
            used.update(names)
        names = [src + "mlp.gate_proj.weight", src + "mlp.up_proj.weight"]
        state[src + "ffn.w_gate_up.weight"] = torch.cat([hf[n] for n in names])
        used.update(names)
    unknown = sorted(set(hf) - used)
    if unknown:
        raise ValueError(f"the checkpoint has weights a DFlash drafter does not use: {unknown[:5]}")
    return state
