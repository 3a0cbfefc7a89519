"""Continuous batching on a tiny random model: batched results equal single-request results."""

from __future__ import annotations

import pytest
import torch

from dflash2.decode.batch import BatchConfig, BatchEngine, BatchRequest, QueueFullError, request_drafters, run_to_completion
from dflash2.decode.engine import Engine
from dflash2.decode.ragged import WorkspaceCost
from dflash2.drafters.dflash import DFlashDrafter
from dflash2.drafters.ngram import NgramDrafter
from dflash2.models.loading import load_transformer
from dflash2.verify import SamplingParams


class IdTokenizer:
    """Token ids as text: enough for the engine's text stream (decode) and EOS handling."""

    eos_token_ids = frozenset({0})
    has_chat_template = False

    def decode(self, ids):
        return " ".join(map(str, ids))

    def encode(self, text):
        return [int(t) for t in text.split()]

    def encode_prompt(self, text):  # a raw prompt: no special tokens to add
        return self.encode(text)


@pytest.fixture(scope="module")
def engine(tiny_model_dirs):
    return Engine(load_transformer(tiny_model_dirs["qwen2"], "fp32", "cpu"), IdTokenizer(), name="tiny")


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    """Random prompts with repeats inside, so that the n-gram drafter finds matches (and misses)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        head = torch.randint(1, 256, (5 + i,), generator=g).tolist()
        out.append(head + head[:3] + torch.randint(1, 256, (2,), generator=g).tolist() + head)
    return out


def single(engine: Engine, prompt: list[int], request: BatchRequest) -> list[int]:
    """The single-request reference: Engine.generate with plain decoding or the n-gram drafter."""
    k = request.num_draft_tokens
    engine.drafter = NgramDrafter(k, stop_ids=engine.tokenizer.eos_token_ids) if k else None
    try:
        params = request.params
        result = engine.generate(" ".join(map(str, prompt)), max_new_tokens=request.max_new_tokens, raw=True, temperature=params.temperature,
                                 seed=params.seed)
    finally:
        engine.drafter = None
    return result.token_ids


@pytest.mark.parametrize("adaptive, prefill_chunk", [(False, 512), (True, 512), (False, 4)],
                         ids=["fixed-k", "adaptive-k", "chunked-prefill"])
def test_batched_greedy_equals_single_requests_with_mixed_draft_lengths(engine, adaptive, prefill_chunk):
    config = BatchConfig(num_blocks=64, block_size=8, adaptive_drafts=adaptive, max_prefill_tokens=prefill_chunk)
    batch = BatchEngine(engine, config, request_drafters(engine))
    draft_lengths = [0, 1, 3, 8, 0, 5]
    requests = [BatchRequest(p, 12 + 3 * i, drafter="ngram", num_draft_tokens=k)
                for i, (p, k) in enumerate(zip(prompts(len(draft_lengths)), draft_lengths))]
    for join_every in (0, 2):  # all at once, and joining while others run
        results = run_to_completion(batch, requests, join_every=join_every)
        for request, result in zip(requests, results):
            assert result.token_ids == single(engine, request.prompt_ids, request), (join_every, request)
    assert batch.pool.blocks_used == 0 and batch.pool.reserved == 0
    snap = batch.snapshot()
    assert sum(snap.requests_finished.values()) == 12 and set(snap.requests_finished) <= {"length", "eos"}
    if not adaptive:  # every request drafted its own length: the n-gram drafter was used and accepted something
        assert max(len(r.stats.drafted_by_position) for r in results) == 8
        assert sum(snap.stats.accepted_by_position) > 0


def test_seeded_sampling_is_reproducible_in_a_batch(engine):
    batch = BatchEngine(engine, BatchConfig(num_blocks=64, block_size=8), request_drafters(engine))
    params = SamplingParams(temperature=0.8, seed=7)
    request = BatchRequest(prompts(1)[0], 10, params=params, drafter="ngram", num_draft_tokens=3)
    others = [BatchRequest(p, 10, params=SamplingParams(temperature=1.0)) for p in prompts(3, seed=1)]
    alone = run_to_completion(batch, [request])[0].token_ids
    crowded = run_to_completion(batch, others[:2] + [request] + others[2:])[2].token_ids
    assert alone == crowded


def test_admission_reserves_kv_and_refuses(engine):
    batch = BatchEngine(engine, BatchConfig(num_blocks=4, block_size=8, max_queue=2, max_batch_size=1))
    with pytest.raises(ValueError, match="KV blocks"):  # 40 slots > 4 blocks of 8: can never run
        batch.submit(BatchRequest(prompts(1)[0], 30), lambda event: None)
    ok = BatchRequest([1, 2, 3], 4)
    batch.submit(ok, lambda event: None)
    batch.submit(ok, lambda event: None)
    with pytest.raises(QueueFullError):
        batch.submit(ok, lambda event: None)
    with pytest.raises(ValueError, match="context"):
        batch.submit(BatchRequest(list(range(1, 600)), 4), lambda event: None)


def test_cancelled_request_frees_its_blocks(engine):
    batch = BatchEngine(engine, BatchConfig(num_blocks=16, block_size=4))
    events = []
    handle = batch.submit(BatchRequest(prompts(1)[0], 40), events.append)
    batch.step()
    batch.step()
    assert batch.pool.blocks_used > 0 and len(events) == 2
    handle.cancel()
    assert batch.step() is False
    assert batch.pool.blocks_used == 0 and batch.pool.reserved == 0
    assert batch.snapshot().requests_finished == {"cancelled": 1}


def test_a_request_that_waits_too_long_for_kv_gets_a_budget_error(engine):
    from dflash2.kv.paged import KVBudgetError

    batch = BatchEngine(engine, BatchConfig(num_blocks=4, block_size=8, queue_timeout_s=0.0))
    first, second = [], []
    batch.submit(BatchRequest([1, 2, 3], 20), first.append)  # reserves 3 of the 4 blocks
    batch.submit(BatchRequest([4, 5, 6], 10), second.append)  # needs 2: waits, then times out
    batch.step()
    assert isinstance(second[-1], KVBudgetError) and batch.snapshot().requests_finished == {"error": 1}
    while batch.step():
        pass
    assert first[-1].finish_reason in ("length", "eos") and batch.pool.reserved == 0


def test_near_the_context_limit_batched_equals_single(engine):
    batch = BatchEngine(engine, BatchConfig(num_blocks=80, block_size=16), request_drafters(engine))
    long_prompt = (prompts(1)[0] * 40)[:495]  # the tiny model's context is 512
    requests = [BatchRequest(long_prompt, 40, drafter="ngram", num_draft_tokens=8), BatchRequest(prompts(1)[0], 9)]
    results = run_to_completion(batch, requests)
    assert results[0].finish_reason == "length" and len(results[0].token_ids) == 512 - 495 + 1  # the last one is never fed
    for request, result in zip(requests, results):
        assert result.token_ids == single(engine, request.prompt_ids, request)


class RecordingDFlash(DFlashDrafter):
    """A DFlash drafter that logs every proposal: (committed length, drafted ids)."""

    def __init__(self, model, target, k, log: list) -> None:
        super().__init__(model, target, k)
        self.log = log

    def propose(self, sequence, num_draft_tokens, params, generator):
        draft = super().propose(sequence, num_draft_tokens, params, generator)
        self.log.append((len(sequence), draft.tokens.tolist()))
        return draft


def block_model(kind: str, target):
    """An untrained DFlash drafter model, or a DFlash2 one whose selector and convolutions change the drafts."""
    from tests.unit.drafters.test_dflash2 import dflash2_model
    from tests.unit.drafters.test_dflash_drafter import make_model

    return make_model(target, 8) if kind == "dflash" else dflash2_model(target)


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
@pytest.mark.parametrize("prefill_chunk", [512, 5], ids=["whole-prompt", "chunked-prefill"])
def test_dflash_drafter_in_a_batch_sees_the_context_it_sees_alone(engine, prefill_chunk, kind):
    """The batch hands each request's DFlash drafter the target's hidden states of exactly the committed
    positions (prompt chunks, then pending + accepted): its proposals, not only the outputs, equal those of the
    same request decoded alone (DFlash2: through its selector walk)."""
    target, k = engine.target, 5
    model = block_model(kind, target)
    batch_logs: list[list] = []

    def factory():
        batch_logs.append([])
        return RecordingDFlash(model, target, k, batch_logs[-1])

    config = BatchConfig(num_blocks=64, block_size=8, adaptive_drafts=False, max_prefill_tokens=prefill_chunk)
    batch = BatchEngine(engine, config, {"dflash": factory})
    requests = [BatchRequest(p, 14 + 2 * i, drafter="dflash", num_draft_tokens=k if i != 1 else 3)
                for i, p in enumerate(prompts(3))] + [BatchRequest(prompts(1, seed=5)[0], 10)]
    results = run_to_completion(batch, requests, join_every=2)
    for request, result, log in zip(requests, results, batch_logs):
        alone: list = []
        engine.drafter = RecordingDFlash(model, target, request.num_draft_tokens, alone)
        try:
            expected = engine.generate(" ".join(map(str, request.prompt_ids)), max_new_tokens=request.max_new_tokens,
                                       raw=True).token_ids
        finally:
            engine.drafter = None
        assert result.token_ids == expected
        assert [length for length, _ in log] == [length for length, _ in alone]
        for (_, drafted), (_, drafted_alone) in zip(log, alone):  # the room left may shorten the last drafts
            common = min(len(drafted), len(drafted_alone))
            assert drafted[:common] == drafted_alone[:common]
    assert len(batch_logs) == 3 and all(batch_logs)


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_dflash_drafters_are_offered_when_the_engine_holds_one(engine, kind):
    from dflash2.drafters.hybrid import HybridDrafter

    engine.drafter = HybridDrafter(DFlashDrafter(block_model(kind, engine.target), engine.target), stop_ids={0})
    assert engine.drafter.name == f"{kind}+ngram"  # the server's default request drafter
    try:
        factories = request_drafters(engine)
    finally:
        engine.drafter = None
    assert set(factories) == {"ngram", kind, f"{kind}+ngram"}
    first, second = factories[kind](), factories[kind]()
    assert first is not second and first.model is second.model  # own context cache, shared weights
    assert isinstance(factories[f"{kind}+ngram"](), HybridDrafter)


@pytest.mark.parametrize("kind", ["ngram", "dflash", "dflash2"])
def test_trees_in_a_batch_give_each_request_its_plain_tokens(engine, kind):
    """n-gram trees (W continuations) and block-drafter trees (the chain + the likeliest branches) verified in
    the ragged forward (tree masks and positions per row) and committed by compaction of the paged cache: every
    request of a mixed batch gets its plain greedy tokens; a seeded sampled request the same tokens alone or in a
    crowd."""
    if kind == "ngram":
        factory = lambda: NgramDrafter(4, stop_ids={0}, num_candidates=3)  # noqa: E731
    else:
        model = block_model(kind, engine.target)
        factory = lambda: DFlashDrafter(model, engine.target, 3, num_paths=3)  # noqa: E731
    batch = BatchEngine(engine, BatchConfig(num_blocks=64, block_size=8, adaptive_drafts=False), {kind: factory})
    requests = [BatchRequest(p, 14 + 2 * i, drafter=kind, num_draft_tokens=4 if kind == "ngram" else 3)
                for i, p in enumerate(prompts(3))] + [BatchRequest(prompts(1, seed=4)[0], 10)]
    results = run_to_completion(batch, requests, join_every=2)
    for request, result in zip(requests, results):
        assert result.token_ids == single(engine, request.prompt_ids, BatchRequest(request.prompt_ids,
                                                                                  request.max_new_tokens))
    assert any(len(r.stats.drafted_by_position) for r in results[:3])
    assert batch.pool.blocks_used == 0 and batch.pool.reserved == 0
    seeded = BatchRequest(prompts(1)[0], 10, params=SamplingParams(temperature=0.9, seed=3), drafter=kind,
                          num_draft_tokens=3)
    alone = run_to_completion(batch, [seeded])[0].token_ids
    crowd = [BatchRequest(p, 8, params=SamplingParams(temperature=1.0)) for p in prompts(2, seed=6)]
    assert run_to_completion(batch, crowd[:1] + [seeded] + crowd[1:])[1].token_ids == alone


def test_drafter_memory_stays_within_its_budget(engine):
    """16 requests, one with a long prompt, each with a DFlash drafter keeping its own context cache: the caches
    the running requests hold never exceed the drafter memory budget (requests wait for room instead), the
    reservation equals what is held, every request still gets its plain tokens, and a request whose drafter
    alone exceeds the budget is refused at once."""
    model = block_model("dflash", engine.target)
    factory = lambda: DFlashDrafter(model, engine.target, 3)  # noqa: E731
    probe = factory()
    long_prompt = (prompts(1)[0] * 20)[:300]
    requests = [BatchRequest(long_prompt, 8, drafter="dflash", num_draft_tokens=3)] + [
        BatchRequest(p, 8 + i % 5, drafter="dflash", num_draft_tokens=3) for i, p in enumerate(prompts(15))]
    budget = probe.state_bytes(len(long_prompt) + 8 + 4) + 4 * probe.state_bytes(40)  # the long one + about 4
    # attention's padded workspace: room for the long prompt and one more such row, not for the batch padded to it
    workspace = WorkspaceCost.of(engine.target).bytes(2, len(long_prompt), len(long_prompt) + 16)
    batch = BatchEngine(engine, BatchConfig(num_blocks=256, block_size=8, drafter_memory_bytes=budget,
                                            attention_workspace_bytes=workspace), {"dflash": factory})
    events: list[list] = [[] for _ in requests]
    for request, sink in zip(requests, events):
        batch.submit(request, sink.append)
    peak, waited = 0, False
    while batch.step():
        held = sum(seq.drafter.held_bytes() for seq in batch._running)
        assert held <= batch._drafter_bytes <= budget
        peak, waited = max(peak, held), waited or bool(batch._waiting)
    assert peak > budget // 2 and waited  # the budget was used and some requests had to wait for it
    assert batch._drafter_bytes == 0 and batch.pool.reserved == 0
    assert 0 < batch.snapshot().attention_workspace_peak <= workspace
    for request, sink in zip(requests, events):
        assert sink[-1].token_ids == single(engine, request.prompt_ids, BatchRequest(request.prompt_ids,
                                                                                    request.max_new_tokens))
    too_big = BatchEngine(engine, BatchConfig(num_blocks=256, block_size=8, drafter_memory_bytes=budget // 10),
                          {"dflash": factory})
    with pytest.raises(ValueError, match="drafter memory budget"):
        too_big.submit(requests[0], lambda event: None)


def _run_recording_first_pass(batch, requests, join_every):
    """Run ``requests`` to completion; also returns, per pard drafter (by id), (ids in its cache, ids its window
    left out) when it first drafted."""
    from dflash2.drafters.pard import PardDrafter

    first_pass: dict[int, tuple[int, int]] = {}
    original = PardDrafter._prepare_pass  # every pass starts here, alone or batched with other requests'

    def recording(self, sequence, num_draft_tokens):
        first_pass.setdefault(id(self), (self.cache.length, self.skipped))
        return original(self, sequence, num_draft_tokens)

    PardDrafter._prepare_pass = recording
    try:
        return run_to_completion(batch, requests, join_every=join_every), first_pass
    finally:
        PardDrafter._prepare_pass = original


@pytest.mark.parametrize("width", [1, 2], ids=["chain", "tree"])
@pytest.mark.parametrize("prefill_chunk", [512, 5], ids=["whole-prompt", "chunked-prefill"])
def test_pard_in_a_batch_reads_prompt_chunks_in_prefill_and_gives_plain_tokens(engine, tiny_model_dirs, prefill_chunk,
                                                                               width):
    """A draft model in the batch (pard+ngram, chain or tree): its cache reads each prompt chunk as the target
    prefills it (so the first draft pass feeds only the pending id), and every request of a mixed batch gets its
    plain greedy tokens."""
    from dflash2.drafters.hybrid import HybridDrafter
    from dflash2.drafters.pard import PardDrafter

    drafter_model = load_transformer(tiny_model_dirs["qwen2_other"], "fp32", "cpu")
    made: list[PardDrafter] = []

    def factory():
        made.append(PardDrafter(drafter_model, 255, 3, num_paths=width))
        return HybridDrafter(made[-1], 8, stop_ids={0})

    config = BatchConfig(num_blocks=64, block_size=8, adaptive_drafts=False, max_prefill_tokens=prefill_chunk)
    batch = BatchEngine(engine, config, {"pard+ngram": factory})
    requests = [BatchRequest(p, 12 + 2 * i, drafter="pard+ngram", num_draft_tokens=8) for i, p in enumerate(prompts(3))]
    requests.append(BatchRequest(prompts(1, seed=5)[0], 10))  # plain decoding among them
    results, first_pass = _run_recording_first_pass(batch, requests, join_every=2)
    cached_at_first_pass = {key: cached for key, (cached, _) in first_pass.items()}
    for request, result in zip(requests, results):
        assert result.token_ids == single(engine, request.prompt_ids, BatchRequest(request.prompt_ids,
                                                                                  request.max_new_tokens))
    shortest_prompt = min(len(r.prompt_ids) for r in requests[:3])
    assert len(made) == 3 and len(cached_at_first_pass) == 3  # each request's own drafter drafted
    assert min(cached_at_first_pass.values()) >= shortest_prompt  # the prompt was read in prefill, not drafting
    assert batch.pool.blocks_used == 0 and batch.pool.reserved == 0


def test_a_chunked_long_prompt_reaches_the_drafter_through_its_context_window(engine, tiny_model_dirs):
    """--max-prefill-tokens splits a prompt longer than the pard drafter's window (sink 2, recent 5): the drafter
    reads it once, at its last chunk, through the window (the first 2 and last 5 ids), and the tokens stay plain."""
    from dflash2.drafters.pard import PardDrafter

    drafter_model = load_transformer(tiny_model_dirs["qwen2_other"], "fp32", "cpu")
    config = BatchConfig(num_blocks=64, block_size=8, adaptive_drafts=False, max_prefill_tokens=5)
    batch = BatchEngine(engine, config, {"pard": lambda: PardDrafter(drafter_model, 255, 3, context_window=(2, 5))})
    requests = [BatchRequest(p, 12, drafter="pard", num_draft_tokens=3) for p in prompts(2)]
    results, at_first_pass = _run_recording_first_pass(batch, requests, join_every=1)
    for request, result in zip(requests, results):
        assert result.token_ids == single(engine, request.prompt_ids, BatchRequest(request.prompt_ids, 12))
    lengths = sorted(len(r.prompt_ids) for r in requests)
    assert sorted(at_first_pass.values()) == [(7, n - 7) for n in lengths]


@pytest.mark.parametrize("fails", [False, True], ids=["batched", "batched-pass-fails"])
def test_pard_drafters_of_a_batch_share_one_pass_per_step(engine, tiny_model_dirs, fails, monkeypatch):
    """The running requests' pard drafts come from ONE forward of the drafter network per step (propose_batch);
    if that forward fails, each request drafts alone; either way every request gets its plain greedy tokens and a
    seeded sampled request the tokens it gets alone."""
    from dflash2.drafters import pard
    from dflash2.drafters.pard import PardDrafter

    drafter_model = load_transformer(tiny_model_dirs["qwen2_other"], "fp32", "cpu")
    sizes: list[int] = []
    original = pard.propose_batch

    def counting(requests):
        sizes.append(len(requests))
        if fails and len(requests) > 1:
            raise RuntimeError("injected failure of the batched pass")
        return original(requests)

    monkeypatch.setattr(pard, "propose_batch", counting)
    config = BatchConfig(num_blocks=96, block_size=8, adaptive_drafts=False)
    batch = BatchEngine(engine, config, {"pard": lambda: PardDrafter(drafter_model, 255, 3)})
    requests = [BatchRequest(p, 14, drafter="pard", num_draft_tokens=3) for p in prompts(3)]
    results = run_to_completion(batch, requests)
    for request, result in zip(requests, results):
        assert result.token_ids == single(engine, request.prompt_ids, BatchRequest(request.prompt_ids, 14))
        assert sum(result.stats.drafted_by_position) > 0
    assert max(sizes) == 3  # all three drafted in one pass
    seeded = BatchRequest(prompts(1, seed=9)[0], 12, params=SamplingParams(temperature=0.8, seed=3), drafter="pard",
                          num_draft_tokens=3)
    alone = run_to_completion(batch, [seeded])[0].token_ids
    assert run_to_completion(batch, requests[:2] + [seeded])[2].token_ids == alone


def test_a_hybrid_drafter_counts_the_steps_its_block_drafter_drafted_in_a_shared_pass(engine, tiny_model_dirs,
                                                                                     monkeypatch):
    """pard+ngram in the batch engine: every draft of the shared pass is one of the hybrid's block steps."""
    from dflash2.drafters import pard
    from dflash2.drafters.hybrid import HybridDrafter
    from dflash2.drafters.pard import PardDrafter

    drafter_model = load_transformer(tiny_model_dirs["qwen2_other"], "fp32", "cpu")
    shared: list[int] = []
    original = pard.propose_batch

    def counting(requests):
        if len(requests) > 1:
            shared.append(len(requests))
        return original(requests)

    monkeypatch.setattr(pard, "propose_batch", counting)
    made: list[HybridDrafter] = []

    def factory():
        made.append(HybridDrafter(PardDrafter(drafter_model, 255, 3), 3))
        return made[-1]

    batch = BatchEngine(engine, BatchConfig(num_blocks=96, block_size=8, adaptive_drafts=False), {"pard": factory})
    requests = [BatchRequest(p, 10, drafter="pard", num_draft_tokens=3) for p in prompts(3)]
    run_to_completion(batch, requests)
    assert sum(shared) > 0
    assert sum(d.block_steps for d in made) >= sum(shared)
