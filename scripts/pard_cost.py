"""What one PARD draft pass costs next to one verify pass of the target (issue #20 item 4: <= 25%).

A draft pass: the 0.5B over 1 pending id + (k - 1) masks (k rows, the head on all of them), as ``PardDrafter``
runs it. A verify pass: the 1.5B over k + 1 rows (the pending id + k drafts), logits on every row, as the engine
verifies a chain. Both at the same context (``--context`` ids already cached), timed alternately (so a change of
the machine's load hits both), the median of ``--repeats``. Drafter weight formats side by side.

    nice -n 19 .venv/bin/python scripts/pard_cost.py --threads 1 --drafter-weights bf16,int8
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--target-weights", default="bf16", choices=("bf16", "int8", "int4", "gguf"))
    parser.add_argument("--drafter-weights", default="bf16,int8",
                        help="comma-separated: bf16, int8, int4, q8_0, q4_0; a suffix :vocab uses the adapter's draft "
                             "vocabulary")
    parser.add_argument("--adapter", default="", help="adapter directory ('' = shipped if any, else untrained)")
    parser.add_argument("-k", "--num-draft-tokens", type=int, default=0,
                        help="drafts per pass (0: the adapter's default_num_draft_tokens, else 8)")
    parser.add_argument("--accepted", type=int, default=0,
                        help="ids accepted in the last step, fed to the draft pass before the pending one (a pass "
                             "after a step that accepted a drafts reads a + 1 ids + k - 1 masks)")
    parser.add_argument("--context", type=int, default=300, help="ids in the caches before the timed passes")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from dflash2.drafters.pard import PardDrafter, load_pard_model
    from dflash2.models.loading import load_transformer
    from dflash2.models.store import resolve_model
    from dflash2.train.pard_export import shipped_or_given_adapter

    try:
        adapter = shipped_or_given_adapter(args.adapter, args.target)
    except ValueError:
        adapter = None
    from dflash2.drafters.pard import PardConfig

    k = args.num_draft_tokens or (adapter and PardConfig.load(adapter).default_num_draft_tokens) or 8
    prompt = list(range(1000, 1000 + args.context))
    fed = 1 + args.accepted  # ids the draft cache has not seen: the accepted drafts and the pending token
    target = load_transformer(resolve_model(args.target, "bf16"), "bf16", weights=args.target_weights)
    base = resolve_model("qwen2.5-coder-0.5b-instruct", "bf16")
    drafters = {}
    for variant in args.drafter_weights.split(","):
        weights, _, vocab = variant.partition(":")
        model, config = load_pard_model(adapter, base, "bf16", weights=weights, draft_vocab=vocab == "vocab")
        drafters[variant] = PardDrafter(model, config.mask_token_id, k)
        drafters[variant].reset(args.context + 64)
    cache = target.new_cache(args.context + 64)
    times: dict[str, list[float]] = {name: [] for name in ["verify", *drafters]}
    with torch.inference_mode():
        target(torch.tensor([prompt]), cache=cache, logits="last")
        for drafter in drafters.values():
            drafter.draft_logits(prompt, k)
        for i in range(args.repeats + 1):
            for name, drafter in drafters.items():  # accepted + pending ids + k - 1 masks after the cached prompt
                drafter.cache.rollback(args.context - fed)
                drafter.cached_tokens = drafter.cached_tokens[: args.context - fed]
                started = time.perf_counter()
                drafter.draft_logits(prompt, k)
                times[name].append(time.perf_counter() - started)
            started = time.perf_counter()
            target(torch.tensor([[7] * (k + 1)]), cache=cache)
            times["verify"].append(time.perf_counter() - started)
            cache.rollback(args.context)
    median = {name: statistics.median(values[1:]) for name, values in times.items()}  # the first run warms up
    print(f"target {args.target} ({args.target_weights}), verify pass of {k + 1} rows at context {args.context}: "
          f"{median['verify'] * 1e3:.0f} ms (threads {torch.get_num_threads()}, adapter {adapter or 'untrained'})")
    for name in drafters:
        print(f"pard drafter ({name}), draft pass of {fed + k - 1} rows ({fed} ids + {k - 1} masks): "
              f"{median[name] * 1e3:.0f} ms = "
              f"{median[name] / median['verify']:.2f} x verify")


if __name__ == "__main__":
    main()
