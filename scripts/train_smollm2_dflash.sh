#!/usr/bin/env bash
# Reproduces the DFlash drafter shipped for SmolLM2-135M-Instruct (src/dflash2/drafters/trained/smollm2-135m-instruct).
# Both steps resume where they stopped when re-run. About half an hour on 2 CPU cores.
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=data/dflash-train/smollm2-135m-instruct
RUN=runs/dflash-smollm2
.venv/bin/dflash2 train data --model smollm2 --out "$DATA" --num-sequences "${NUM_SEQUENCES:-240}" \
    --max-new-tokens 128 --shard-size 16
.venv/bin/dflash2 train dflash --model smollm2 --data "$DATA" --out "$RUN" --num-layers 2 --block-size 8 \
    --anchors 32 --sequences-per-step 4 --steps "${STEPS:-300}" --lr 1e-3 --warmup 20 --heldout 8 \
    --checkpoint-every 50 --eval-every 100
rm -rf src/dflash2/drafters/trained/smollm2-135m-instruct
mkdir -p src/dflash2/drafters/trained
cp -r "$RUN/drafter" src/dflash2/drafters/trained/smollm2-135m-instruct
