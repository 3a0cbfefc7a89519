#!/usr/bin/env bash
# The PARD drafter recipe for the default target (docs/pard.md): the store's Qwen2.5-Coder-0.5B-Instruct adapted
# (LoRA rank 16 on every projection + a learned mask embedding) to draft 8 tokens per forward, distilled from
# Qwen2.5-Coder-1.5B-Instruct. Two resumable stages, each safe to kill and re-run (both continue where they
# stopped); run them side by side (training picks up new label shards when it is restarted):
#   scripts/train/train_qwen_pard.sh labels   # the target's top-16 distributions over text (teacher-forced passes)
#   scripts/train/train_qwen_pard.sh train    # LoRA training on those soft labels + the regenerated shards' hard labels
#   scripts/train/train_qwen_pard.sh ship     # copy the adapter of the run into the package (bf16, ~16 MB) + draft vocab
#   scripts/train/train_qwen_pard.sh export   # the shipped drafter as a plain Hugging Face directory (OUT=dir)
#   scripts/train/train_qwen_pard.sh cost     # draft pass vs verify pass (scripts/pard_cost.py)
# Data: the committed regenerated token shards (data/dflash-train/qwen2.5-coder-1.5b-instruct{,-chat}: the
# target's greedy responses to GSM8K-train / stdlib-docstring / synthetic chat prompts), GSM8K train solutions
# (data/train/gsm8k_train.jsonl, MIT) as chats, and this interpreter's standard-library sources (PSF) as code
# chats. Never data/eval.
# EXTRA: more `dflash2 train pard` options (e.g. --no-initial-eval, --stop-at-step N); RUN / LABELS: directories;
# SHIPPED: where `ship` writes (default: the shipped adapter directory; elsewhere to compare a candidate first).
# INIT: warm start a fresh run from a shipped adapter directory (e.g. INIT=src/dflash2/drafters/trained/...-pard);
# RANK / ALPHA (default 16 / 32): the LoRA rank and alpha; a warm start may raise the rank with alpha / rank kept
# (RANK=32 ALPHA=64 from a rank-16 adapter: the added rank starts at zero). SOFT_SHARE (default 0.3): share of
# training sequences drawn from the soft labels. LR (default 3e-4): peak LoRA LR.
# THREADS (default 1): torch threads per job. On 2 cores shared with other work, 2 threads per job was several times
# slower than 1 (threads wait for each other when the cores are oversubscribed: SmolLM2 fp32 speculative steps took
# 12 s with 2 threads vs 1.7 s with 1 at load average ~9); use 2 on an idle machine.
set -euo pipefail
cd "$(dirname "$0")/../.."
LABELS=${LABELS:-runs/pard-labels/v1}
RUN=${RUN:-runs/pard-train/v1}
REGEN=data/dflash-train/qwen2.5-coder-1.5b-instruct,data/dflash-train/qwen2.5-coder-1.5b-instruct-chat
SHIPPED=${SHIPPED:-src/dflash2/drafters/trained/qwen2.5-coder-1.5b-instruct-pard}
NICE="nice -n ${NICE:-19}"
case "${1:-}" in
  labels)
    $NICE .venv/bin/dflash2 train labels --model qwen2.5-coder-1.5b-instruct --out "$LABELS" --threads "${THREADS:-1}" \
      --top-k 16 --max-tokens 1024 --chunk-tokens 384 --shard-tokens 2048 \
      --sources "regen:data/dflash-train/qwen2.5-coder-1.5b-instruct,regen:data/dflash-train/qwen2.5-coder-1.5b-instruct-chat,gsm8k:data/train/gsm8k_train.jsonl,stdlib"
    ;;
  train)
    $NICE .venv/bin/dflash2 train pard --base qwen2.5-coder-0.5b-instruct --target qwen2.5-coder-1.5b-instruct \
      --out "$RUN" --threads "${THREADS:-1}" --labels "$LABELS" --hard-labels "$REGEN" --soft-share "${SOFT_SHARE:-0.3}" \
      --num-draft-tokens 8 --lora-rank "${RANK:-16}" --lora-alpha "${ALPHA:-32}" --keep-ratio 0.7 --decay 0.9 --ce-weight 0.1 \
      --anchors 48 --sequences-per-step 2 --max-seq-len 768 --steps "${STEPS:-1000}" --lr "${LR:-3e-4}" --mask-lr 2e-3 \
      --warmup 20 --heldout 16 --heldout-every 40 --eval-every "${EVAL_EVERY:-0}" --eval-anchors 8 --checkpoint-every 5 \
      ${INIT:+--init-adapter "$INIT"} ${EXTRA:-}
    ;;
  ship)  # the adapter of the run's checkpoint STEP (default: the latest; the run may go on) + a draft vocabulary;
         # DEFAULT_K: the draft length users get (measured fastest with `dflash2 bench`, docs/pard.md)
    rm -rf "$SHIPPED" && .venv/bin/dflash2 train pard-adapter --run "$RUN" --out "$SHIPPED" ${STEP:+--step "$STEP"} \
      --default-num-draft-tokens "${DEFAULT_K:-3}"
    .venv/bin/dflash2 train pard-vocab --adapter "$SHIPPED" --data "$REGEN" --size "${DRAFT_VOCAB:-65536}"
    cp "$RUN/eval.jsonl" "$SHIPPED/eval.jsonl"
    ;;
  export)  # a plain Hugging Face directory of the shipped drafter (merged weights; OUT=dir)
    .venv/bin/dflash2 train export-pard --adapter "$SHIPPED" --out "${OUT:-runs/pard-hf}" --dtype "${DTYPE:-bf16}"
    ;;
  cost)  # one draft pass vs one verify pass (k = 8), drafter in bf16 and int8
    $NICE .venv/bin/python scripts/pard_cost.py --threads "${THREADS:-1}" --drafter-weights bf16,int8
    ;;
  *) echo "usage: $0 labels | train | ship | export | cost" >&2; exit 2 ;;
esac
