"""How a decode step's pages are laid out for attention (the logits themselves are checked in
test_model_parity.py)."""
import pytest
import torch

from pdserve.engine.paged_attention import MAX_RUNS, MIN_RUN_PAGES, paged_decode_attention, prepare_paged_decode

PS = 16


def _layout(pd):
    """page -> owner of every row the step scores: in-place runs first, then the packed copies."""
    rows = [(page, pd.owner[row + page - lo].item()) for lo, hi, row in pd.runs for page in range(lo, hi)]
    rows += list(zip(pd.packed_pages.tolist(), pd.owner[pd.num_rows - pd.packed_pages.numel():].tolist()))
    assert len(rows) == pd.num_rows
    return rows


CLUSTERS = [(1000 + 100 * c, n) for c, n in enumerate([3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 2])]
TABLES = [list(range(10)),                                                    # tail 9
          [10, 12, 13, 14, 15, 16, 700, 900],                                 # joins 0..8 across 9 and 11
          [p for lo, n in CLUSTERS for p in range(lo, lo + n)] + [5000]]      # 12 clusters, more than MAX_RUNS


def _prepare(tables, shift=0):
    P = max(map(len, tables))
    table = torch.tensor([[p + shift for p in t] + [0] * (P - len(t)) for t in tables])
    positions = torch.tensor([len(t) * PS - 1 - 3 * b for b, t in enumerate(tables)])
    return prepare_paged_decode(table, positions, PS, 4, 8)


def test_every_page_read_is_scored_once_by_its_owner():
    """Runs joined across short gaps and clusters far apart: each full page's row names its sequence exactly
    once, rows of nobody (dummy owner B) only fill the gaps inside an in-place run and never outnumber the
    pages read, the longest MAX_RUNS runs are read in place and the short ones and the tails are copied."""
    pd = _prepare(TABLES)
    rows = _layout(pd)
    read = [(p, b) for b, t in enumerate(TABLES) for p in t]
    assert sorted(r for r in rows if r[1] < 3) == sorted(read)
    assert sorted(p for p, b in rows if b == 3) == [9, 11]          # seq 0's tail and an unused id, in run 0
    assert len(pd.runs) == MAX_RUNS and all(hi - lo >= MIN_RUN_PAGES for lo, hi, _ in pd.runs)
    assert pd.runs[0][:2] == (0, 17)
    in_place = {p for lo, hi, _ in pd.runs for p in range(lo, hi)}
    assert all(p in in_place for p in range(1400, 1407)) and not in_place & {700, *range(1000, 1003), 2100}
    assert pd.packed_pages[-3:].tolist() == [9, 900, 5000] == pd.tail_pages.tolist()
    assert pd.tail_valid.view(3, PS).sum(1).tolist() == [PS, PS - 3, PS - 6]


def test_rows_do_not_depend_on_where_the_pages_lie():
    """The same tables a million page ids further, or spread 1,000 or 11 ids apart: as many rows as pages
    read, or (joined runs) at most twice as many, never the span of the ids."""
    read = sum(map(len, TABLES))
    assert _prepare(TABLES, shift=1 << 20).num_rows == _prepare(TABLES).num_rows <= 2 * read
    spread = [[1000 * (10 * b + i) for i in range(10)] for b in range(3)]
    pd = _prepare(spread)
    assert pd.num_rows == 30 and pd.runs == []
    # gaps short enough for one call but longer than the pages between them: not worth reading
    pd = _prepare([[11 * i for i in range(20)]])
    assert pd.num_rows == 20 and pd.runs == []


