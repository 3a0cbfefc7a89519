"""Chain rejection sampling: the edge cases of reference section 7, with pinned uniforms where it matters."""

import pytest
import torch

from dflash2.verify import PAD_ID, verify_chain

VOCAB = 6


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def one_hot(ids: list[list[int]], vocab: int = VOCAB) -> torch.Tensor:
    """[batch, positions] ids -> [batch, positions, vocab] float32 one-hot distributions."""
    return torch.nn.functional.one_hot(torch.tensor(ids), vocab).float()


def random_probs(*shape: int, seed: int = 0) -> torch.Tensor:
    """[*shape, VOCAB] strictly positive distributions."""
    return torch.softmax(torch.randn(*shape, VOCAB, generator=gen(seed)), dim=-1)


def test_all_accepted_then_bonus_from_last_position():
    # p(x) >= q(x) at every draft: accepted whatever the uniforms (u < 1)
    p_target = torch.cat([one_hot([[2, 4, 1]]), one_hot([[5]])], dim=1)  # [1, 4, vocab]; bonus is certain
    q_draft = random_probs(1, 3)
    verdict = verify_chain(torch.tensor([[2, 4, 1]]), p_target, q_draft, gen(), uniforms=torch.full((1, 3), 0.999))
    assert verdict.num_accepted.tolist() == [3]
    assert verdict.num_emitted.tolist() == [4]
    assert verdict.tokens.tolist() == [[2, 4, 1, 5]]


def test_first_rejected_emits_one_recovered_token():
    # p(x_0) == 0: always rejected; the residual max(p - q, 0) lives on token 3 only
    p_target = one_hot([[3, 4, 1, 5]])
    q_draft = random_probs(1, 3)
    for seed in range(5):
        verdict = verify_chain(torch.tensor([[0, 4, 1]]), p_target, q_draft, gen(seed))
        assert verdict.num_accepted.tolist() == [0]
        assert verdict.tokens.tolist() == [[3, PAD_ID, PAD_ID, PAD_ID]]


def test_zero_drafts_emit_bonus_only():
    p_target = one_hot([[4], [1]])  # [2, 1, vocab]
    verdict = verify_chain(torch.zeros(2, 0, dtype=torch.int64), p_target, torch.zeros(2, 0, VOCAB), gen())
    assert verdict.num_accepted.tolist() == [0, 0]
    assert verdict.tokens.tolist() == [[4], [1]]
    verdict = verify_chain(torch.zeros(2, 0, dtype=torch.int64), p_target, None, gen())
    assert verdict.tokens.tolist() == [[4], [1]]


def test_acceptances_after_a_rejection_are_ignored():
    p_target = torch.full((1, 4, VOCAB), 1.0 / VOCAB)
    q_draft = one_hot([[0, 1, 2]]) * 0.5 + 0.5 / VOCAB  # q(x_i) > p(x_i): acceptance decided by the uniform
    uniforms = torch.tensor([[0.0, 1.0, 0.0]])  # accept, reject, (would accept)
    verdict = verify_chain(torch.tensor([[0, 1, 2]]), p_target, q_draft, gen(), uniforms=uniforms)
    assert verdict.num_accepted.tolist() == [1]
    assert verdict.tokens[0, 0].item() == 0
    assert verdict.tokens[0, 1].item() != 1  # residual max(p - q, 0) is zero at the rejected draft
    assert verdict.tokens[0, 2:].tolist() == [PAD_ID, PAD_ID]


def test_uniform_threshold_is_p_over_q():
    # p(x) / q(x) = 0.25 / 0.5 = 0.5: u = 0.49 accepts, u = 0.51 rejects
    p = torch.tensor([0.25, 0.75, 0, 0, 0, 0])
    q = torch.tensor([0.5, 0.5, 0, 0, 0, 0])
    p_target = torch.stack([p, p])[None].expand(2, 2, VOCAB)  # [2, 2, vocab]
    q_draft = q.expand(2, 1, VOCAB)
    verdict = verify_chain(torch.zeros(2, 1, dtype=torch.int64), p_target, q_draft, gen(), uniforms=torch.tensor([[0.49], [0.51]]))
    assert verdict.num_accepted.tolist() == [1, 0]
    assert verdict.tokens[1].tolist() == [1, PAD_ID]  # residual max(p - q, 0) = [0, 0.25, 0 ...]


def test_zero_q_with_positive_p_accepts_and_zero_both_rejects():
    p_target = torch.tensor([[0.5, 0.5, 0, 0, 0, 0]]).expand(2, 2, VOCAB)  # [2, 2, vocab]
    q_draft = torch.tensor([0, 0, 1.0, 0, 0, 0]).expand(2, 1, VOCAB)
    verdict = verify_chain(torch.tensor([[1], [3]]), p_target, q_draft, gen(), uniforms=torch.full((2, 1), 0.999))
    assert verdict.num_accepted.tolist() == [1, 0]
    assert verdict.tokens[1, 0].item() in (0, 1)


