"""Runs last on the default stack: after every request has ended, no page is leased or lost."""
from tests.integration.helpers import wait_no_leases


def test_no_page_leased_after_all_requests(stack):
    states = wait_no_leases(stack)
    assert states
    for s in states:
        assert s.num_leased == 0
        assert s.num_free + s.num_quarantined + s.num_cached == s.num_pages and s.num_shared_reads == 0
    for name, procs in stack.procs.items():
        for p in procs:
            assert p.alive(), f"{name} died:\n{''.join(p.lines[-30:])}"
