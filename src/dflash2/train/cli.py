"""``dflash2 train data | hidden | dflash | dflash2 | labels | pard``: regenerate responses with the target, then train a
DFlash drafter; or store the target's distributions over text and train a PARD drafter on them."""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path


def add_train_parser(commands) -> None:
    p = commands.add_parser("train", help="drafter training: data generation with the target, DFlash / DFlash2 "
                                          "and PARD training")
    sub = p.add_subparsers(dest="train_command", required=True)

    data = sub.add_parser("data", help="regenerate responses with the target into resumable token shards")
    data.add_argument("--model", default="qwen2.5-coder-1.5b-instruct", help="the target (default: %(default)s)")
    data.add_argument("--out", required=True, help="shard directory (a re-run resumes)")
    data.add_argument("--num-sequences", type=int, required=True, help="total sequences wanted in --out")
    data.add_argument("--max-new-tokens", type=int, default=256)
    data.add_argument("--max-prompt-tokens", type=int, default=512)
    data.add_argument("--shard-size", type=int, default=64)
    data.add_argument("--sources", default="gsm8k,stdlib",
                      help="prompt sources, comma-separated: gsm8k, stdlib, chat (see dflash2.train.prompts)")
    data.add_argument("--gsm8k", default=None,
                      help="GSM8K train jsonl (default: the repository's data/train/gsm8k_train.jsonl)")
    data.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    data.add_argument("--threads", type=int, default=None)
    data.add_argument("--batch-size", type=int, default=16,
                      help="prompts generated together (default: %(default)s; 1 = batch-1 decoding)")
    data.add_argument("--hidden-taps", type=int, default=5,
                      help="store the target's hidden states of this many spread layers with the data, so that "
                           "training needs no target forward (batched generation only; 0 = none)")
    data.add_argument("--hidden-dir", default=None,
                      help="where the hidden states go (default: $DFLASH2_HOME/train-hidden/<name of --out>, outside "
                           "the checkout, so that they survive a fresh clone; they are too large for git)")
    data.add_argument("--speculate", choices=("none", "ngram"), default=None,
                      help="with --batch-size 1: generate through lossless greedy speculative decoding "
                           "(same ids, faster; default ngram)")
    data.set_defaults(handler=run_train_data)

    hidden = sub.add_parser("hidden", help="recompute the target's hidden states that shards lack (e.g. after a "
                                           "fresh clone: token shards are committed, hidden states are not)")
    hidden.add_argument("--model", default="qwen2.5-coder-1.5b-instruct", help="the target (default: %(default)s)")
    hidden.add_argument("--data", required=True, help="token shard directories, comma-separated")
    hidden.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    hidden.add_argument("--threads", type=int, default=None)
    hidden.set_defaults(handler=run_train_hidden)

    dflash = sub.add_parser("dflash", help="train a DFlash block drafter on token shards (resumable)")
    _add_dflash_arguments(dflash)
    dflash.set_defaults(handler=run_train_dflash, selector_rank=0, selector_top_k=16, conv_group=0)
    dflash2 = sub.add_parser("dflash2", help="train a DFlash2 drafter: DFlash + path selector + dynamic convolution")
    _add_dflash_arguments(dflash2)
    dflash2.add_argument("--selector-rank", type=int, default=256, help="pair codebook rank (default: %(default)s)")
    dflash2.add_argument("--selector-top-k", type=int, default=16, help="candidates per position")
    dflash2.add_argument("--conv-group", type=int, default=16, help="dynamic convolution channel group (0 = off)")
    dflash2.set_defaults(handler=run_train_dflash)
    _add_labels_parser(sub)
    _add_features_parser(sub)
    _add_distil_parser(sub)
    _add_pard_parser(sub)
    _add_export_pard_parser(sub)


