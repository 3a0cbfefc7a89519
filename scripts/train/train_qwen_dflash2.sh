#!/usr/bin/env bash
# The DFlash2 drafter recipe for the default target: the shipped DFlash drafter plus a path selector (rank 128 over
# the 16384-id draft vocabulary, top-16 candidates) and two-tap dynamic convolutions (channel group 16), trained
# jointly on the same token shards. The new parts start as the identity / a zero gate, so step 0 drafts exactly like
# the DFlash drafter. Rank 128 keeps the shipped bf16 weights under git's 100 MB file limit (256 would be ~104 MB).
# Resumable like scripts/train/train_qwen_dflash.sh (run it again after an interruption).
set -euo pipefail
cd "$(dirname "$0")/../.."
DATA=data/dflash-train/qwen2.5-coder-1.5b-instruct
CHAT=data/dflash-train/qwen2.5-coder-1.5b-instruct-chat
TRAIN_DATA=$DATA
if [[ "${CHAT_SEQUENCES:-0}" -gt 0 ]]; then TRAIN_DATA="$DATA,$CHAT"; fi  # as the DFlash recipe (it generates them)
RUN=${RUN:-runs/dflash2-qwen1.5b}
SHIPPED=src/dflash2/drafters/trained/qwen2.5-coder-1.5b-instruct
.venv/bin/dflash2 train dflash2 --model qwen-1.5b --data "$TRAIN_DATA" --out "$RUN" --init-from "${INIT_FROM:-$SHIPPED}" \
    --num-layers 2 --intermediate-size 2048 --block-size 8 --target-layers 1,7,13,19,25 --draft-vocab 16384 \
    --selector-rank 128 --selector-top-k 16 --conv-group 16 --anchors 32 --sequences-per-step 4 \
    --steps "${STEPS:-400}" --lr "${LR:-3e-4}" --warmup 20 --heldout 12 --checkpoint-every 50 \
    --threads "${THREADS:-2}"
rm -rf "$SHIPPED-dflash2"
.venv/bin/python - "$RUN/drafter" "$SHIPPED-dflash2" "$SHIPPED" <<'PY'
import json
import sys
from pathlib import Path

from dflash2.drafters.dflash_model import DFlashDraftModel

out = DFlashDraftModel.from_pretrained(sys.argv[1], "bf16").save_pretrained(sys.argv[2])  # shipped in bf16
# the draft length measured best for the DFlash drafter it grew from (re-measure with dflash2 bench)
length = json.loads((Path(sys.argv[3]) / "config.json").read_text()).get("default_num_draft_tokens")
config = json.loads((Path(out) / "config.json").read_text())
(Path(out) / "config.json").write_text(json.dumps({**config, "default_num_draft_tokens": length}, indent=2) + "\n")
PY
