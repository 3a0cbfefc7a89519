"""``dflash2 serve``: load the target (and drafter), start the batch engine loop, run uvicorn on 127.0.0.1:8000."""

from __future__ import annotations

import argparse
import logging
import sys

from dflash2 import platform
from dflash2.cli_common import CliError, add_model_options, drafter_spec, load_engine

API_KEY_ENV = "DFLASH2_API_KEY"


def add_serve_parser(commands) -> None:
    p = commands.add_parser("serve", help="OpenAI-compatible HTTP server with continuous batching",
                            description="Serve /v1/chat/completions, /v1/completions, /v1/models, /health, /metrics.")
    add_model_options(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: %(default)s, loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help=f"require this bearer key on /v1/* (default: ${API_KEY_ENV})")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: --model)")
    p.add_argument("--max-batch-size", type=int, default=16, help="requests decoded together (default: %(default)s)")
    p.add_argument("--kv-memory-mb", type=float, default=1024.0, help="KV cache budget (default: %(default)s MiB)")
    p.add_argument("--drafter-memory-mb", type=float, default=None,
                   help="budget of the drafters' per-request caches (a model / block drafter keeps its own KV "
                        "cache per request; default: the --kv-memory-mb value)")
    p.add_argument("--attention-workspace-mb", type=float, default=64.0,
                   help="attention's padded transient memory per layer in one step: the batch's rows attend in "
                        "groups that fit (a longer row alone gets its own group) (default: %(default)s MiB)")
    p.add_argument("--block-size", type=int, default=16, help="KV slots per block (default: %(default)s)")
    p.add_argument("--max-queue", type=int, default=64, help="waiting requests before 429 (default: %(default)s)")
    p.add_argument("--queue-timeout", type=float, default=60.0, help="seconds a request may wait for KV before 503")
    p.add_argument("--max-prefill-tokens", type=int, default=512,
                   help="prompt tokens fed per step; longer prompts are prefilled in chunks (default: %(default)s)")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="do not keep the KV blocks of earlier prompts for reuse (default: a request starts from the "
                        "longest cached prefix of its prompt)")
    p.add_argument("--fixed-draft-length", action="store_true",
                   help="always draft the requested length (default: the scheduler lowers it under load)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="the most new tokens a request may ask for, and what one that sets no max_tokens gets "
                        "(default: up to the end of the model's context; admission reserves a request's worst case "
                        "of KV blocks, so a server for many clients should set it)")
    p.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"),
                   help="server log level; 'info' adds an access log line per request and a line naming the "
                        "ignored fields of a request (default: %(default)s)")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger bodies get 413 (default: 1 MiB)")
    p.add_argument("--max-num-draft-tokens", type=int, default=16,
                   help="the most drafts per step a request may ask for (default: %(default)s)")
    p.add_argument("--request-timeout", type=float, default=None,
                   help="seconds a request may take from arrival: a running one ends with what it has (finish reason "
                        "'length', dflash2.finish_reason 'timeout'), a queued one gets 504 (default: none; requests "
                        "may ask for less with dflash2.timeout_s)")
    p.add_argument("--allowed-origins", default=None,
                   help="comma-separated browser origins allowed to call the API, or '*' (default: the loopback "
                        "hosts on any port; requests with another Origin header get 403)")
    p.set_defaults(handler=run_serve)


def build_server(args: argparse.Namespace):
    """(app, batch engine) from parsed arguments; the engine loop is not started yet."""
    from dflash2.decode.batch import BatchConfig, BatchEngine, prefix_tap_layers, request_drafters
    from dflash2.kv.paged import PagedKVPool
    from dflash2.serve.app import ServerConfig, create_app

    if args.num_draft_tokens is not None and args.num_draft_tokens <= 0:
        raise CliError(f"--num-draft-tokens must be > 0, got {args.num_draft_tokens}")
    if args.max_tokens is not None and args.max_tokens < 1:
        raise CliError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if args.request_timeout is not None and not args.request_timeout > 0:
        raise CliError(f"--request-timeout must be > 0 seconds, got {args.request_timeout}")
    spec = drafter_spec(args)
    engine = load_engine(args, spec, serving=True)  # auto: the drafter measured fastest when serving
    c = engine.target.config
    taps = () if args.no_prefix_cache else prefix_tap_layers(engine)  # hidden states the pool keeps per slot
    per_block = PagedKVPool.bytes_per_block(c.num_layers, c.num_kv_heads, c.head_dim, args.block_size,
                                            engine.target.dtype, tap_width=len(taps) * c.hidden_size)
    num_blocks = int(args.kv_memory_mb * 2**20 // per_block)
    if num_blocks < 1:
        raise CliError(f"--kv-memory-mb {args.kv_memory_mb} holds no KV block ({per_block} bytes each)")
    config = BatchConfig(max_batch_size=args.max_batch_size, num_blocks=num_blocks, block_size=args.block_size,
                         max_queue=args.max_queue, queue_timeout_s=args.queue_timeout,
                         adaptive_drafts=not args.fixed_draft_length, max_prefill_tokens=args.max_prefill_tokens,
                         attention_workspace_bytes=max(1, int(args.attention_workspace_mb * 2**20)),
                         drafter_memory_bytes=int(_or(args.drafter_memory_mb, args.kv_memory_mb) * 2**20),
                         prefix_cache=not args.no_prefix_cache)
    batch = BatchEngine(engine, config, request_drafters(engine, spec.num_draft_tokens))
    drafter = "none" if engine.drafter is None else engine.drafter.name  # "auto" resolved to the one built
    num_draft_tokens = 0 if engine.drafter is None else engine.drafter.num_draft_tokens
    server = ServerConfig(model_name=args.served_model_name or args.model,
                          api_key=args.api_key or platform.settings().api_key,
                          default_drafter=drafter, default_num_draft_tokens=num_draft_tokens,
                          max_tokens=args.max_tokens, max_body_bytes=args.max_body_bytes,
                          max_num_draft_tokens=max(args.max_num_draft_tokens, num_draft_tokens),
                          request_timeout_s=args.request_timeout, allowed_origins=_origins(args.allowed_origins))
    return create_app(batch, server), batch


def _origins(flag: str | None) -> tuple[str, ...] | None:
    """--allowed-origins 'https://a.example,https://b.example' -> a tuple (None: the loopback default)."""
    if flag is None:
        return None
    origins = tuple(o.strip() for o in flag.split(",") if o.strip())
    if not origins:
        raise CliError("--allowed-origins is empty; give origins like https://app.example, or '*'")
    return origins


def run_serve(args: argparse.Namespace) -> int:
    try:
        import uvicorn
    except ImportError:
        raise CliError("serving needs the serve extra: pip install 'dflash2[serve]'") from None
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app, batch = build_server(args)
    batch.start()
    drafter = batch.engine.drafter
    drafting = "no drafter" if drafter is None else f"drafter {drafter.name}, k = {drafter.num_draft_tokens}"
    print(f"dflash2: serving {args.served_model_name or args.model} on http://{args.host}:{args.port} "
          f"({drafting}; {batch.pool.num_blocks} KV blocks of {batch.pool.block_size})", file=sys.stderr, flush=True)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=True,
                    timeout_graceful_shutdown=5)
    finally:
        batch.stop()
    return 0


def _or(value: float | None, default: float) -> float:
    return default if value is None else value