def _add_dflash_arguments(dflash) -> None:
    dflash.add_argument("--model", default="qwen2.5-coder-1.5b-instruct", help="the target (default: %(default)s)")
    dflash.add_argument("--data", required=True,
                        help="token shards from `dflash2 train data`; several directories comma-separated")
    dflash.add_argument("--out", required=True, help="run directory: checkpoints/, drafter/, logs")
    dflash.add_argument("--num-layers", type=int, default=1)
    dflash.add_argument("--block-size", type=int, default=16)
    dflash.add_argument("--target-layers", default=None, help="comma-separated tapped layers (default: spread)")
    dflash.add_argument("--mask-token-id", type=int, default=None)
    dflash.add_argument("--intermediate-size", type=int, default=None)
    dflash.add_argument("--qk-norm", action="store_true",
                        help="Qwen3-style layers (q/k norms, no q/k/v biases): exportable to llama.cpp / vLLM / SGLang")
    dflash.add_argument("--init-from-target", action="store_true", help="warm start from the target's layers")
    dflash.add_argument("--init-from", default=None,
                        help="start from a trained drafter directory (e.g. a DFlash drafter for a DFlash2 run)")
    dflash.add_argument("--refresh-draft-vocab", action="store_true",
                        help="with --init-from: rank the draft vocabulary on this run's data instead of keeping the "
                             "source drafter's (not for a source with a path selector)")
    dflash.add_argument("--draft-vocab", type=int, default=0,
                        help="score only this many frequent ids in the drafter's head (0 = whole vocabulary)")
    dflash.add_argument("--gamma", type=float, default=None)
    dflash.add_argument("--anchors", type=int, default=64, help="blocks per sequence per step")
    dflash.add_argument("--max-seq-len", type=int, default=1024)
    dflash.add_argument("--sequences-per-step", type=int, default=4)
    dflash.add_argument("--steps", type=int, default=1000)
    dflash.add_argument("--lr", type=float, default=6e-4)
    dflash.add_argument("--warmup", type=int, default=50)
    dflash.add_argument("--heldout", type=int, default=16)
    dflash.add_argument("--seed", type=int, default=0)
    dflash.add_argument("--eval-every", type=int, default=0)
    dflash.add_argument("--checkpoint-every", type=int, default=100)
    dflash.add_argument("--stop-at-step", type=int, default=None, help="stop the run at this step; a re-run resumes")
    dflash.add_argument("--no-resume", action="store_true")
    dflash.add_argument("--dtype", default="fp32", help="drafter weights and optimizer state")
    dflash.add_argument("--target-dtype", default="bf16")
    dflash.add_argument("--threads", type=int, default=None)


