"""services/broker/free_set.py against a scripted etcd whose writes fail at random, applied or not: whatever happens,
every page etcd's set names is FREE at the leader and not grantable (the invariant a new leader relies on when it
frees them at once), and a pool's pages are all accounted for."""
from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

import pytest

from pdserve.broker.free_set import DurableFreeSet, decode, encode
from pdserve.broker.lease_table import LeaseError, LeaseTable, PageState

EPOCH, TERM = 7, 4


def test_encoding_round_trips_and_refuses_what_does_not_fit():
    for n in (1, 7, 8, 9, 2048):
        pages = set(random.Random(n).sample(range(n), n // 2))
        assert decode(encode(pages, n), n) == pages
    with pytest.raises(ValueError, match="does not fit a pool of 9 pages"):
        decode(b"\0", 9)
    with pytest.raises(ValueError, match="names page 9 of a pool of 9 pages"):
        decode(encode({9}, 10)[:1] + b"\x02", 9)


class Etcd:
    """One key space; a fenced transaction applies or not, and may then raise as a lost reply would."""

    def __init__(self, rng: random.Random, failure_rate: float) -> None:
        self.kv: dict[bytes, bytes] = {}
        self.rng, self.failure_rate = rng, failure_rate
        self.transactions = SimpleNamespace(put=lambda k, v: ("put", k, v), delete=lambda k: ("delete", k))

    async def get_prefix(self, prefix, keys_only=False):
        await asyncio.sleep(0)
        return [SimpleNamespace(key=k) for k in sorted(self.kv) if k.startswith(prefix)]

    async def get(self, key):
        await asyncio.sleep(0)
        return SimpleNamespace(value=self.kv[key]) if key in self.kv else None

    async def fenced_txn(self, success=()):
        await asyncio.sleep(0)
        applied = self.rng.random() >= self.failure_rate / 2
        if applied:
            for op in success:
                if op[0] == "put":
                    self.kv[op[1]] = op[2]
                else:
                    self.kv.pop(op[1], None)
        if not applied or self.rng.random() < self.failure_rate / 2:
            raise asyncio.TimeoutError("scripted: reply lost")


def check(table: LeaseTable, etcd: Etcd, fs: DurableFreeSet, num_pages: int) -> None:
    pool = table._pools["p"]
    stored = decode(etcd.kv[fs.key("p")], num_pages) if fs.key("p") in etcd.kv else set()
    assert stored <= pool.parked, stored - pool.parked
    assert all(pool.pages[i].state is PageState.FREE for i in stored)
    assert not pool.parked & set(pool.free)
    assert table.pool_state("p")["num_free"] == sum(p.state is PageState.FREE for p in pool.pages)


@pytest.mark.parametrize("seed", range(12))
def test_the_stored_set_is_always_free_and_never_grantable(seed):
    async def main():
        rng = random.Random(seed)
        num_pages = rng.choice([16, 64, 200])
        etcd = Etcd(rng, failure_rate=rng.choice([0.0, 0.2, 0.5]))
        election = SimpleNamespace(client=etcd, fenced_txn=etcd.fenced_txn)
        table = LeaseTable(epoch=EPOCH, reader_ttl_s=float("inf"))
        table.take_identity(EPOCH, TERM)
        table.register_pool("p", num_pages)
        fs = DurableFreeSet(election, "c", table, fraction=1 / 8, min_pages=2)
        owners: list[bytes] = []
        for step in range(300):
            action = rng.random()
            if action < 0.35:
                owner, need = rng.randbytes(16), rng.randint(1, 6)
                await fs.ensure("p", need)
                try:
                    table.grant("p", owner, need, EPOCH)
                    owners.append(owner)
                except LeaseError as e:
                    assert e.reason == "POOL_EXHAUSTED"
            elif action < 0.6 and owners:
                table.release("p", owners.pop(rng.randrange(len(owners))), EPOCH)
            else:
                fs.poke("p")
            await asyncio.sleep(0)
            check(table, etcd, fs, num_pages)
        for task in list(fs._balancing.values()):
            await task
        check(table, etcd, fs, num_pages)
        # a leader that adopts the pool frees exactly what etcd names, and no page it names is leased
        parked = await fs.load("p", num_pages)
        assert parked <= {i for i, p in enumerate(table._pools["p"].pages) if p.state is PageState.FREE}
    asyncio.run(main())


def reliable(num_pages: int, fraction: float) -> tuple[Etcd, LeaseTable, DurableFreeSet]:
    """A table with pool "p" of num_pages, and its free set on an etcd whose writes all succeed (min_pages 8)."""
    etcd = Etcd(random.Random(0), 0.0)
    table = LeaseTable(epoch=EPOCH, reader_ttl_s=float("inf"))
    table.take_identity(EPOCH, TERM)
    table.register_pool("p", num_pages)
    fs = DurableFreeSet(SimpleNamespace(client=etcd, fenced_txn=etcd.fenced_txn), "c", table, min_pages=8,
                        fraction=fraction)
    return etcd, table, fs


def test_balance_parks_the_surplus_and_reserves_before_a_grant_runs_short():
    async def main():
        etcd, table, fs = reliable(128, fraction=1 / 16)
        fs.poke("p")
        await fs._balancing["p"]
        assert table.num_grantable("p") == 16 and len(table.parked("p")) == 112  # parked down to twice low
        assert decode(etcd.kv[fs.key("p")], 128) == table.parked("p")
        await fs.ensure("p", 30)  # one write reserves the shortfall and a low-water mark more
        assert table.num_grantable("p") == 30 + 8 and len(table.grant("p", b"a" * 16, 30, EPOCH)) == 30
        assert decode(etcd.kv[fs.key("p")], 128) == table.parked("p")
        await fs.forget("p")
        assert fs.key("p") not in etcd.kv
    asyncio.run(main())


def test_a_pool_full_of_cached_pages_or_of_leases_keeps_its_floor_parked():
    """What a new leader frees at once is what the set holds: the floor stays there however the pool fills, with
    cached pages (grants evict unread ones) or with leases (a grant past the rest of the pool is refused); a floor
    short of its size (an adopted set) is parked from unread cached pages."""
    async def main():
        etcd, table, fs = reliable(128, fraction=1 / 8)
        low, floor = fs.low(128), fs.floor(128)
        assert (low, floor) == (16, 8)

        async def cached_request(n: int, need: int, keep: bool = False) -> bytes:
            owner = n.to_bytes(16, "big")
            await fs.ensure("p", need)
            leases = table.grant("p", owner, need, EPOCH)
            table.begin_write("p", owner, EPOCH, leases, "w", max_landing_s=1.0)
            table.end_write("p", owner, EPOCH, leases, "w", True)
            chains = [(n * 128 + i).to_bytes(16, "big") for i in range(need)]
            assert table.publish("p", owner, EPOCH, leases, chains, [1] * need, b"t" * 8) == [True] * need
            if not keep:
                table.release("p", owner, EPOCH)
            fs.poke("p")
            await fs._balancing["p"]
            return owner

        for n in range(60):
            await cached_request(n, 4)
            assert table.num_parked("p") >= floor, (n, table.pool_state("p"))
        state = table.pool_state("p")
        assert state["num_cached"] >= 128 - 2 * low - 4 and state["num_parked"] == floor, state
        assert decode(etcd.kv[fs.key("p")], 128) == table.parked("p")
        held = [await cached_request(100 + n, 8, keep=True) for n in range(15)]  # all but the floor
        with pytest.raises(LeaseError) as refused:
            await cached_request(200, 1)
        assert refused.value.reason == "POOL_EXHAUSTED"
        assert table.num_parked("p") == floor and decode(etcd.kv[fs.key("p")], 128) == table.parked("p")
        for owner in held:
            table.release("p", owner, EPOCH)
        # a leader that adopted a set smaller than the floor parks the rest, evicting unread cached pages
        table.unpark("p", sorted(table.parked("p"))[:5])
        fs.poke("p")
        await fs._balancing["p"]
        assert table.num_parked("p") == floor and decode(etcd.kv[fs.key("p")], 128) == table.parked("p")
    asyncio.run(main())


def test_the_sets_of_pools_no_decode_handed_over_are_deleted_and_no_other():
    async def main():
        etcd, table, fs = reliable(64, fraction=1 / 8)
        fs.poke("p")
        await fs._balancing["p"]
        other = DurableFreeSet(fs.election, "other-cluster", table)
        etcd.kv[other.key("q")] = b"\xff"  # another cluster's pool
        orphans = [fs.key(f"gone{i}") for i in range(250)]  # more than one transaction may hold
        etcd.kv.update({key: b"\xff" for key in orphans})
        assert await fs.forget_orphans(table.pool_ids) == 250
        assert set(etcd.kv) == {fs.key("p"), other.key("q")}
        assert decode(etcd.kv[fs.key("p")], 64) == table.parked("p") and table.num_parked("p")
        assert await fs.forget_orphans(table.pool_ids) == 0
    asyncio.run(main())
