#!/usr/bin/env bash
# The target-conditioned PARD drafter for the default target (docs/pard.md, "Conditioning on the target"): the
# shipped PARD adapter (Qwen2.5-Coder-0.5B-Instruct + LoRA + mask embedding, k = 8 in one pass) plus a projection of
# Qwen2.5-Coder-1.5B-Instruct's hidden states at layers 1, 13, 25 of the last verified position, added to the
# inputs of the drafting rows (drafters/conditioning.py, drafters/conditioned.py). Stages, each resumable (kill and
# re-run the same command):
#   scripts/train/train_qwen_conditioned.sh features    # one target pass per sequence: soft labels (top-16) + taps
#   scripts/train/train_qwen_conditioned.sh experiment  # the same warm start trained with and without conditioning
#   scripts/train/train_qwen_conditioned.sh train       # the long run (conditioned; EXTRA=--condition-context: every position)
#   scripts/train/train_qwen_conditioned.sh control     # the same long run unconditioned, exact gradient (RUN=...)
#   scripts/train/train_qwen_conditioned.sh kv          # the control's run conditioned through gated keys / values
#   scripts/train/train_qwen_conditioned.sh ship        # adapter + conditioning + draft vocabulary into the package
# Data: the committed regenerated token shards (the target's greedy responses; never data/eval), the last 12 of
# each directory held out, and the target's greedy answers to the last 4 MT-bench questions (held out only: the
# bench reads the first ones). Features stay under runs/ (~9 KB per token).
# FEATURES / RUN / SHIPPED: directories; SEQUENCES: training sequences to featurise; STEPS; THREADS (default 1);
# EXTRA: more `dflash2 train pard` options.
set -euo pipefail
cd "$(dirname "$0")/../.."
FEATURES=${FEATURES:-runs/features/v1}
RUN=${RUN:-runs/conditioned/v1}
INIT=${INIT:-src/dflash2/drafters/trained/qwen2.5-coder-1.5b-instruct-pard}
SHIPPED=${SHIPPED:-src/dflash2/drafters/trained/qwen2.5-coder-1.5b-instruct-dflash2-conditioned}
REGEN=data/dflash-train/qwen2.5-coder-1.5b-instruct,data/dflash-train/qwen2.5-coder-1.5b-instruct-chat
# nice ranks a process only among those of its autogroup: where the kernel groups by session
# (/proc/sys/kernel/sched_autogroup_enabled = 1) a job in a session of its own (setsid, nohup from another terminal)
# takes a session's share of the cores whatever its nice (seen: a features run at nice 19 halved a test run in
# another session). Started as a session's leader (`setsid scripts/train/...`) the script lowers its session's
# autogroup to the same nice; else `echo 19 > /proc/<pid>/autogroup` (any process of the job's session) does.
if [ "$(ps -o sid= -p $$ | tr -d ' ')" = "$$" ] && [ -e /proc/self/autogroup ]; then
  echo "${NICE:-15}" 2>/dev/null > /proc/self/autogroup || echo "could not lower this job's autogroup" >&2
fi
NICE="nice -n ${NICE:-15}"
# shared by the experiment's two arms and the long run: the shipped adapter's shape, a gentle warm-start LR
COMMON=(--base qwen2.5-coder-0.5b-instruct --target qwen2.5-coder-1.5b-instruct --features "$FEATURES"
        --init-adapter "$INIT" --threads "${THREADS:-1}" --num-draft-tokens 8 --lora-rank 16 --lora-alpha 32
        --keep-ratio 0.7 --decay 0.9 --ce-weight 0.1 --anchors 32 --sequences-per-step 2 --max-seq-len 768
        --mask-lr 2e-4 --conditioning-lr 5e-6 --eval-anchors 16 --checkpoint-every 5)
case "${1:-}" in
  features)
    $NICE .venv/bin/dflash2 train features --data "$REGEN" --out "$FEATURES" --layers 1,13,25 \
      --sequences "${SEQUENCES:-400}" --heldout 12 --mt-bench 4 --threads "${THREADS:-1}"
    ;;
  experiment)  # conditioned vs not: same start, data (16 sequences, each once), steps and seed, side by side; the
               # plain arm skips the step-0 check (the zero-initialised conditioning drafts exactly as without it)
    EXP=(--train-sequences 16 --steps 16 --sequences-per-step 1 --anchors 48 --max-seq-len 512 --heldout 6
         --lr 1e-4 --warmup 2 --eval-every 0)
    $NICE .venv/bin/dflash2 train pard "${COMMON[@]}" "${EXP[@]}" --out "${RUN}-exp-plain" --no-initial-eval \
      ${EXTRA:-} > "${RUN}-exp-plain.log" 2>&1 &
    $NICE .venv/bin/dflash2 train pard "${COMMON[@]}" "${EXP[@]}" --out "${RUN}-exp-cond" --condition \
      ${EXTRA:-} > "${RUN}-exp-cond.log" 2>&1 &
    wait
    ;;
  train)
    $NICE .venv/bin/dflash2 train pard "${COMMON[@]}" --out "$RUN" --steps "${STEPS:-2000}" --lr 1e-4 --warmup 10 \
      --eval-every "${EVAL_EVERY:-50}" --condition ${EXTRA:-}
    ;;
  control)  # the every-position run's control (docs/pard.md): no conditioning, the gradient through the context too
    $NICE .venv/bin/dflash2 train pard "${COMMON[@]}" --out "$RUN" --steps "${STEPS:-300}" --lr 5e-5 --warmup 10 \
      --eval-every "${EVAL_EVERY:-50}" --no-initial-eval --exact-gradient ${EXTRA:-}
    ;;
  kv)  # gated keys / values in every layer (drafters/kv_conditioning.py): the control's recipe (exact gradient, LR
       # 5e-5) plus the conditioning, its projection at 1e-4 and its per-layer gates (closed at start) at 1e-2
    $NICE .venv/bin/dflash2 train pard "${COMMON[@]}" --out "$RUN" --steps "${STEPS:-600}" --lr 5e-5 --warmup 10 \
      --eval-every "${EVAL_EVERY:-50}" --no-initial-eval --exact-gradient --condition-kv --conditioning-lr 1e-4 \
      --gate-lr 1e-2 ${EXTRA:-}
    ;;
  ship)  # the adapter + conditioning of checkpoint STEP (default: the latest) + a draft vocabulary
    rm -rf "$SHIPPED" && .venv/bin/dflash2 train pard-adapter --run "$RUN" --out "$SHIPPED" ${STEP:+--step "$STEP"} \
      --default-num-draft-tokens "${DEFAULT_K:-3}"
    .venv/bin/dflash2 train pard-vocab --adapter "$SHIPPED" --data "$REGEN" --size "${DRAFT_VOCAB:-65536}"
    cp "$RUN/eval.jsonl" "$SHIPPED/eval.jsonl"
    ;;
  *) echo "usage: $0 features | experiment | train | control | kv | ship" >&2; exit 2 ;;
esac