def _stop_gracefully_on_signals() -> None:
    """SIGTERM and SIGINT (ignored by default in background jobs) end a run like Ctrl-C: what is done is saved."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGINT, interrupt)


def run_train_data(args: argparse.Namespace) -> int:
    import torch

    from dflash2.drafters.dflash import default_target_layer_ids
    from dflash2.models.loading import load_transformer
    from dflash2.models.store import canonical_name, home, resolve_model
    from dflash2.models.tokenizer import Tokenizer
    from dflash2.train.data import DataConfig, chat_encoder, generate_training_data

    if args.batch_size < 1:
        raise SystemExit("--batch-size must be >= 1")
    if args.batch_size > 1 and args.speculate not in (None, "none"):
        raise SystemExit("--speculate applies to --batch-size 1 only (batched generation is plain greedy)")
    _stop_gracefully_on_signals()
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model, args.dtype)
    target = load_transformer(model_dir, args.dtype)
    tokenizer = Tokenizer(model_dir)
    taps = ()
    if args.hidden_taps > 0 and args.batch_size > 1:
        taps = default_target_layer_ids(target.config.num_layers, args.hidden_taps)
    config = DataConfig(args.out, args.num_sequences, max_new_tokens=args.max_new_tokens,
                        max_prompt_tokens=args.max_prompt_tokens, shard_size=args.shard_size,
                        batch_size=args.batch_size, hidden_layers=taps,
                        hidden_dir=args.hidden_dir or str(home() / "train-hidden" / Path(args.out).resolve().name),
                        sources=tuple(s for s in args.sources.split(",") if s), gsm8k_path=args.gsm8k,
                        target_model=canonical_name(args.model) or args.model)
    drafter = None
    if args.batch_size == 1 and args.speculate in (None, "ngram"):
        from dflash2.drafters.ngram import NgramDrafter

        drafter = NgramDrafter(8, stop_ids=tokenizer.eos_token_ids)
    print(generate_training_data(config, target, chat_encoder(tokenizer), stop_ids=tokenizer.eos_token_ids,
                                 drafter=drafter))
    return 0


def run_train_hidden(args: argparse.Namespace) -> int:
    import torch

    from dflash2.models.loading import load_transformer
    from dflash2.models.store import resolve_model
    from dflash2.train.data import fill_missing_hidden, shards_missing_hidden

    _stop_gracefully_on_signals()
    if args.threads:
        torch.set_num_threads(args.threads)
    directories = [d for d in args.data.split(",") if d]
    for directory in directories:
        if not (Path(directory) / "manifest.json").exists():
            raise SystemExit(f"no token shards in {directory} (manifest.json missing)")
    if not any(shards_missing_hidden(d) for d in directories):
        print("every shard has its hidden states")
        return 0
    model_dir = resolve_model(args.model, args.dtype)
    # torch's own kernels: at hundreds of rows per call (whole sequences) they beat the packed decode kernel
    target = load_transformer(model_dir, args.dtype, packed=False)
    for directory in directories:
        print(f"{directory}: hidden states written for {fill_missing_hidden(directory, target)} shards")
    return 0


def run_train_dflash(args: argparse.Namespace) -> int:
    from dflash2.models.store import canonical_name, resolve_model
    from dflash2.train.dflash_trainer import TrainConfig, train_dflash

    _stop_gracefully_on_signals()
    layers = tuple(int(x) for x in args.target_layers.split(",")) if args.target_layers else None
    config = TrainConfig(
        target_dir=str(resolve_model(args.model, args.target_dtype)), data_dir=args.data, out_dir=args.out,
        target_model=canonical_name(args.model) or args.model, target_dtype=args.target_dtype, dtype=args.dtype,
        num_layers=args.num_layers, block_size=args.block_size, target_layer_ids=layers,
        mask_token_id=args.mask_token_id, intermediate_size=args.intermediate_size,
        init_from_target=args.init_from_target, draft_vocab_size=args.draft_vocab, gamma=args.gamma,
        selector_rank=args.selector_rank, selector_top_k=args.selector_top_k, conv_group=args.conv_group,
        qk_norm=args.qk_norm, init_from=args.init_from, refresh_draft_vocab=args.refresh_draft_vocab,
        anchors_per_sequence=args.anchors,
        max_sequence_length=args.max_seq_len, sequences_per_step=args.sequences_per_step, num_steps=args.steps,
        learning_rate=args.lr, warmup_steps=args.warmup, heldout_sequences=args.heldout, seed=args.seed,
        eval_every=args.eval_every, checkpoint_every=args.checkpoint_every, stop_at_step=args.stop_at_step,
        resume=not args.no_resume, threads=args.threads,
    )
    print(train_dflash(config))
    return 0


# ---- `dflash2 train labels` (soft labels from teacher-forced target passes) ----------------------------------


def _add_labels_parser(sub) -> None:
    labels = sub.add_parser("labels", help="store the target's next-token distributions (top-k) over existing text: "
                                           "teacher-forced passes, resumable shards")
    labels.add_argument("--model", default="qwen2.5-coder-1.5b-instruct", help="the target (default: %(default)s)")
    labels.add_argument("--out", required=True, help="label shard directory (a re-run resumes)")
    labels.add_argument("--sources", required=True,
                        help="comma-separated, interleaved round-robin: regen:<token shard dir>, gsm8k:<train jsonl>, "
                             "stdlib or stdlib:<dir> (see dflash2.train.labels)")
    labels.add_argument("--top-k", type=int, default=16, help="ids and probabilities stored per position")
    labels.add_argument("--max-tokens", type=int, default=1024, help="longer sequences are cut")
    labels.add_argument("--chunk-tokens", type=int, default=384, help="code chunk size of the stdlib source")
    labels.add_argument("--max-items", type=int, default=None, help="stop after this many sequences in total")
    labels.add_argument("--shard-tokens", type=int, default=16384, help="tokens per shard (a kill loses at most these)")
    labels.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    labels.add_argument("--threads", type=int, default=None)
    labels.set_defaults(handler=run_train_labels)


def _teacher(args: argparse.Namespace):
    """(the target for teacher-forced passes, its directory), with ``--threads`` applied and signals handled."""
    import torch

    from dflash2.models.loading import load_transformer
    from dflash2.models.store import resolve_model

    _stop_gracefully_on_signals()
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model, args.dtype)
    # the packed bf16 kernel (default on a CPU): on an AVX2 machine torch's own bf16 matmul is ~4x slower at
    # hundreds of rows (no bf16 hardware), and an fp32 copy of the target would double its memory
    return load_transformer(model_dir, args.dtype), model_dir


def run_train_labels(args: argparse.Namespace) -> int:
    from dflash2.models.store import canonical_name
    from dflash2.models.tokenizer import Tokenizer
    from dflash2.train.labels import LabelConfig, generate_labels

    target, model_dir = _teacher(args)
    config = LabelConfig(args.out, tuple(s for s in args.sources.split(",") if s),
                         target_model=canonical_name(args.model) or args.model, top_k=args.top_k,
                         max_tokens=args.max_tokens, chunk_tokens=args.chunk_tokens, max_items=args.max_items,
                         shard_tokens=args.shard_tokens)
    print(generate_labels(config, target, Tokenizer(model_dir)))
    return 0


def _add_features_parser(sub) -> None:
    features = sub.add_parser("features", help="soft labels AND tapped hidden states of the target over its "
                                               "regenerated responses, for a target-conditioned drafter (resumable)")
    features.add_argument("--model", default="qwen2.5-coder-1.5b-instruct", help="the target (default: %(default)s)")
    features.add_argument("--data", required=True, help="token shard directories (`dflash2 train data`), comma-separated")
    features.add_argument("--out", required=True, help="features directory (one file per sequence; not for git)")
    features.add_argument("--layers", default="1,13,25", help="target layers to tap (default: %(default)s)")
    features.add_argument("--sequences", type=int, default=None, help="training sequences, interleaved across --data")
    features.add_argument("--heldout", type=int, default=12, help="last sequences of each directory held out")
    features.add_argument("--mt-bench", type=int, default=0,
                          help="also hold out the target's greedy answers to the last N MT-bench questions")
    features.add_argument("--top-k", type=int, default=16)
    features.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    features.add_argument("--threads", type=int, default=None)
    features.set_defaults(handler=run_train_features)


def run_train_features(args: argparse.Namespace) -> int:
    import itertools

    from dflash2.models.store import canonical_name
    from dflash2.models.tokenizer import Tokenizer
    from dflash2.train.target_features import build_features, mt_bench_items, regenerated_items

    target, model_dir = _teacher(args)
    layers = tuple(int(x) for x in args.layers.split(","))
    regenerated = regenerated_items(args.data, args.heldout, args.sequences)
    heldout = [item for item in regenerated if item.heldout]
    train = [item for item in regenerated if not item.heldout]
    # held-out sets first, so that a short run already measures; then training sequences
    items = itertools.chain(heldout, mt_bench_items(target, Tokenizer(model_dir), args.mt_bench,
                                                    out_dir=Path(args.out)), train)
    print(build_features(args.out, target, items, layers, args.top_k, canonical_name(args.model) or args.model))
    return 0


def _add_distil_parser(sub) -> None:
    distil = sub.add_parser("distil", help="distil the shipped drafter further on your own prompts (JSONL of "
                                           "{\"prompt\"} or {\"messages\"}) and report the held-out gain (resumable)")
    distil.add_argument("--prompts", required=True, help="JSONL: one {\"prompt\": ...} or {\"messages\": [...]} a line")
    distil.add_argument("--out", required=True, help="work directory: features/, run/ (run/drafter: the result)")
    distil.add_argument("--model", default="qwen2.5-coder-1.5b-instruct", help="the target (default: %(default)s)")
    distil.add_argument("--draft-model", default=None,
                        help="the adapter to start from (default: the shipped conditioned drafter, else the shipped "
                             "pard adapter)")
    distil.add_argument("--steps", type=int, default=100)
    distil.add_argument("--heldout-share", type=float, default=0.2, help="last share of the prompts held out")
    distil.add_argument("--max-new-tokens", type=int, default=256, help="length of the target's answers")
    distil.add_argument("--condition", action="store_true",
                        help="train a drafter conditioned on the target's hidden states (a conditioned start always "
                             "is); default: the adapter alone, with the exact gradient (docs/pard.md)")
    distil.add_argument("--layers", default="1,13,25",
                        help="target layers to condition on (with --condition, when the start has no conditioning)")
    distil.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    distil.add_argument("--threads", type=int, default=None)
    distil.set_defaults(handler=run_train_distil)


def run_train_distil(args: argparse.Namespace) -> int:
    from dflash2.drafters import TRAINED_DIR
    from dflash2.drafters.pard import PardConfig
    from dflash2.models.store import canonical_name, resolve_model
    from dflash2.models.tokenizer import Tokenizer
    from dflash2.train.distil import distil, read_prompt_file

    chats = read_prompt_file(args.prompts)
    name = canonical_name(args.model) or args.model
    start = args.draft_model
    if start is None:
        candidates = [TRAINED_DIR / f"{name}-dflash2", TRAINED_DIR / f"{name}-pard"]
        start = next((str(c) for c in candidates if (c / "pard_config.json").exists()), None)
        if start is None:
            raise SystemExit(f"no shipped pard / dflash2 adapter for {name}; pass --draft-model")
    target, model_dir = _teacher(args)
    tokenizer = Tokenizer(model_dir)
    report = distil(target, chats, tokenizer.apply_chat_template, tokenizer.eos_token_ids, args.out,
                    base_dir=str(resolve_model(PardConfig.load(start).base_model, "bf16")), init_adapter=start,
                    layers=tuple(int(x) for x in args.layers.split(",")), steps=args.steps,
                    heldout_share=args.heldout_share, max_new_tokens=args.max_new_tokens, threads=args.threads,
                    condition=True if args.condition else None)
    print(f"started from {start}" + (" (conditioned)" if report.conditioned_start else
                                     " (conditioning added)" if report.conditioned else ""))
    print("\n".join(report.lines()))
    drafter = "dflash2" if report.conditioned else "pard+ngram"
    print(f"drafter: {report.drafter_dir} (use: --drafter {drafter} --draft-model {report.drafter_dir})")
    return 0


# ---- `dflash2 train pard` (a parallel drafter on a pretrained small model, distilled from the labels) ---------


def _add_pard_parser(sub) -> None:
    pard = sub.add_parser("pard", help="train a PARD drafter (LoRA + mask embedding on a small pretrained model of "
                                       "the target's family) on `dflash2 train labels` shards (resumable)")
    pard.add_argument("--base", default="qwen2.5-coder-0.5b-instruct", help="the drafter's base (default: %(default)s)")
    pard.add_argument("--labels", default="", help="soft-label shard directories (`dflash2 train labels`), comma-separated")
    pard.add_argument("--hard-labels", default="",
                      help="token shard directories (`dflash2 train data`, the target's greedy responses): the next "
                           "token is the label")
    pard.add_argument("--soft-share", type=float, default=0.5, help="share of sequences drawn from --labels")
    pard.add_argument("--out", required=True, help="run directory: checkpoints/, drafter/, logs")
    pard.add_argument("--target", default="qwen2.5-coder-1.5b-instruct", help="the target the labels came from")
    pard.add_argument("--num-draft-tokens", type=int, default=8, help="k: drafts per forward (k - 1 mask positions)")
    pard.add_argument("--lora-rank", type=int, default=16)
    pard.add_argument("--lora-alpha", type=float, default=32.0)
    pard.add_argument("--keep-ratio", type=float, default=0.7, help="conditional drop: keep each next mask row")
    pard.add_argument("--decay", type=float, default=0.9, help="row j weighs decay^j x the target's reach probability")
    pard.add_argument("--no-reach-weight", action="store_true", help="weights decay^j alone")
    pard.add_argument("--ce-weight", type=float, default=0.1, help="cross-entropy on the real token, besides distillation")
    pard.add_argument("--anchors", type=int, default=32, help="blocks per sequence per step")
    pard.add_argument("--max-seq-len", type=int, default=768)
    pard.add_argument("--sequences-per-step", type=int, default=4)
    pard.add_argument("--steps", type=int, default=2000)
    pard.add_argument("--lr", type=float, default=2e-4)
    pard.add_argument("--mask-lr", type=float, default=2e-3)
    pard.add_argument("--warmup", type=int, default=20)
    pard.add_argument("--heldout-every", type=int, default=40)
    pard.add_argument("--heldout", type=int, default=24)
    pard.add_argument("--eval-every", type=int, default=50)
    pard.add_argument("--eval-anchors", type=int, default=8)
    pard.add_argument("--no-initial-eval", action="store_true",
                      help="skip the untrained drafter's held-out check at step 0 of a fresh run (~4 min here; it is "
                           "deterministic, so a known value need not be recomputed)")
    pard.add_argument("--init-adapter", default="",
                      help="warm start a fresh run from a shipped adapter directory (its LoRA weights and mask "
                           "embedding; the optimizer and schedule start over)")
    pard.add_argument("--features", default="",
                      help="`dflash2 train features` directory: soft labels and the target's taps (instead of "
                           "--labels / --hard-labels); its held-out sequences are the held-out sets")
    pard.add_argument("--train-sequences", type=int, default=None, help="with --features: its first N only")
    pard.add_argument("--condition", action="store_true",
                      help="condition the drafter on the target's hidden states (the `dflash2` drafter; needs --features)")
    pard.add_argument("--condition-context", action="store_true",
                      help="with --condition: every context position's target state too (the context pass then trains)")
    pard.add_argument("--exact-gradient", action="store_true",
                      help="the gradient through the context pass too (about twice a step's cost)")
    pard.add_argument("--condition-kv", action="store_true",
                      help="condition the drafter on the target's hidden states through gated keys and values in "
                           "every layer (drafters/kv_conditioning.py; needs --features)")
    pard.add_argument("--conditioning-lr", type=float, default=5e-4)
    pard.add_argument("--gate-lr", type=float, default=1e-2, help="with --condition-kv: the per-layer gates' LR")
    pard.add_argument("--gate-init", type=float, default=0.0,
                      help="with --condition-kv: the gates' start (0: closed, step 0 drafts as the start adapter)")
    pard.add_argument("--checkpoint-every", type=int, default=10)
    pard.add_argument("--stop-at-step", type=int, default=None, help="stop the run at this step; a re-run resumes")
    pard.add_argument("--no-resume", action="store_true")
    pard.add_argument("--seed", type=int, default=0)
    pard.add_argument("--threads", type=int, default=None)
    pard.set_defaults(handler=run_train_pard)


def run_train_pard(args: argparse.Namespace) -> int:
    from dflash2.models.store import canonical_name, resolve_model
    from dflash2.train.pard_trainer import PardTrainConfig, train_pard

    _stop_gracefully_on_signals()
    config = PardTrainConfig(
        base_dir=str(resolve_model(args.base, "bf16")), label_dirs=args.labels, hard_label_dirs=args.hard_labels,
        soft_share=args.soft_share, out_dir=args.out,
        base_model=canonical_name(args.base) or args.base, target_model=canonical_name(args.target) or args.target,
        num_draft_tokens=args.num_draft_tokens, lora_rank=args.lora_rank, lora_alpha=args.lora_alpha,
        keep_ratio=args.keep_ratio, decay=args.decay, reach_weight=not args.no_reach_weight,
        ce_weight=args.ce_weight, max_sequence_length=args.max_seq_len, heldout_every=args.heldout_every,
        heldout_sequences=args.heldout, seed=args.seed, anchors_per_sequence=args.anchors,
        sequences_per_step=args.sequences_per_step, num_steps=args.steps, learning_rate=args.lr,
        mask_learning_rate=args.mask_lr, warmup_steps=args.warmup, eval_every=args.eval_every,
        eval_anchors=args.eval_anchors, checkpoint_every=args.checkpoint_every, stop_at_step=args.stop_at_step,
        resume=not args.no_resume, threads=args.threads, initial_eval=not args.no_initial_eval,
        init_adapter=args.init_adapter, features_dir=args.features, train_sequences=args.train_sequences,
        condition=args.condition, condition_context=args.condition_context, exact_gradient=args.exact_gradient,
        conditioning_learning_rate=args.conditioning_lr, condition_kv=args.condition_kv,
        gate_learning_rate=args.gate_lr, gate_init=args.gate_init,
    )
    print(train_pard(config))
    return 0


# ---- `dflash2 train export` (a drafter in the layout of the engine that serves it) ------------------------------


def _add_export_pard_parser(sub) -> None:
    export = sub.add_parser("export", help="write a trained drafter in the layout another engine loads: PARD for "
                                           "vLLM's parallel drafting, DFlash for llama.cpp / vLLM / SGLang")
    export.add_argument("--engine", required=True, choices=("llama.cpp", "vllm", "sglang"))
    export.add_argument("--out", required=True, help="the directory to write")
    export.add_argument("--drafter", default="pard",
                        help="a trained drafter directory (a PARD adapter or a DFlash drafter), or 'pard' / 'dflash': "
                             "the one shipped for --target (default: %(default)s); 'untrained': the PARD base with "
                             "the mean embedding as mask embedding")
    export.add_argument("--target", default="qwen2.5-coder-1.5b-instruct", help="picks the shipped drafter")
    export.add_argument("--base", default=None, help="PARD: the base network (default: the adapter's base_model, or "
                                                     "the store's qwen2.5-coder-0.5b-instruct for 'untrained')")
    export.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    export.add_argument("--num-draft-tokens", type=int, default=None, help="PARD block size (default: the adapter's)")
    export.set_defaults(handler=run_export)

    adapter = sub.add_parser("pard-adapter", help="write the shippable adapter of a PARD run's checkpoint (the latest "
                                                  "or --step) without stopping the run")
    adapter.add_argument("--run", required=True, help="the run directory (--out of `dflash2 train pard`)")
    adapter.add_argument("--out", required=True, help="the adapter directory to write")
    adapter.add_argument("--step", type=int, default=None, help="the checkpoint's step (default: the latest)")
    adapter.add_argument("--default-num-draft-tokens", type=int, default=None,
                         help="the draft length users get by default (the one `dflash2 bench` measured fastest; "
                              "default: the trained one)")
    adapter.set_defaults(handler=run_pard_adapter)

    vocab = sub.add_parser("pard-vocab", help="give a PARD adapter a draft vocabulary (the head computes only the ids "
                                              "most frequent in the target's responses)")
    vocab.add_argument("--adapter", required=True, help="the adapter directory (pard_config.json)")
    vocab.add_argument("--data", required=True, help="regenerated token shard directories, comma-separated")
    vocab.add_argument("--size", type=int, default=65536, help="ids kept (default: %(default)s)")
    vocab.set_defaults(handler=run_pard_vocab)


def run_pard_vocab(args: argparse.Namespace) -> int:
    from dflash2.train.pard_trainer import write_draft_vocab

    print(write_draft_vocab(args.adapter, args.data, args.size))
    return 0


def run_export(args: argparse.Namespace) -> int:
    from dflash2.train.export import ExportError, export_drafter

    drafter = None if args.drafter == "untrained" else _shipped_drafter(args.drafter, args.target)
    try:
        result = export_drafter(drafter, args.engine, args.out, target=args.target, dtype=args.dtype,
                                num_draft_tokens=args.num_draft_tokens, base=args.base)
    except ExportError as error:
        print(f"dflash2 train export: {error}", file=sys.stderr)
        return 2
    print(result.out_dir)
    print(f"serve it with: {result.how_to_serve}")
    return 0


def _shipped_drafter(drafter: str, target: str) -> str:
    """'pard' / 'dflash' / 'dflash-llama.cpp' -> the directory shipped for ``target``; anything else is a path."""
    from dflash2.drafters import shipped_dflash_drafter
    from dflash2.train.pard_export import shipped_or_given_adapter

    if drafter == "pard":
        return str(shipped_or_given_adapter("", target))
    if drafter == "dflash":
        return str(shipped_dflash_drafter(target))
    return drafter


def run_pard_adapter(args: argparse.Namespace) -> int:
    from dflash2.train.pard_trainer import adapter_from_checkpoint

    print(adapter_from_checkpoint(args.run, args.out, args.step,
                                  default_num_draft_tokens=args.default_num_draft_tokens))
    return 0
