"""Benchmark `reshard list` and a `reshard prune` dry run on a run directory of many large checkpoints.

    python tools/bench_lifecycle.py make DIR [--count 100] [--layers 0]
    python tools/bench_lifecycle.py run DIR [--repeat 3] [--json OUT]

`make` writes one sparse checkpoint with tools/bench_sparse.py (a Llama-70B-wide Megatron-DeepSpeed pipeline
save, ZeRO-1 bf16, dp=2, every header real and every tensor byte a hole: 7.3 GB apparent with --layers 0, 19 GB
with 1) and copies its tag folder as DIR/global_stepN for N = 100, 200, ... (`cp --sparse=always`: a few hundred
KB on disk each); `latest` names the last. `run` times each command as a user runs it (a new process, interpreter
start-up included), medians of --repeat runs, and checks what they printed: every checkpoint complete, the
dry run deleting count - K of them.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
KEEP_LAST = 3


def make(args) -> None:
    import bench_sparse
    one = os.path.join(args.dir, ".one")
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    _, apparent = bench_sparse.make_sparse(one, 1, 1, 2, args.layers)
    source = os.path.join(one, bench_sparse.TAG)
    for i in range(1, args.count + 1):
        subprocess.run(["cp", "-r", "--sparse=always", source, os.path.join(args.dir, f"global_step{100 * i}")],
                       check=True)
    shutil.rmtree(one)
    with open(os.path.join(args.dir, "latest"), "w") as f:
        f.write(f"global_step{100 * args.count}")
    old = time.time() - 3600        # saves that finished an hour ago, not in progress
    for folder, dirs, files in os.walk(args.dir):
        for name in dirs + files:
            os.utime(os.path.join(folder, name), (old, old))
    disk = 1024 * int(subprocess.run(["du", "-sk", args.dir], capture_output=True, text=True).stdout.split()[0])
    print(f"{args.count} checkpoints of {apparent / 1e9:.1f} GB apparent each in {args.dir} ({disk / 1e6:.0f} MB "
          "on disk)")


def _timed(command: list) -> tuple:
    start = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": REPO})
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(command)}: exit {proc.returncode}\n{proc.stderr}")
    return seconds, json.loads(proc.stdout)


def run(args) -> None:
    reshard = [sys.executable, "-m", "reshard"]
    commands = {"list": reshard + ["list", args.dir, "--json"],
                "prune --keep-last 3 (dry run)": reshard + ["prune", args.dir, "--keep-last", str(KEEP_LAST), "--json"],
                "python start-up + import reshard": [sys.executable, "-c", "import reshard, json; print('{}')"]}
    results = {}
    for name, command in commands.items():
        times = []
        for _ in range(args.repeat):
            seconds, out = _timed(command)
            times.append(seconds)
        results[name] = statistics.median(times)
        if name == "list":
            rows = out["checkpoints"]
            assert rows and all(r["status"] == "complete" for r in rows), "not every checkpoint listed complete"
            apparent = sum(r["bytes"] for r in rows)
            results["checkpoints"], results["apparent_bytes"] = len(rows), apparent
        elif name.startswith("prune"):
            deleting = [d for d in out["decisions"] if d["action"] == "delete"]
            assert len(deleting) == len(out["decisions"]) - KEEP_LAST and not out["executed"]
    for name, value in results.items():
        print(f"{name:<36} {value:.3f} s" if isinstance(value, float) else f"{name:<36} {value:,}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("make", help="write the run directory of sparse checkpoints")
    m.add_argument("dir")
    m.add_argument("--count", type=int, default=100, help="checkpoints (default 100)")
    m.add_argument("--layers", type=int, default=0, help="decoder layers of each (0: 7.3 GB apparent, 1: 19 GB)")
    m.set_defaults(run=make)
    r = sub.add_parser("run", help="time list and a prune dry run")
    r.add_argument("dir")
    r.add_argument("--repeat", type=int, default=3, help="runs of each command (median)")
    r.add_argument("--json", help="write the figures here")
    r.set_defaults(run=run)
    args = parser.parse_args()
    args.run(args)


if __name__ == "__main__":
    main()