@pytest.mark.parametrize("with_q", [True, False])
def test_recovered_token_in_vocab_when_residual_is_zero(with_q):
    """p == q leaves an all-zero residual: the fallback samples from p (no NaN, no zero-mass token)."""
    batch = 512
    p = torch.tensor([0.0, 0.3, 0.0, 0.7, 0.0, 0.0])
    p_target = p.expand(batch, 2, VOCAB).contiguous()  # [batch, 2, vocab]
    drafts = torch.full((batch, 1), 3)
    if with_q:
        q_draft = p.expand(batch, 1, VOCAB)
    else:  # q one-hot: residual is p without x; make p one-hot on x so the residual is zero
        p_target[:, 0] = torch.nn.functional.one_hot(torch.tensor(3), VOCAB).float()
        q_draft = None
    verdict = verify_chain(drafts, p_target, q_draft, gen(), uniforms=torch.ones(batch, 1))  # u = 1 rejects p == q
    assert verdict.num_accepted.tolist() == [0] * batch
    recovered = verdict.tokens[:, 0]
    assert recovered.min() >= 0 and recovered.max() < VOCAB
    assert (p_target[0, 0][recovered] > 0).all()


def test_deterministic_drafter_residual_excludes_the_draft():
    batch = 256
    p_target = torch.tensor([0.6, 0.4, 0, 0, 0, 0]).expand(batch, 2, VOCAB)
    verdict = verify_chain(torch.zeros(batch, 1, dtype=torch.int64), p_target, None, gen(), uniforms=torch.full((batch, 1), 0.7))
    assert verdict.num_accepted.tolist() == [0] * batch  # u = 0.7 >= p(x) = 0.6
    assert verdict.tokens[:, 0].tolist() == [1] * batch


def test_one_hot_q_equals_deterministic_path_draw_for_draw():
    batch, k = 2000, 3
    p_target = random_probs(batch, k + 1, seed=1)
    drafts = torch.randint(0, VOCAB, (batch, k), generator=gen(2))
    by_none = verify_chain(drafts, p_target, None, gen(3))
    by_one_hot = verify_chain(drafts, p_target, torch.nn.functional.one_hot(drafts, VOCAB).float(), gen(3))
    assert torch.equal(by_none.tokens, by_one_hot.tokens)
    assert 0 < int(by_none.num_accepted.sum()) < batch * k


def test_batch_rows_have_independent_outcomes():
    p_target = one_hot([[1, 2, 3], [1, 2, 3], [1, 2, 3]])  # [3, 3, vocab]
    drafts = torch.tensor([[1, 2], [1, 0], [0, 2]])
    verdict = verify_chain(drafts, p_target, None, gen())
    assert verdict.num_accepted.tolist() == [2, 1, 0]
    assert verdict.tokens.tolist() == [[1, 2, 3], [1, 2, PAD_ID], [1, PAD_ID, PAD_ID]]


def test_seeded_runs_are_reproducible():
    batch, k = 1000, 4
    p_target = random_probs(batch, k + 1, seed=1)
    q_draft = random_probs(batch, k, seed=2)
    drafts = torch.multinomial(q_draft.reshape(-1, VOCAB), 1, generator=gen(3)).reshape(batch, k)
    first = verify_chain(drafts, p_target, q_draft, gen(7))
    again = verify_chain(drafts, p_target, q_draft, gen(7))
    other = verify_chain(drafts, p_target, q_draft, gen(8))
    assert torch.equal(first.tokens, again.tokens) and torch.equal(first.num_accepted, again.num_accepted)
    assert not torch.equal(first.tokens, other.tokens)


@pytest.mark.parametrize("bad", [-1, VOCAB])
@pytest.mark.parametrize("with_q", [True, False])
def test_out_of_range_draft_ids_raise(bad, with_q):
    q_draft = random_probs(1, 2) if with_q else None
    with pytest.raises(ValueError):
        verify_chain(torch.tensor([[0, bad]]), random_probs(1, 3), q_draft, gen())


def test_bad_shapes_raise():
    drafts = torch.tensor([[0, 1]])
    with pytest.raises(ValueError):
        verify_chain(drafts, random_probs(1, 2), None, gen())  # p_target needs k + 1 positions
    with pytest.raises(ValueError):
        verify_chain(drafts, random_probs(1, 3), random_probs(1, 3), gen())  # q_draft needs k positions
    with pytest.raises(ValueError):
        verify_chain(drafts, random_probs(1, 3), None, gen(), uniforms=torch.zeros(1, 3))
