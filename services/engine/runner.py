"""ModelRunner: packs prefill and decode batches for the model and runs them over a KVPool."""
from __future__ import annotations

import math
import os
import sys
import threading
from concurrent.futures import Future
from typing import Callable, NamedTuple, TypeVar

import torch

from ..common.prefix import chain_seed, checkpoint_identity
from .context import AttentionContext, reset_context, set_context
from .dtypes import kv_dtype as pick_kv_dtype
from .kv_pool import KVPool, PoolLayout
from . import native, native_prefill, packed_linear
from .loader import load_model, weight_nbytes
from .paged_attention import prepare_paged_decode
from .sizing import PoolSize, kv_bytes_per_token


def _cgroup_quota(line: str, root: str) -> float | None:
    """The CPU quota, in cores, of one /proc/self/cgroup line's group and the groups above it (the smallest
    applies); None where none is set or the files are not there."""
    _, controllers, path = line.strip().split(":", 2)
    if controllers == "":  # v2: cpu.max holds "<quota> <period>" or "max <period>"
        dirs, name = [os.path.join(root, "unified"), root], "cpu.max"
    elif "cpu" in controllers.split(","):  # v1: cpu.cfs_quota_us (-1: none) beside cpu.cfs_period_us
        dirs, name = [os.path.join(root, controllers), os.path.join(root, "cpu")], "cpu.cfs_quota_us"
    else:
        return None
    best = None
    for base in dirs:
        parts = [p for p in path.split("/") if p]
        for depth in range(len(parts), -1, -1):
            d = os.path.join(base, *parts[:depth])
            try:
                with open(os.path.join(d, name)) as f:
                    quota, *period = f.read().split()
                if name == "cpu.cfs_quota_us":
                    with open(os.path.join(d, "cpu.cfs_period_us")) as f:
                        period = f.read().split()
            except (OSError, ValueError):
                continue
            if quota not in ("max", "-1") and period and int(period[0]) > 0:
                cores = int(quota) / int(period[0])
                best = cores if best is None else min(best, cores)
        if best is not None:
            return best
    return best


