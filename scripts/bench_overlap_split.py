"""sync vs overlap on the 1.5B target with the 0.5B model drafter, interleaved per prompt (no plain baseline:
the machine was too loaded for it). Prints one line per request. Usage: bench_overlap_split.py [tokens] [--reverse]
[--only=sync:1,overlap:1] (pipeline:target threads)"""
import json, sys, torch, dflash2
from dflash2.bench.datasets import load_suite
torch.set_num_threads(2)
engine = dflash2.load("qwen2.5-coder-1.5b-instruct", drafter="model")
prompts = load_suite("humaneval", 1) + load_suite("gsm8k", 1)
configs = [("sync", 2, None), ("overlap", 2, 1), ("overlap", 1, 1), ("sync", 1, None)]
only = [a.split("=", 1)[1] for a in sys.argv if a.startswith("--only=")]  # e.g. --only=sync:1
if only:
    configs = [c for c in configs if f"{c[0]}:{c[1]}" in only[0].split(",")]
tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 64
if "--reverse" in sys.argv:  # a second round in the opposite order cancels a load that drifts during the run
    configs.reverse()
engine.generate("Say hello.", max_new_tokens=8)
for prompt in prompts:
    for pipeline, main_threads, draft_threads in configs:
        torch.set_num_threads(main_threads)
        engine.pipeline, engine.draft_threads = pipeline, draft_threads
        s = engine.generate(prompt.text, max_new_tokens=tokens).stats
        row = dict(suite=prompt.suite, pipeline=pipeline, main_threads=main_threads, draft_threads=draft_threads,
                   tok_s=round(s.decode_tokens_per_s, 3), tau=round(s.tau, 2), forwards=s.target_forwards,
                   draft_s=round(s.draft_seconds, 2), verify_s=round(s.verify_seconds, 2),
                   decode_s=round(s.decode_seconds, 2), hits=s.predraft_hits, predrafts=s.predrafts,
                   idle_target=round(s.target_idle_fraction, 3), idle_drafter=round(s.drafter_idle_fraction, 3))
        print(json.dumps(row), flush=True)
