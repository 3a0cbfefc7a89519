"""A start for the gated lookup's fc (drafters/kv_conditioning.py) that means something: ridge regression from the
target's normalised taps at position i to the shipped drafter's own residual stream there (the input of layer M,
at unit RMS), over featurised training sequences. Writes an --init-adapter directory: the shipped adapter plus a
kv conditioning with that fc and every gate at GATE (docs/pard.md, "Gated keys and values").

    python scripts/train/fit_kv_start.py OUT_DIR M SEQUENCES GATE   # e.g. runs/conditioned/kv-fitted-init 12 100 0.05
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch

from dflash2.drafters.conditioning import normalised_taps
from dflash2.drafters.kv_conditioning import GatedKVConditioning, KVConditioningConfig
from dflash2.models.store import resolve_model
from dflash2.train.pard_trainer import PardTrainConfig, TrainingData, _warm_start, build_model

SHIPPED = Path("src/dflash2/drafters/trained/qwen2.5-coder-1.5b-instruct-pard")
FEATURES = "runs/features/v1"


def main(out: Path, layer: int, count: int, gate: float) -> None:
    torch.set_num_threads(2)
    config = PardTrainConfig(base_dir=str(resolve_model("qwen2.5-coder-0.5b-instruct", "bf16", pull=False)),
                             label_dirs="", out_dir=str(out), features_dir=FEATURES, num_draft_tokens=8,
                             lora_rank=16, lora_alpha=32, condition_kv=True)
    data = TrainingData(config)
    model, mask_id, _, mask_embedding = build_model(config)
    _warm_start(SHIPPED, config, model, mask_embedding, mask_id)
    kv = GatedKVConditioning(KVConditioningConfig(data.features.target_layers, data.features.target_hidden_size,
                                                  model.config.hidden_size, model.config.num_layers))
    width = kv.fc.in_features
    xtx = torch.zeros(width, width, dtype=torch.float64)  # the normal equations, summed over positions
    xty = torch.zeros(width, model.config.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        for name in data.feature_train[:count]:
            text = data.features.read(name, True)
            ids = text.ids[: config.max_sequence_length]
            residual = model(ids[None], hidden_layers=(layer - 1,), logits="none").hidden_states[0][0]  # [S, D]
            x = normalised_taps(text.taps[: len(ids)], len(kv.config.target_layers)).double()  # [S, T * Dt]
            y = normalised_taps(residual, 1).double()  # [S, D] at unit RMS: the layer's own norm removes the scale
            xtx += x.T @ x
            xty += x.T @ y
    ridge = 1e-2 * xtx.diagonal().mean()
    weight = torch.linalg.solve(xtx + ridge * torch.eye(width, dtype=torch.float64), xty)  # [T*Dt, D]
    fitted = 1 - ((x @ weight - y) ** 2).sum() / ((y - y.mean(0)) ** 2).sum()
    print(f"R^2 on the last sequence (in the fit): {fitted.item():.3f}")
    kv.fc.weight.data.copy_(weight.T.float())
    kv.gates.data.fill_(gate)
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(SHIPPED, out)
    kv.save(out, torch.float32)
    print(f"wrote {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]))
