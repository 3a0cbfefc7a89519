"""The linear layers of a decoder layer, shared by every family's attention and feed-forward: fused q/k/v and output,
fused gate/up and down. Their names (``wqkv``, ``wo``, ``w_gate_up``, ``w_down``) are what packing, quantizing and the
GGUF blocks replace (:func:`dflash2.models.state_dict.replace_layer_projections`), whatever the family computes
between them."""

from __future__ import annotations

from torch import nn

from dflash2.models.config import ModelConfig


class AttentionProjections(nn.Module):
    """An attention layer's fused q/k/v projection (``wqkv``) and output projection (``wo``), under the names that
    packing, quantizing and the GGUF blocks replace; each family's attention adds what it computes between them."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        q_width = config.num_heads * config.head_dim
        kv_width = config.num_kv_heads * config.head_dim
        self.split_sizes = (q_width, kv_width, kv_width)
        self.wqkv = nn.Linear(config.hidden_size, q_width + 2 * kv_width, bias=config.qkv_bias)
        self.wo = nn.Linear(q_width, config.hidden_size, bias=False)


class GatedProjections(nn.Module):
    """A gated feed-forward's fused gate/up projection (``w_gate_up``: [2I, D]) and down projection (``w_down``)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.w_gate_up = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.w_down = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
