#!/usr/bin/env bash
# Reproduces the DFlash drafter shipped for SmolLM2-135M-Instruct (src/dflash2/drafters/trained/smollm2-135m-instruct).
# Both steps resume where they stopped when re-run (SIGTERM / Ctrl-C keep what is done).
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=data/dflash-train/smollm2-135m-instruct
RUN=runs/dflash-smollm2
# Batched greedy generation by the target; its tapped hidden states (layers 1, 7, 14, 20, 27) are stored under
# $DFLASH2_HOME/train-hidden/ so that training needs no target forward.
.venv/bin/dflash2 train data --model smollm2 --out "$DATA" --num-sequences "${NUM_SEQUENCES:-640}" \
    --batch-size 16 --shard-size 16 --hidden-taps 5
.venv/bin/dflash2 train dflash --model smollm2 --data "$DATA" --out "$RUN" --num-layers 2 --block-size 8 \
    --target-layers 1,7,14,20,27 --draft-vocab 16384 --anchors 32 --sequences-per-step 4 --steps "${STEPS:-600}" \
    --lr 1e-3 --warmup 30 --heldout 16 --checkpoint-every 50 --eval-every 200
rm -rf src/dflash2/drafters/trained/smollm2-135m-instruct
.venv/bin/python - "$RUN/drafter" src/dflash2/drafters/trained/smollm2-135m-instruct <<'PY'
import sys
from dflash2.drafters.dflash_model import DFlashDraftModel
DFlashDraftModel.from_pretrained(sys.argv[1], "bf16").save_pretrained(sys.argv[2])  # shipped in bf16
PY
