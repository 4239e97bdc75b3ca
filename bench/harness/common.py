"""What every bench step shares: the paths, the progress log and the checkpoints (written once, then reused)."""
from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Where a run writes: an ignored folder, so a run leaves the checkout as it was. The tables kept in git are in
# COMMITTED, copied there only on purpose (`make bench-commit`). bench/gpu.sh points RESULTS elsewhere, so a CUDA
# run never overwrites the CPU tables of the last CPU run.
RESULTS = os.path.abspath(os.environ.get("PDSERVE_BENCH_RESULTS") or os.path.join(ROOT, "bench", "out"))
COMMITTED = os.path.join(ROOT, "bench", "results")
MODELS = os.path.join(ROOT, "bench", ".models")
_T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - _T0:7.1f}s] {msg}", flush=True)


def _short(s) -> str:
    ms = lambda x: "n/a" if math.isnan(x) else f"{x * 1e3:.1f}"  # noqa: E731
    err = f", {s.num_errors} errors ({s.extra.get('first_error')})" if s.num_errors else ""
    return (f"{s.wall_s:.1f}s  TTFT p50 {ms(s.ttft_p50)} ms  ITL p50 {ms(s.itl_p50)} ms  "
            f"{s.out_tok_s:.0f} tok/s{err}")


def ensure_model(preset: str) -> str:
    from pdserve.engine.make_model import make_model

    # tokenizer_config.json is the newest file make-model writes (guidellm needs it): an older checkpoint is not used
    default = os.path.join(ROOT, "models", "pdserve-tiny")
    if preset == "tiny" and os.path.exists(os.path.join(default, "tokenizer_config.json")):
        return default
    path = os.path.join(MODELS, f"pdserve-{preset}")
    if not os.path.exists(os.path.join(path, "tokenizer_config.json")):
        log(f"writing the {preset} checkpoint to {os.path.relpath(path, ROOT)} (seed 0) ...")
        make_model(path, preset, 0)
    return path


def under_flood(flood_cmd: list[str], measure):
    """measure()'s result while `python -m pdserve.bench.scenarios.flood ... --stop-on-stdin` (flood_cmd) runs, and the flood's
    own stats (its JSON line once told to stop)."""
    proc = subprocess.Popen(flood_cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT)
    try:
        if '"ready"' not in (first := proc.stdout.readline()):
            raise RuntimeError(f"flood did not start: {first} {proc.stderr.read()[-2000:]}")
        time.sleep(0.2)  # the flood reaches its rate before the measured traffic starts
        result = measure()
        proc.stdin.write("stop\n")
        proc.stdin.flush()
        stats = json.loads(proc.stdout.readline())
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
    return result, stats


def git_commit(path: str | None = None) -> str:
    """HEAD (with -dirty when services/ or bench/ differ from it), or with a path the last commit that touched it."""
    args = ["git", "log", "-1", "--format=%H", "--", path] if path else ["git", "rev-parse", "HEAD"]
    sha = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    if not sha:
        raise RuntimeError(f"no commit for {' '.join(args)} in {ROOT}")
    if path is None:
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "services", "bench"],
                               cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
        sha += "-dirty" if dirty else ""
    return sha


def machine() -> dict:
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    return {"cpus": os.cpu_count(), "cpu": model, "arch": platform.machine(), "python": platform.python_version()}
