"""How a decode step's pages are laid out for attention read in place (the logits themselves are checked in
test_model_parity.py)."""
import pytest
import torch

from pdserve.engine.paged_attention import MAX_RUNS, paged_decode_attention, prepare_paged_decode

PS = 16


def test_runs_cover_every_full_page_with_its_owner():
    """Pages in 20 clusters far apart: at most MAX_RUNS runs, each full page's row names its sequence, the
    rows of pages nobody reads name the dummy owner, and tails and their valid slots are the last pages'."""
    table = torch.tensor([[c * 100 + i for c in range(b, 20, 2) for i in range(3)] for b in range(2)])
    positions = torch.tensor([table.shape[1] * PS - 1, (table.shape[1] - 1) * PS + 4])
    pd = prepare_paged_decode(table, positions, PS, 4, 8)
    assert 1 < len(pd.runs) <= MAX_RUNS
    seen = {}
    for lo, hi, row in pd.runs:
        for page in range(lo, hi):
            seen[page] = pd.owner[row + page - lo].item()
    for b in range(2):
        for page in table[b, :-1].tolist():
            assert seen.pop(page) == b
    assert set(seen.values()) == {2}
    assert pd.tail_pages.tolist() == table[:, -1].tolist()
    assert pd.tail_valid.view(2, PS).sum(1).tolist() == [PS, 5]


def test_page_in_two_sequences_is_refused():
    table = torch.tensor([[3, 4, 5], [7, 4, 8]])
    with pytest.raises(ValueError, match="appears twice"):
        prepare_paged_decode(table, torch.tensor([40, 40]), PS, 4, 8)


def test_other_heads_scores_do_not_shift_the_softmax():
    """Each page is scored against every KV head at once; a huge score against another group's KV head must
    not act as the softmax's peak (the real weights would all underflow), so outputs equal plain attention."""
    ps, kvh, g, D = 4, 2, 2, 8
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(12, 2, ps, kvh, D, generator=gen)
    cache[:, 0, :, 1] = 50.0                 # KV head 1's keys
    q = torch.randn(2, kvh * g, D, generator=gen)
    q[:, :g] = 50.0                          # group 0's queries: ~7000 against KV head 1, ~O(1) against their own
    tables, positions = [[3, 4, 5, 9], [7, 2, 8, 0]], [13, 9]
    pd = prepare_paged_decode(torch.tensor(tables), torch.tensor(positions), ps, kvh, kvh * g)
    out = paged_decode_attention(q, cache, pd)
    for b, (t, n) in enumerate(zip(tables, positions)):
        kv = cache[t].transpose(0, 1).reshape(2, -1, kvh, D)[:, :n + 1]  # [2, n+1, kvh, D]
        for h in range(kvh * g):
            w = torch.softmax(kv[0, :, h // g] @ q[b, h] * D ** -0.5, 0)
            assert (out[b, h] - w @ kv[1, :, h // g]).abs().max().item() < 1e-4, f"sequence {b} head {h}"
