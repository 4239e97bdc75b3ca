"""A small page-major pool with pages and tags written the way PrefillWorker.write leaves them, for the
decode check tests."""
import torch

from pdserve.engine.kv_pool import KVPool, PoolLayout
from pdserve.engine.tags import make_tag

PS = 4
OWNER = bytes.fromhex("00112233445566778899aabbccddeeff")
OTHER = bytes.fromhex("ffeeddccbbaa99887766554433221100")
EPOCH_ = (1 << 63) + 99  # broker epochs are random 64-bit values: include the top bit
LEASES = [(5, 3), (9, 4), (2, 7), (12, 8)]  # (physical page, generation); the last is for decode's own tokens
NUM_PROMPT = 10  # 3 prompt pages: 4 + 4 + 2 tokens


def make_pool():
    return KVPool(PoolLayout(num_layers=2, num_kv_heads=2, head_dim=8, page_size=PS, dtype="float32"), 16)


def write_pages(pool, owner, epoch, leases, num_tokens, seed=0, index_of=lambda i: i, gen_of=None, count_of=None):
    """What PrefillWorker.write leaves in the destination: data (tail zeroed), then tags with checksums."""
    g = torch.Generator().manual_seed(seed)
    n = -(-num_tokens // PS)
    checksums = []
    for i, (page, gen) in enumerate(leases[:n]):
        pool.kv[page] = torch.randn(pool.kv[page].shape, generator=g)
        tokens = min(PS, num_tokens - i * PS)
        pool.zero_tail(page, tokens)
        c = pool.checksum(page)
        checksums.append(c)
        pool.tags[page] = torch.tensor(make_tag(owner, epoch, gen_of(i) if gen_of else gen, index_of(i),
                                                count_of(i) if count_of else tokens, c), dtype=torch.int64)
    return checksums
