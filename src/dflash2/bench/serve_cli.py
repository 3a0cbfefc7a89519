"""``dflash2 bench serve MODE [options]``: the serving benchmarks, each a module of its own with its own options.

- ``http``: `dflash2 serve` (speculative and plain) against llama.cpp's llama-server over real HTTP, C closed-loop
  clients each (:mod:`dflash2.bench.serve_http`);
- ``batch``: the batch engine's aggregate throughput, S streams, speculation off / fixed / adaptive, without HTTP
  (:mod:`dflash2.bench.serve_batch`);
- ``load``: the soak: good and bad clients mixed, long and short prompts, cancellations, memory growth, a SIGKILL
  and a restart (:mod:`dflash2.bench.serve_load`);
- ``ttft``: time to first token of a conversation's second turn with and without the prefix cache
  (:mod:`dflash2.bench.serve_ttft`).

``dflash2 bench serve MODE --help`` lists a mode's options. The modules need the ``serve`` extra (httpx, openai).
"""

from __future__ import annotations

import importlib
import sys
from typing import Sequence

MODES = {"http": "dflash2.bench.serve_http", "batch": "dflash2.bench.serve_batch",
         "load": "dflash2.bench.serve_load", "ttft": "dflash2.bench.serve_ttft"}


def main(argv: Sequence[str]) -> int:
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in MODES:
        print(__doc__.strip(), file=sys.stderr if argv and argv[0] not in ("-h", "--help") else sys.stdout)
        if argv and argv[0] not in ("-h", "--help"):
            print(f"\ndflash2 bench serve: unknown mode {argv[0]!r}; one of {', '.join(MODES)}", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    module = importlib.import_module(MODES[argv[0]])
    sys.argv[0] = f"dflash2 bench serve {argv[0]}"  # the mode's --help names the command that runs it
    return module.main(list(argv[1:])) or 0
