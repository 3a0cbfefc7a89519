#!/usr/bin/env bash
# Reproduces the DFlash drafter shipped for SmolLM2-135M-Instruct (src/dflash2/drafters/trained/smollm2-135m-instruct).
# Every step resumes where it stopped when re-run (SIGTERM / Ctrl-C keep what is done).
# The shipped drafter: NUM_SEQUENCES=208 scripts/train/train_smollm2_dflash.sh (the 13 committed shards, the last 16
# sequences held out; 600 steps, 6 minutes on 2 shared cores; held-out tau 1.46). Training reads every shard
# present, so reproducing it exactly needs that shard count.
set -euo pipefail
cd "$(dirname "$0")/../.."
DATA=data/dflash-train/smollm2-135m-instruct
RUN=runs/dflash-smollm2
# Batched greedy generation by the target; its tapped hidden states (layers 1, 7, 14, 20, 27) are stored under
# $DFLASH2_HOME/train-hidden/ so that training needs no target forward.
.venv/bin/dflash2 train data --model smollm2 --out "$DATA" --num-sequences "${NUM_SEQUENCES:-640}" \
    --batch-size 16 --shard-size 16 --hidden-taps 5
# Hidden states of shards generated on another machine (the tokens are committed, the hidden states are not):
# one target forward per sequence, once, instead of one per visit during training.
.venv/bin/dflash2 train hidden --model smollm2 --data "$DATA"
.venv/bin/dflash2 train dflash --model smollm2 --data "$DATA" --out "$RUN" --num-layers 2 --block-size 8 \
    --target-layers 1,7,14,20,27 --draft-vocab 16384 --anchors 32 --sequences-per-step 4 --steps "${STEPS:-600}" \
    --lr 1e-3 --warmup 30 --heldout 16 --checkpoint-every 50 --eval-every 200
rm -rf src/dflash2/drafters/trained/smollm2-135m-instruct
.venv/bin/python - "$RUN/drafter" src/dflash2/drafters/trained/smollm2-135m-instruct <<'PY'
import sys
from dflash2.drafters.dflash_model import DFlashDraftModel
DFlashDraftModel.from_pretrained(sys.argv[1], "bf16").save_pretrained(sys.argv[2])  # shipped in bf16
PY
