"""What checking every zip member's CRC-32 costs (issue 24 point 4).

    python tools/bench_crc.py SRC --base DIR [--tree LABEL=DIR ...] [--to dp=3,zero=1] [--repeat 3]

1. CRC-32 throughput on one core: zlib's (what reshard uses) and, where installed, python-isal's (ISA-L); the
   combine of two blocks' CRCs (reshard.reading.checksums.crc32_combine).
2. `reshard convert SRC --to ...` with this checkout (the check) and with the checkout at --base (a commit
   before it: no check), and any other checkout given by --tree (this one with zlib's CRC-32 forced), and
   `cp -r SRC` for the disk's own speed, alternated, caches dropped before each run when permitted; the
   median of --repeat runs of each, and their ratios to cp and to no check.
Nothing is asserted: it prints figures for people.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zlib

from bench_run import drop_caches
from reshard.reading.checksums import crc32_combine

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _throughput(crc, data: bytes, repeat: int = 5) -> float:
    """GB/s, the best of `repeat` passes over `data` (best: other processes share these cores)."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        crc(data)
        best = min(best, time.perf_counter() - start)
    return len(data) / best / 1e9


def crc_speeds() -> None:
    data = os.urandom(256 << 20)
    print(f"zlib.crc32 ({zlib.ZLIB_RUNTIME_VERSION}): {_throughput(zlib.crc32, data):.2f} GB/s on one core")
    try:
        from isal import isal_zlib
    except ImportError:
        print("python-isal: not installed")
    else:
        assert isal_zlib.crc32(data) == zlib.crc32(data)
        print(f"isal_zlib.crc32: {_throughput(isal_zlib.crc32, data):.2f} GB/s on one core")
    start, n = time.perf_counter(), 2000
    for _ in range(n):
        crc32_combine(0x12345678, 0x9ABCDEF0, 16 << 20)
    print(f"crc32_combine: {(time.perf_counter() - start) / n * 1e6:.0f} µs per block")


def _time(cmd, env) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def converts(src: str, base: str, others: dict, to: str, repeat: int) -> None:
    work = tempfile.mkdtemp(prefix="bench-crc-", dir=os.path.dirname(os.path.abspath(src)))
    dst = os.path.join(work, "out")
    trees = {"convert, no check": base, "convert, CRC-32 checked": REPO,
             **{f"convert, {label}": tree for label, tree in others.items()}}
    runs = {"cp -r": [], **{label: [] for label in trees}}
    cold = True
    try:
        for _ in range(repeat):
            for label in runs:
                cold = drop_caches() and cold
                if label == "cp -r":
                    cmd, env = ["cp", "-r", src, dst], os.environ
                else:
                    cmd = [sys.executable, "-P", "-m", "reshard", "convert", src, dst, "--to", to, "--quiet"]
                    env = {**os.environ, "PYTHONPATH": trees[label]}
                seconds = _time(cmd, env)
                subprocess.run(["sync"], check=True)
                runs[label].append(seconds)
                shutil.rmtree(dst)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    cp = statistics.median(runs["cp -r"])
    plain = statistics.median(runs["convert, no check"])
    print(f"caches {'dropped before each run' if cold else 'NOT dropped (no permission)'}; medians of {repeat}:")
    for label, seconds in runs.items():
        median = statistics.median(seconds)
        print(f"  {label:32s} {median:7.2f} s  ({median / cp:.2f}x cp, {median / plain:.3f}x no check)  "
              f"runs {', '.join(f'{s:.2f}' for s in seconds)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src")
    parser.add_argument("--base", required=True, help="a checkout of reshard without the check")
    parser.add_argument("--tree", action="append", default=[], metavar="LABEL=DIR",
                        help="another checkout to time convert with")
    parser.add_argument("--to", default="dp=3,zero=1")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    crc_speeds()
    others = dict(tree.split("=", 1) for tree in args.tree)
    converts(args.src, os.path.abspath(args.base), others, args.to, args.repeat)


if __name__ == "__main__":
    main()
