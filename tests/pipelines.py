"""Run the speculative core through either pipeline, so that lossless tests cover both."""

from __future__ import annotations

import functools

from dflash2.decode.overlap import PIPELINES, DraftWorker, overlap_decode
from dflash2.decode.speculative import speculative_decode

__all__ = ["PIPELINES", "speculative_steps"]


@functools.cache
def shared_worker() -> DraftWorker:
    """One drafter thread (one intra-op thread) for every overlap test: tiny models, 2 cores."""
    return DraftWorker("cpu", num_threads=1)


def speculative_steps(pipeline, target, drafter, prompt, params, generator, capacity, stats, policy=None):
    """The committed tokens per target pass of ``pipeline`` ("sync" | "overlap")."""
    if pipeline == "sync":
        return speculative_decode(target, drafter, prompt, params, generator, capacity, stats, policy)
    if pipeline == "overlap":
        return overlap_decode(target, drafter, prompt, params, generator, capacity, stats, shared_worker(), policy)
    raise ValueError(f"unknown pipeline {pipeline!r}")
