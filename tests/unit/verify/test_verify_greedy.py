"""Greedy chain verification: accept while draft == argmax, then emit the argmax (recovered or bonus)."""

import pytest
import torch

from dflash2.verify import PAD_ID, ChainVerdict, verify_greedy

VOCAB = 10


def logits_with_argmax(argmax_ids: list[list[int]], vocab: int = VOCAB) -> torch.Tensor:
    """[batch, positions, vocab] random logits whose argmax at each position is the given id."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.tensor(argmax_ids)  # [batch, positions]
    logits = torch.randn(*ids.shape, vocab, generator=generator)  # [batch, positions, vocab]
    return logits.scatter(-1, ids[..., None], 10.0)


def test_all_accepted_emits_bonus_argmax_at_k():
    logits = logits_with_argmax([[3, 1, 4, 7]])
    verdict = verify_greedy(torch.tensor([[3, 1, 4]]), logits)
    assert isinstance(verdict, ChainVerdict)
    assert verdict.num_accepted.tolist() == [3]
    assert verdict.num_emitted.tolist() == [4]
    assert verdict.tokens.tolist() == [[3, 1, 4, 7]]


def test_first_rejected_emits_argmax_at_0():
    verdict = verify_greedy(torch.tensor([[5, 1, 4]]), logits_with_argmax([[3, 1, 4, 7]]))
    assert verdict.num_accepted.tolist() == [0]
    assert verdict.tokens.tolist() == [[3, PAD_ID, PAD_ID, PAD_ID]]
    assert verdict.emitted(0) == [3]


def test_middle_rejected_keeps_prefix_and_ignores_later_matches():
    # draft 2 (index 2) would match again, but everything after the first mismatch is ignored
    verdict = verify_greedy(torch.tensor([[3, 9, 4]]), logits_with_argmax([[3, 1, 4, 7]]))
    assert verdict.num_accepted.tolist() == [1]
    assert verdict.tokens.tolist() == [[3, 1, PAD_ID, PAD_ID]]


def test_zero_drafts_emits_bonus_only():
    verdict = verify_greedy(torch.zeros(2, 0, dtype=torch.int64), logits_with_argmax([[6], [2]]))
    assert verdict.num_accepted.tolist() == [0, 0]
    assert verdict.tokens.tolist() == [[6], [2]]


def test_batch_rows_have_independent_outcomes_and_padding():
    logits = logits_with_argmax([[3, 1, 4, 7], [2, 2, 2, 2], [0, 5, 6, 8], [9, 9, 1, 1]])
    drafts = torch.tensor([[3, 1, 4], [1, 2, 2], [0, 5, 0], [9, 9, 1]])
    verdict = verify_greedy(drafts, logits)
    assert verdict.num_accepted.tolist() == [3, 0, 2, 3]
    assert verdict.tokens.dtype == torch.int64
    assert verdict.tokens.tolist() == [
        [3, 1, 4, 7],
        [2, PAD_ID, PAD_ID, PAD_ID],
        [0, 5, 6, PAD_ID],
        [9, 9, 1, 1],
    ]
    assert [verdict.emitted(row) for row in range(4)] == [[3, 1, 4, 7], [2], [0, 5, 6], [9, 9, 1, 1]]


def test_matches_plain_greedy_decoding_token_by_token():
    """Emitted tokens == argmax at each position up to and including the first mismatch."""
    generator = torch.Generator().manual_seed(1)
    batch, k = 64, 5
    logits = torch.randn(batch, k + 1, 4, generator=generator)  # small vocab: many accepts
    drafts = torch.randint(0, 4, (batch, k), generator=generator)
    verdict = verify_greedy(drafts, logits)
    argmax = logits.argmax(-1)
    for row in range(batch):
        expected = []
        for i in range(k + 1):
            expected.append(int(argmax[row, i]))
            if i == k or int(drafts[row, i]) != expected[-1]:
                break
        assert verdict.emitted(row) == expected
    assert 0 < int(verdict.num_accepted.sum()) < batch * k  # both outcomes exercised


def test_int32_drafts_give_int64_tokens():
    verdict = verify_greedy(torch.tensor([[3]], dtype=torch.int32), logits_with_argmax([[3, 7]]))
    assert verdict.tokens.dtype == torch.int64
    assert verdict.tokens.tolist() == [[3, 7]]


@pytest.mark.parametrize("bad", [-1, VOCAB])
def test_out_of_range_draft_ids_raise(bad):
    with pytest.raises(ValueError):
        verify_greedy(torch.tensor([[bad]]), logits_with_argmax([[3, 7]]))


def test_shape_mismatch_raises():
    with pytest.raises(ValueError):
        verify_greedy(torch.tensor([[3, 1]]), logits_with_argmax([[3, 7]]))


def test_greedy_ids_are_argmax_ties_to_the_first():
    """The greedy token everywhere (plain decoding, verification, drafts) is the first maximum, as argmax: bf16
    logits widened to fp32 tie often."""
    from dflash2.verify.sampling import greedy_ids

    logits = torch.randint(0, 4, (3, 5, 1000), generator=torch.Generator().manual_seed(1)).float()  # many ties
    logits[0, 0] = 0.0  # all tied: index 0
    assert torch.equal(greedy_ids(logits), logits.argmax(dim=-1))
    assert greedy_ids(logits)[0, 0].item() == 0 and greedy_ids(logits).dtype == torch.int64
    big = torch.randn(2, 151936, generator=torch.Generator().manual_seed(2)).bfloat16().float()
    assert torch.equal(greedy_ids(big), big.argmax(dim=-1))
