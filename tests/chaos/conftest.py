import pytest

from tests.integration.stack import Stack

# short bounds so failures drain in seconds: writer ttl 2 s, transfer timeout 2 s; lock delay 5.5 s, the least
# that covers Mooncake's shortest timeout (5 s) + 1 ns/byte + 0.3 s slack, as prefill checks at start-up
CHAOS_EXTRA = {
    "broker": ["--lock-delay", "5.5", "--sweep-interval", "0.2", "--writer-ttl", "2.0", "--heartbeat-interval", "0.1",
               "--reconcile-grace", "3",
               # a decode that moves to a new broker incarnation waits reader ttl + max ttl + lock delay (12.5 s; decode renews its reader with a 5 s ttl)
               "--reader-ttl", "2.0", "--max-ttl", "5.0"],
    "prefill": ["--writer-ttl", "2.0", "--transfer-timeout", "2.0", "--landing-slack", "0.3"],
    # the allocation bound drains an allocation whose gateway call died between Allocate and Decode;
    # each schedule prints how often it fired
    # the blind bound must stay <= lock_delay / 2 (decode refuses to start otherwise)
    "decode": ["--canary", "--allocation-timeout", "8", "--max-blind", "2.0", "--rpc-timeout", "3"],
}


@pytest.fixture(scope="package")
def chaos(model_dir):
    s = Stack(model_dir, num_prefill=2, prefill_pool_tokens=2048, decode_pool_tokens=2048, allow_small=True,
              extra=CHAOS_EXTRA)
    yield s
    s.close()
