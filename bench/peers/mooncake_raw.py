"""Raw Mooncake: batch_transfer_sync_write of the bytes pdserve moves, process to process, as the floor.

pdserve's prefill writes one coalesced run of page bytes and then one run of tags into another process's
registered pool, cut into batch calls of at most its write unit (`--max-write-bytes`, the bytes the landing bound
is computed from); this does exactly that with the same wrapper, the same default write unit and nothing else (no
forward pass, no checksum, no RPC). The destination is a peer process
(`python -m pdserve.bench.peers.mooncake_raw peer NBYTES`), as decode is for prefill.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import torch

from pdserve.kvtransfer.engine import Run, TransferEngine, split_calls

TAG_NBYTES = 64


class RawMooncake:
    def __init__(self, max_nbytes: int):
        env = {**os.environ, "GLOG_minloglevel": "3"}
        self.max_nbytes = max_nbytes
        self.peer = subprocess.Popen([sys.executable, "-u", "-m", "pdserve.bench.peers.mooncake_raw", "peer", str(max_nbytes)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True, env=env, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
        line = self.peer.stdout.readline()
        if not line:
            raise RuntimeError(f"mooncake peer exited with {self.peer.wait()}")
        self.remote = json.loads(line)
        self.engine = TransferEngine()
        # ones, not zeros: the peer can check that bytes really arrived
        self.data = torch.ones(max_nbytes, dtype=torch.uint8)
        self.tags = torch.ones(max_nbytes // 1024 + TAG_NBYTES, dtype=torch.uint8)
        self.engine.register(self.data.data_ptr(), self.data.numel())
        self.engine.register(self.tags.data_ptr(), self.tags.numel())

    def write_once(self, data_nbytes: int, tag_nbytes: int) -> float:
        """One request's transfer as pdserve does it: data run, then tag run, each in calls of at most the write
        unit, each call posted after the one before returned; returns seconds."""
        unit = self.engine.max_write_bytes
        data = split_calls([Run(self.data.data_ptr(), self.remote["data"], data_nbytes)], unit, 1)
        tags = split_calls([Run(self.tags.data_ptr(), self.remote["tags"], tag_nbytes)], unit, 1) if tag_nbytes else []
        start = time.perf_counter()
        for call in data:
            self.engine.write(self.remote["session"], call, "data")
        for call in tags:
            self.engine.write(self.remote["session"], call, "tags")
        return time.perf_counter() - start

    def measure(self, data_nbytes: int, tag_nbytes: int = 0, repeats: int = 10, gap_s: float = 0.0) -> list[float]:
        """Seconds per write_once, back to back, or each after `gap_s` idle: a service that transfers once per
        request finds Mooncake's threads (and the peer) asleep, and waking them costs more than the bytes."""
        if data_nbytes > self.max_nbytes:
            raise ValueError(f"{data_nbytes} bytes exceed the {self.max_nbytes}-byte peer region")
        self.write_once(data_nbytes, tag_nbytes)  # first use of a session sets up its connection
        out = []
        for _ in range(repeats):
            if gap_s:
                time.sleep(gap_s)
            out.append(self.write_once(data_nbytes, tag_nbytes))
        return out

    def close(self) -> None:
        self.engine = None  # its destructor tears down the session (and logs to fd 2) now, not at exit
        if self.peer.poll() is None:
            self.peer.stdin.close()
            try:
                self.peer.wait(10)
            except subprocess.TimeoutExpired:
                self.peer.kill()
                self.peer.wait(5)


def _peer(nbytes: int) -> None:
    engine = TransferEngine()
    data = torch.zeros(nbytes, dtype=torch.uint8)
    tags = torch.zeros(nbytes // 1024 + TAG_NBYTES, dtype=torch.uint8)
    engine.register(data.data_ptr(), data.numel())
    engine.register(tags.data_ptr(), tags.numel())
    print(json.dumps({"session": engine.session, "data": data.data_ptr(), "tags": tags.data_ptr()}), flush=True)
    sys.stdin.read()  # until the benchmark closes our stdin


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "peer":
        _peer(int(sys.argv[2]))
    else:
        sys.exit("usage: python -m pdserve.bench.peers.mooncake_raw peer NBYTES")