def available_cpus(cgroup_root: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup") -> int:
    """The cores this process may run on: its CPU affinity, capped by a cgroup CPU quota (a container's CPU limit)
    rounded up. os.cpu_count() counts the host's cores and would start more threads than the process gets."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    try:
        with open(proc_cgroup) as f:
            lines = f.readlines()
    except OSError:
        lines = []
    for line in lines:
        try:
            quota = _cgroup_quota(line, cgroup_root)
        except ValueError:  # a line of another shape
            continue
        if quota is not None:
            cores = min(cores, max(1, math.ceil(quota)))
    return max(1, cores)


def set_threads(n: int = 0, switch_interval_ms: float | None = None) -> None:
    """Intra-op CPU threads; by default half the cores this process may use (available_cpus), since prefill and
    decode usually share a host (prefill asks for all of them, its compute threads below decode's priority:
    prefill/main.py compute_threads).
    The model runs in a worker thread beside the event loop that streams tokens and answers RPCs; it
    drops the GIL inside every torch op and must get it back between ops, which can take a whole switch
    interval while the loop runs Python, so a service sets a short one."""
    torch.set_num_threads(n or max(1, available_cpus() // 2))
    if switch_interval_ms is not None:
        sys.setswitchinterval(switch_interval_ms / 1000)


T = TypeVar("T")


def in_thread(fn: Callable[[], T], name: str) -> Future[T]:
    """fn() in a daemon thread: a start-up that fails before it needs the result exits without waiting for it."""
    done: Future[T] = Future()

    def run() -> None:
        try:
            done.set_result(fn())
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the result
            done.set_exception(e)

    threading.Thread(target=run, name=name, daemon=True).start()
    return done


def pick_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def free_device_bytes(device: torch.device) -> int | None:
    """What a CUDA device has left now (after the weights, and after whatever else runs on it); None elsewhere."""
    if device.type != "cuda":
        return None
    return torch.cuda.mem_get_info(device)[0]


class DecodeInputs(NamedTuple):
    """One decode step's inputs (ModelRunner.prepare_decode): token ids and positions [B], page tables [B, P], and the
    rope tables [B, D] when the step is one native call (else None)."""
    token_ids: torch.Tensor
    positions: torch.Tensor
    table: torch.Tensor
    rope: tuple[torch.Tensor, torch.Tensor] | None


class Chunk(NamedTuple):
    """The next tokens of one prompt in a packed prefill pass: token_ids sit at positions start.. of the prompt,
    whose KV lives in pages (from the prompt's first page); start > 0 continues after an earlier chunk."""
    token_ids: list[int]
    start: int
    pages: list[int]
    all_logits: bool = False  # else only the last row's: what the first token is sampled from


class ModelRunner:
    def __init__(self, model_dir: str, num_pages: int | PoolSize, page_size: int, dtype: str = "auto",
                 device: torch.device | str | None = None, kv_dtype: str = "auto", prefill_only: bool = False):
        """dtype: the weights' ('auto': the checkpoint's); kv_dtype: the pool's ('auto': the weights').
        num_pages: a count, or a PoolSize resolved once the weights are on the device (a memory budget, or a
        fraction of what the device has left after them). prefill_only: a runner that never decodes (a prefill
        service's) packs its CPU linears for oneDNN (packed_linear.py) and builds no native decode step."""
        self.device = torch.device(device) if device is not None else pick_device()
        # the prefix chain's checkpoint term hashes every byte of the weights, beside the load that reads them; a
        # runner never exists without it, so nothing serves a prefix page before it is known
        identity = in_thread(lambda: checkpoint_identity(model_dir), "checkpoint-identity")
        self.model = load_model(model_dir, self.device, dtype)
        self.checkpoint = identity.result()
        self.config = self.model.config
        self.dtype = str(next(self.model.parameters()).dtype).removeprefix("torch.")
        self.kv_dtype = pick_kv_dtype(kv_dtype, self.dtype)
        self.weight_nbytes = weight_nbytes(self.model)
        self.linears = "linears: F.linear"
        if prefill_only:
            why = packed_linear.why_not(self.model.lm_head.weight)
            if why is None:
                self.model.pack()
                self.linears = "linears: oneDNN, weights packed once"
            else:
                self.linears = f"linears: F.linear (not packed: {why})"
        self.pool_source = f"{num_pages} pages"
        if isinstance(num_pages, PoolSize):
            self.pool_source = num_pages.source
            num_pages = num_pages.num_pages(self.config, self.kv_dtype, page_size, free_device_bytes(self.device))
        self.layout = PoolLayout.for_model(self.config, page_size, self.kv_dtype)
        self.pool = KVPool(self.layout, num_pages, self.device)
        self.model.bind_kv_pool(self.pool.kv)
        # decode attention on the CPU kernel where it takes this pool, else the torch path (on a GPU, always)
        self.native_decode = native.supports(self.pool.kv[:, 0], self.config.num_attention_heads)
        self.native_block = self.native_decode and native.supports_block(
            self.pool.kv[:, 0], self.config.num_attention_heads, next(self.model.parameters()).dtype)
        # a whole step in one native call, where it takes the model
        self.native_step = None
        if self.device.type == "cpu" and not prefill_only and \
                native.NativeDecoder.why_not(self.model, self.pool.kv) is None:
            self.native_step = native.NativeDecoder(self.model, self.pool.kv)

    @property
    def page_size(self) -> int:
        return self.layout.page_size

    def chain_seed(self, scope: bytes) -> bytes:
        """Where this engine's prefix chains start under a scope (pdserve.common.prefix)."""
        return chain_seed(scope, self.checkpoint, self.page_size, self.kv_dtype)

    def describe(self, context_length: int) -> str:
        """The start-up line: what the weights and the pool take, and how the pool compares with the context."""
        per_token = kv_bytes_per_token(self.config, self.kv_dtype)
        return (f"weights {self.weight_nbytes} bytes in {self.dtype} on {self.device}; KV pool {self.pool.num_tokens} "
                f"tokens ({self.pool.num_pages} pages of {self.page_size}, {self.kv_dtype}, {per_token} bytes/token, "
                f"{self.pool.data_nbytes / 2**20:.1f} MiB; from {self.pool_source}), pool/context "
                f"{self.pool.num_tokens / context_length:.4g} of a {context_length}-token context; "
                f"{self.linears}; {native_prefill.status(self.pool.kv[:, 0], self.config.num_attention_heads)}; "
                f"{self.decode_attention()}")

    def decode_attention(self) -> str:
        """Which decode path runs, and why not the CPU kernels where it does not."""
        if self.native_step is not None:
            return "decode: one native call per step"
        if self.native_decode or self.device.type != "cpu":
            return f"paged decode attention: {'native CPU kernel' if self.native_decode else 'torch path'}"
        if native._load() is None:
            return native.status()
        return (f"paged decode attention: torch path (the CPU kernel does not take {self.kv_dtype} pages of "
                f"{self.page_size} with {self.config.num_attention_heads} heads over "
                f"{self.config.num_key_value_heads} KV heads of {self.config.head_dim})")

    def _check_window(self, last_position: int) -> None:
        """Past a sliding window attention would differ from the full attention computed here: refuse."""
        window = self.config.sliding_window
        if window and last_position >= window:
            raise ValueError(f"position {last_position} is past the model's sliding_window {window}; the served "
                             f"context is capped at {window} tokens")

    def _tensor(self, data) -> torch.Tensor:
        return torch.tensor(data, dtype=torch.int64, device=self.device)

    @torch.inference_mode()
    def prefill(self, token_ids: list[int], pages: list[int], all_logits: bool = False) -> torch.Tensor:
        """Runs one prompt from position 0, writing its KV into `pages`; returns logits [T or 1, V]."""
        return self.prefill_batch([Chunk(token_ids, 0, pages, all_logits)])[0]

    @torch.inference_mode()
    def prefill_batch(self, chunks: list[Chunk]) -> list[torch.Tensor]:
        """One forward pass over several prompts packed into one [T_total] batch with no padding: each chunk's
        tokens attend causally to themselves and to the `start` tokens of their prompt already in its pages.
        Returns each chunk's logits, [n or 1, V]."""
        ps = self.page_size
        ids, positions, page_of, rows, cu, prefix_pages = [], [], [], [], [0], []
        for c in chunks:
            n, end = len(c.token_ids), c.start + len(c.token_ids)
            if n == 0 or c.start < 0:
                raise ValueError(f"a prefill chunk needs at least one token from a position >= 0, got {n} "
                                 f"tokens from position {c.start}")
            if len(c.pages) * ps < end:
                raise ValueError(f"{len(c.pages)} pages of {ps} tokens cannot hold {end} tokens")
            self._check_window(end - 1)
            ids += c.token_ids
            positions += range(c.start, end)
            page_of += [c.pages[p // ps] for p in range(c.start, end)]
            rows += range(cu[-1], cu[-1] + n) if c.all_logits else [cu[-1] + n - 1]
            cu.append(cu[-1] + n)
            prefix_pages.append(self._tensor(c.pages[:-(-c.start // ps)]))
        pos = self._tensor(positions)
        set_context(AttentionContext(True, self._tensor(page_of), pos % ps, cu_seqlens=cu,
                                     prefix_lens=[c.start for c in chunks], prefix_pages=prefix_pages))
        try:
            hidden = self.model(self._tensor(ids), pos)
        finally:
            reset_context()
        logits = self.model.compute_logits(hidden if len(rows) == len(ids) else hidden[self._tensor(rows)])
        return list(logits.split([len(c.token_ids) if c.all_logits else 1 for c in chunks]))

    @torch.inference_mode()
    def decode(self, token_ids: list[int], positions: list[int], page_tables: list[list[int]]
               ) -> torch.Tensor:
        """One step for B sequences: token b sits at positions[b]; returns logits [B, V]."""
        return self.run_decode(self.prepare_decode(token_ids, positions, page_tables))

    @torch.inference_mode()
    def prepare_decode(self, token_ids: list[int], positions: list[int], page_tables: list[list[int]]
                       ) -> DecodeInputs:
        """A step's inputs as tensors (decode's scheduler builds them on its event loop, so the model's thread goes
        straight into the step without waiting for the GIL); refuses tables too short for their positions."""
        ps = self.page_size
        B = len(token_ids)
        self._check_window(max(positions))
        short = [(b, len(t), p) for b, (t, p) in enumerate(zip(page_tables, positions)) if len(t) <= p // ps]
        if short:
            b, n, p = short[0]
            raise ValueError(f"sequence {b}: {n} pages of {ps} tokens cannot hold position {p}")
        width = max(len(t) for t in page_tables)
        # one tensor from one flat list (page 0 pads a short table, never read past its length): a tensor per
        # sequence would cost more than the step's own table checks at large batches
        table = torch.tensor([t + [0] * (width - len(t)) if len(t) < width else t for t in page_tables],
                             dtype=torch.int64)
        pos = self._tensor(positions)
        rope = None
        if self.native_step is not None:
            cos, sin = self.model.model.rotary_emb(pos)
            rope = (cos[:, 0].contiguous(), sin[:, 0].contiguous())
        return DecodeInputs(self._tensor(token_ids), pos, table.to(self.device), rope)

    @torch.inference_mode()
    def run_decode(self, inputs: DecodeInputs) -> torch.Tensor:
        """The step prepare_decode planned: logits [B, V]."""
        ids, pos, table, rope = inputs
        if rope is not None:  # a step on the CPU: one native call
            return self.native_step.step(ids, rope[0], rope[1], table, pos + 1)
        ps = self.page_size
        if self.native_decode:
            tail = table.gather(1, (pos // ps)[:, None])[:, 0]
            ctx = AttentionContext(False, tail, pos % ps, table=table, lens=pos + 1, fused=self.native_block)
        else:
            paged = prepare_paged_decode(table, pos, ps, self.config.num_key_value_heads,
                                         self.config.num_attention_heads)
            ctx = AttentionContext(False, paged.tail_pages, pos % ps, paged=paged)
        set_context(ctx)
        try:
            hidden = self.model(ids, pos)
        finally:
            reset_context()
        return self.model.compute_logits(hidden)
