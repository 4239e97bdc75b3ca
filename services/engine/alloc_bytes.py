"""Bytes of the tensors a block of torch code allocates, counted op by op (CPU torch keeps no allocator
statistics). An op's output counts when its storage is none of its inputs' (a view or an in-place result is
not an allocation); the sum is over the whole block, so it bounds the block's peak from above."""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class AllocatedBytes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.bytes = 0
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in inputs:
                n = t.untyped_storage().nbytes()
                self.bytes += n
                self.largest = max(self.largest, n)
        return out
