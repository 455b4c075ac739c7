"""Benchmark: a DeepSpeed checkpoint in a bucket, converted by reshard straight from and to the bucket, against
downloading it first (boto3's own parallel download, s3transfer) and converting the local copy. One S3 server
(SeaweedFS `weed mini`, tools/s3_server.py) and the same bytes for every route, in one run:

    python tools/bench_s3.py SRC [--to dp=2] [--repeat 3] [--workdir DIR] [--json out.json]

SRC is a local DeepSpeed save dir (e.g. `python tools/bench.py make-synthetic /tmp/z3 --params 170e6 --dp 4`:
~2 GB of ZeRO-3 bf16); it is uploaded once. For each route, the median of --repeat alternating runs: wall seconds,
CPU seconds (user + system) and per GB of the source, and the peak RSS of the reshard (or download) process, from
/usr/bin/time; and the local disk each route uses beyond the output. Beside the conversions: `export` and
`validate --deep` straight from the bucket, and boto3's download alone (what reading the bytes through an S3 client
costs here: the floor under every route that reads the bucket). The server runs on this machine: its CPU competes
with the client's and loopback is no network, so the figures compare the routes' work, not what a real object store
over a network would give.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import s3_server

DOWNLOAD = """
import os, sys, boto3
from boto3.s3.transfer import TransferConfig
bucket, prefix, folder = sys.argv[1:4]
client = boto3.client("s3")
config = TransferConfig(multipart_chunksize=8 << 20, max_concurrency=8)
for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
    for o in page.get("Contents", ()):
        path = os.path.join(folder, o["Key"][len(prefix) + 1:])
        os.makedirs(os.path.dirname(path), exist_ok=True)
        client.download_file(bucket, o["Key"], path, Config=config)
"""

UPLOAD = """
import os, sys, boto3
from boto3.s3.transfer import TransferConfig
folder, bucket, prefix = sys.argv[1:4]
client = boto3.client("s3")
config = TransferConfig(multipart_chunksize=8 << 20, max_concurrency=8)
for root, _, names in os.walk(folder):
    for name in names:
        path = os.path.join(root, name)
        client.upload_file(path, bucket, f"{prefix}/{os.path.relpath(path, folder)}", Config=config)
"""


def timed(argv: list, env: dict) -> dict:
    """Run `argv` under /usr/bin/time: {wall, cpu, rss_mib}. `validate --deep` may exit 1: a synthetic source's
    random bytes hold NaNs, which it reports after reading every byte, as it would have without them."""
    allowed = (0, 1) if "validate" in argv else (0,)
    with tempfile.NamedTemporaryFile("r", suffix=".time") as out:
        start = time.perf_counter()
        done = subprocess.run(["/usr/bin/time", "-f", "%U %S %M", "-o", out.name, *argv], env=env,
                              stdout=subprocess.DEVNULL)
        if done.returncode not in allowed:
            raise subprocess.CalledProcessError(done.returncode, argv)
        wall = time.perf_counter() - start
        user, system, rss = out.read().split()[-3:]
    return {"wall": wall, "cpu": float(user) + float(system), "rss_mib": int(rss) / 1024}


def du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", help="a local DeepSpeed save dir")
    parser.add_argument("--to", default="dp=2", help="the target topology (default dp=2)")
    parser.add_argument("--repeat", type=int, default=3, help="alternating runs of each route; medians (default 3)")
    parser.add_argument("--workdir", help="where the server's data and the local outputs go (default: a tmp dir)")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    work = args.workdir or tempfile.mkdtemp(prefix="bench-s3-")
    os.makedirs(work, exist_ok=True)
    reshard = [sys.executable, "-m", "reshard"]
    figures: dict = {"to": args.to, "source_bytes": du(args.src), "routes": {}}
    with s3_server.running(os.path.join(work, "s3-data")) as server:
        env = {**os.environ, **server.env()}
        start = time.perf_counter()
        src = s3_server.upload(server, args.src, "src")
        figures["upload_seconds"] = time.perf_counter() - start
        for i in range(args.repeat):
            local, copy = os.path.join(work, f"out-local-{i}"), os.path.join(work, f"download-{i}")
            routes = {
                "s3 -> s3": [reshard + ["convert", src, server.url(f"out-s3-{i}"), "--to", args.to, "--quiet"]],
                "s3 -> local": [reshard + ["convert", src, local, "--to", args.to, "--quiet"]],
                "s3 export -> local": [reshard + ["export", src, local + ".safetensors", "--quiet"]],
                "s3 validate --deep": [reshard + ["validate", src, "--deep"]],
                "download alone": [[sys.executable, "-c", DOWNLOAD, server.bucket, "src", copy + "-1"]],
                "download + local convert": [
                    [sys.executable, "-c", DOWNLOAD, server.bucket, "src", copy],
                    reshard + ["convert", copy, local + "-2", "--to", args.to, "--quiet"]],
                # the end state of s3 -> s3 the long way: the local result uploaded (boto3's parallel upload)
                "download + convert + upload": [
                    [sys.executable, "-c", DOWNLOAD, server.bucket, "src", copy + "-3"],
                    reshard + ["convert", copy + "-3", local + "-3", "--to", args.to, "--quiet"],
                    [sys.executable, "-c", UPLOAD, local + "-3", server.bucket, f"out-up-{i}"]],
            }
            for name, commands in routes.items():
                steps = [timed(argv, env) for argv in commands]
                run = {"wall": sum(s["wall"] for s in steps), "cpu": sum(s["cpu"] for s in steps),
                       "rss_mib": max(s["rss_mib"] for s in steps),
                       "local_disk_beyond_output": du(copy) if name.startswith("download") else 0}
                if name == "download + convert + upload":     # its local output is a temporary copy too
                    run["local_disk_beyond_output"] = du(copy + "-3") + du(local + "-3")
                figures["routes"].setdefault(name, []).append(run)
            for path in (copy, copy + "-1", copy + "-3", local, local + "-2", local + "-3"):
                shutil.rmtree(path, ignore_errors=True)
            for path in (local + ".safetensors", local + ".safetensors.reshard-manifest.json"):
                if os.path.exists(path):
                    os.remove(path)
    gb = figures["source_bytes"] / 1e9
    print(f"{gb:.2f} GB source, --to {args.to}; upload {figures['upload_seconds']:.1f} s; medians of {args.repeat}")
    print(f"{'route':28} {'wall s':>7} {'GB/s':>6} {'cpu s':>7} {'cpu s/GB':>9} {'peak RSS MiB':>13} "
          f"{'extra disk GB':>14}")
    for name, runs in figures["routes"].items():
        wall, cpu = (statistics.median(r[key] for r in runs) for key in ("wall", "cpu"))
        print(f"{name:28} {wall:7.1f} {gb / wall:6.2f} {cpu:7.1f} {cpu / gb:9.2f} "
              f"{max(r['rss_mib'] for r in runs):13.0f} {runs[0]['local_disk_beyond_output'] / 1e9:14.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
