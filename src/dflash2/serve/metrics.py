"""Prometheus text exposition of the server's counters and the batch engine's snapshot."""

from __future__ import annotations

import threading
from collections import Counter

from dflash2.decode.batch import BatchSnapshot


class HttpCounters:
    """HTTP responses by route and status (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[tuple[str, int]] = Counter()

    def add(self, route: str, status: int) -> None:
        with self._lock:
            self._counts[(route, status)] += 1

    def items(self) -> list[tuple[tuple[str, int], int]]:
        with self._lock:
            return sorted(self._counts.items())


def render(snapshot: BatchSnapshot, http: HttpCounters) -> str:
    lines: list[str] = []

    def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
        lines.append(f"# HELP dflash2_{name} {help_text}")
        lines.append(f"# TYPE dflash2_{name} {kind}")
        lines.extend(f"dflash2_{name}{labels} {value:g}" for labels, value in samples)

    stats = snapshot.stats
    metric("http_requests_total", "counter", "HTTP responses by route and status.",
           [(f'{{route="{route}",status="{status}"}}', n) for (route, status), n in http.items()])
    metric("requests_finished_total", "counter", "Generation requests that left the engine, by reason.",
           [(f'{{reason="{reason}"}}', n) for reason, n in sorted(snapshot.requests_finished.items())])
    metric("requests_rejected_total", "counter", "Requests refused because the queue was full.",
           [("", snapshot.requests_rejected)])
    metric("prompt_tokens_total", "counter", "Prompt tokens of admitted requests.", [("", snapshot.prompt_tokens)])
    metric("generation_tokens_total", "counter", "Tokens generated.", [("", snapshot.generated_tokens)])
    metric("steps_total", "counter", "Ragged target forwards (engine steps).", [("", snapshot.steps)])
    metric("target_row_forwards_total", "counter", "Decode rows verified (one per request per step).",
           [("", stats.target_forwards)])
    metric("tau", "gauge", "Tokens committed per verified decode row, finished requests pooled.", [("", stats.tau)])
    metric("draft_acceptance", "gauge", "Acceptance rate of the i-th draft position (1-based), pooled.",
           [(f'{{position="{i + 1}"}}', rate) for i, rate in enumerate(stats.acceptance_by_position)])
    metric("queue_depth", "gauge", "Requests waiting for admission.", [("", snapshot.queue_depth)])
    metric("batch_size", "gauge", "Requests in the running batch.", [("", snapshot.batch_size)])
    metric("kv_blocks_used", "gauge", "KV cache blocks in use.", [("", snapshot.kv_blocks_used)])
    metric("kv_blocks_total", "gauge", "KV cache blocks in the pool (the memory budget).",
           [("", snapshot.kv_blocks_total)])
    metric("drafter_memory_bytes", "gauge", "Memory reserved for the running requests' drafter caches.",
           [("", snapshot.drafter_bytes_reserved)])
    metric("attention_workspace_peak_bytes", "gauge",
           "The largest padded attention workspace of one step so far (per layer, transient).",
           [("", snapshot.attention_workspace_peak)])
    metric("attention_workspace_budget_bytes", "gauge", "The per-step attention workspace budget.",
           [("", snapshot.attention_workspace_budget)])
    prefix = snapshot.prefix_cache
    if prefix is not None:
        metric("prefix_cache_queried_tokens_total", "counter", "Prompt tokens looked up in the prefix cache.",
               [("", prefix.queried_tokens)])
        metric("prefix_cache_hit_tokens_total", "counter", "Prompt tokens found in the prefix cache (not computed).",
               [("", prefix.hit_tokens)])
        metric("prefix_cache_hit_rate", "gauge", "Share of prompt tokens found in the prefix cache since start.",
               [("", prefix.hit_tokens / prefix.queried_tokens if prefix.queried_tokens else 0.0)])
        metric("prefix_cache_blocks", "gauge", "KV blocks in the prefix cache (held by requests or evictable).",
               [("", prefix.blocks_cached)])
        metric("prefix_cache_evictable_blocks", "gauge", "Cached KV blocks no request holds (handed out on demand).",
               [("", prefix.blocks_evictable)])
    if snapshot.drafter_bytes_budget is not None:
        metric("drafter_memory_budget_bytes", "gauge", "The drafters' per-request memory budget.",
               [("", snapshot.drafter_bytes_budget)])
    return "\n".join(lines) + "\n"