def test_a_shared_prefix_page_is_scored_once_by_each_of_its_readers():
    """Prefix reuse: sequences reading the same cached pages (a shared system prompt) each score them against
    their own query, once: the first reader's rows may lie in place, every other reader's are packed copies."""
    shared = list(range(20, 30))
    tables = [shared + [40 + b, 50 + b] for b in range(3)] + [[3, 4, 5, 6, 7]]
    pd = _prepare(tables)
    rows = _layout(pd)
    read = [(p, b) for b, t in enumerate(tables) for p in t]
    assert sorted(r for r in rows if r[1] < len(tables)) == sorted(read)
    in_place = [p for lo, hi, _ in pd.runs for p in range(lo, hi)]
    assert len(in_place) == len(set(in_place))  # a page lies in place once; its other readers' rows are copies
    assert sorted(pd.packed_pages.tolist()).count(25) == 2


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


@pytest.mark.parametrize("tables", [[list(range(7, 17))], [[7, 8, 9]], TABLES,
                                    [[200 * (10 * b + i) for i in range(10)] for b in range(3)],
                                    [list(range(20, 30)) + [40 + b, 50 + b] for b in range(3)]],
                         ids=["one-range", "short-range", "joined-and-packed", "spread", "shared-prefix"])
def test_every_layout_equals_plain_attention(tables):
    """In-place runs, joined runs with nobody's rows inside, packed pages and tails: outputs equal plain
    attention over each sequence's tokens, with NaN in every page and slot the step must not read."""
    kvh, g, D = 2, 2, 8
    gen = torch.Generator().manual_seed(1)
    cache = torch.full((6000, 2, PS, kvh, D), float("nan"))
    positions = [len(t) * PS - 1 - 3 * b for b, t in enumerate(tables)]
    kvs = []
    for t, n in zip(tables, positions):
        kvs.append(torch.randn(2, n + 1, kvh, D, generator=gen))
        for i, page in enumerate(t):
            if not torch.isnan(cache[page, 0, 0, 0, 0]):  # a page shared with an earlier sequence holds its KV
                kvs[-1][:, i * PS:(i + 1) * PS] = cache[page, :, :PS]
            cache[page, :, :min(PS, n + 1 - i * PS)] = kvs[-1][:, i * PS:(i + 1) * PS]
    q = torch.randn(len(tables), kvh * g, D, generator=gen)
    P = max(map(len, tables))
    table = torch.tensor([t + [0] * (P - len(t)) for t in tables])
    out = paged_decode_attention(q, cache, prepare_paged_decode(table, torch.tensor(positions), PS, kvh, kvh * g))
    for b, kv in enumerate(kvs):
        w = torch.softmax(torch.einsum("shd,hgd->hgs", kv[0], q[b].view(kvh, g, D)) * D ** -0.5, -1)
        ref = torch.einsum("hgs,shd->hgd", w, kv[1]).reshape(kvh * g, D)
        assert (out[b] - ref).abs().max().item() < 1e-5, f"sequence {b}"


def test_other_heads_values_get_exactly_zero_weight():
    """A KV head's weight for another group's query head is exactly 0, not e^-80: values of 1e36 in KV head 1
    (finite, as a bf16 or float32 pool may hold) leave group 0's outputs those of plain attention."""
    ps, kvh, g, D = 4, 2, 2, 8
    gen = torch.Generator().manual_seed(2)
    cache = torch.randn(12, 2, ps, kvh, D, generator=gen)
    cache[:, 1, :, 1] = 1e36
    q = torch.randn(2, kvh * g, D, generator=gen)
    tables, positions = [[3, 4, 5, 9], [7, 2, 8, 0]], [13, 9]
    out = paged_decode_attention(q, cache, prepare_paged_decode(torch.tensor(tables), torch.tensor(positions), ps,
                                                                kvh, kvh * g))
    for b, (t, n) in enumerate(zip(tables, positions)):
        kv = cache[t].transpose(0, 1).reshape(2, -1, kvh, D)[:, :n + 1]
        for h in range(g):
            w = torch.softmax(kv[0, :, 0] @ q[b, h] * D ** -0.5, 0)
            assert (out[b, h] - w @ kv[1, :, 0]).abs().max().item() < 1e-4, f"sequence {b} head {h}"
