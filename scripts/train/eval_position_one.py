"""Where does the PARD adapter's first draft position stand against the store's 0.5B without it? Held-out
acceptance by position (the trainer's greedy check: one block of 8 per anchor, 16 anchors per sequence) of three
drafters built from one adapter:

- ``shipped``: the adapter as it drafts (LoRA on every row);
- ``base-first``: draft 1 from the base 0.5B reading the sequence itself, drafts 2+ from the adapter (the bound of
  "hold position 1 to the base": draft j > 1 of a PARD block does not depend on draft 1, so the two combine);
- ``masks-only``: the LoRA on the mask rows alone, the base weights for the context and the pending row (a drafter
  whose cache is the base model's; here with the adapter as trained, not retrained for that).

Needs the featurised held-out sets (``scripts/train/train_qwen_conditioned.sh features``, under runs/features/v1).
The mask-rows variant gates the adapter's update per row by patching ``LoRALinear.forward`` for this measurement.

    .venv/bin/python scripts/train/eval_position_one.py --variants shipped,base-first,masks-only
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from dflash2.drafters import lora
from dflash2.models.store import resolve_model
from dflash2.train import pard_objective as po
from dflash2.train.pard_export import shipped_or_given_adapter
from dflash2.train.pard_trainer import PardTrainConfig, TrainingData, build_model, _warm_start

ROW_GATE: dict[str, torch.Tensor | None] = {"gate": None}  # None: the adapter on every row
_adapter_forward = lora.LoRALinear.forward


def _gated_forward(self: lora.LoRALinear, x: torch.Tensor) -> torch.Tensor:
    gate = ROW_GATE["gate"]
    if gate is None:
        return _adapter_forward(self, x)
    update = (x.to(self.lora_a.dtype) @ self.lora_a.T) @ self.lora_b.T
    return self.base(x) + (self.scale * update * gate).to(x.dtype)


def masks_only_hidden(model, ids: torch.Tensor, batch: po.PardBatch) -> torch.Tensor:
    """:func:`pard_objective.block_hidden` with the adapter off for the context and the pending rows."""
    S = batch.context_length
    ROW_GATE["gate"] = torch.zeros(())
    cache = model.new_cache(max(S, 1))
    if S:
        model(ids[None, :S], cache=cache, logits="none")
    context = po.FrozenContext(cache.keys[:, :, :, :S], cache.values[:, :, :, :S])
    ROW_GATE["gate"] = (batch.depth > 0).float()[None, :, None]  # [1, Q, 1]
    attention = po.CachedAttention(context, batch.attn_mask[:, None])
    out = model(batch.input_ids[None], batch.positions[None], context=attention,
                hidden_layers=(model.config.num_layers - 1,), logits="none")
    ROW_GATE["gate"] = None
    return out.hidden_states[0][0]


def accepted_per_block(model, text, variant: str, k: int, anchors_per_sequence: int, mask_id: int):
    """[A] drafts accepted per block (as ``pard_objective.heldout_acceptance`` counts them), or None."""
    high = text.label_start + text.topk_ids.shape[0] - k
    if high < text.label_start:
        return None
    count = min(anchors_per_sequence, high - text.label_start + 1)
    anchors = torch.linspace(text.label_start, high, steps=count).round().long().unique()
    batch = po.build_pard_batch(text.label_start, text.ids, anchors, torch.full_like(anchors, k - 1), mask_id)
    hidden = masks_only_hidden(model, text.ids, batch) if variant == "masks-only" else po.block_hidden(
        model, text.ids, batch)
    logits = model.lm_head(model.norm(hidden)).float()
    logits[:, mask_id] = float("-inf")
    drafts = logits.argmax(-1).view(-1, k)  # [A, k]
    if variant == "base-first":
        ROW_GATE["gate"] = torch.zeros(())
        base = model(text.ids[None, : int(anchors.max()) + 1], logits="all").logits[0].float()
        ROW_GATE["gate"] = None
        base[:, mask_id] = float("-inf")
        drafts[:, 0] = base[anchors].argmax(-1)
    greedy = text.topk_ids[batch.label_rows, 0].view(-1, k)
    follows = text.ids[batch.positions + 1].view(-1, k) == greedy
    return ((drafts == greedy) & follows).long().cumprod(dim=1).sum(dim=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adapter", default="", help="adapter directory ('' = the shipped one)")
    parser.add_argument("--features", default="runs/features/v1")
    parser.add_argument("--variants", default="shipped,base-first,masks-only")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    lora.LoRALinear.forward = _gated_forward
    adapter = Path(shipped_or_given_adapter(args.adapter, "qwen2.5-coder-1.5b-instruct"))
    k, anchors = 8, 16
    config = PardTrainConfig(base_dir=str(resolve_model("qwen2.5-coder-0.5b-instruct", "bf16", pull=False)),
                             label_dirs="", out_dir="/nonexistent", features_dir=args.features, num_draft_tokens=k,
                             lora_rank=16, lora_alpha=32, max_sequence_length=768, heldout_sequences=24,
                             eval_anchors=anchors)
    data = TrainingData(config)
    model, mask_id, _, mask_embedding = build_model(config)
    _warm_start(adapter, config, model, mask_embedding, mask_id)
    model.eval()
    with torch.no_grad():
        for variant in args.variants.split(","):
            for name, texts in data.heldout.items():
                started = time.perf_counter()
                counts = [c for c in (accepted_per_block(model, t, variant, k, anchors, mask_id) for t in texts)
                          if c is not None]
                accepted = torch.cat(counts).float()
                reach = [round((accepted >= j).float().mean().item(), 3) for j in range(1, 6)]
                print(f"{variant:11s} {name:8s} tau {1 + accepted.mean().item():.3f} blocks {accepted.numel()} "
                      f"reach 1-5 {reach} ({time.perf_counter() - started:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
