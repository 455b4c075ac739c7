"""`bench.py fast`: reshard on fast storage, where the CPU is the limit and not the disk (issue 41).

tmpfs (/dev/shm) stands in for an NVMe array or a parallel file system: a copy moves several GB/s there, so what a
command costs is its CPU. The source is copied into the work folder first (untimed) unless it is in memory already;
then the commands alternate, REPEAT times, each writing into the work folder:

- `cp -r SRC DST && sync`: the copy limit (coreutils' kernel copy: the bytes never reach a user buffer);
- a direct copy: every file read into one buffer and written from it by one Python process (the least a program
  that sees every byte does: one read, one write, no check);
- `reshard convert --to SPEC` with 1 worker and with N (`--workers N`), and with `--digest ALGORITHM` once with
  that digest (`export --dtype fp32` too);
- `reshard export --dtype fp32` (no cast) and `--dtype bf16` (the training precision, a cast of every element);
  `reshard validate --deep`;
- with `--before CHECKOUT` (another version's tree, e.g. `git worktree add /tmp/before COMMIT`), the same reshard
  commands run by that version too, in the same alternation: before and after measured under the same load.

Every reshard tree timed is byte-compiled first (an installed package is): a run under PYTHONDONTWRITEBYTECODE
would otherwise compile its modules again each time (0.2-0.4 CPU seconds).

Per command: the median wall time and its ratio to `cp -r`'s, the median CPU seconds (user + system of the process
and every child it waited for: reshard's worker processes, cp's) and per GB (of what it writes for cp, the copy and
convert; of what it reads for export, from its manifest's bytes_read; of the source for validate --deep), the cores
it kept busy (CPU seconds per second of wall time) and the peak RSS of the whole process tree (bench_run.measure).
`uptime`'s load before and after is printed beside them: on a shared machine the ratios within one run are what to
read. Nothing is asserted: it prints figures for people.
"""
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

from bench_run import REPO, byte_compile, du, measure

BLOCK = 16 << 20        # the direct copy's buffer


def direct_copy(src: str, dst: str) -> None:
    """Every file under `src` read into one buffer and written from it to the same place under `dst`."""
    buffer = bytearray(BLOCK)
    view = memoryview(buffer)
    for folder, _, names in os.walk(src):
        out_folder = os.path.join(dst, os.path.relpath(folder, src))
        os.makedirs(out_folder, exist_ok=True)
        for name in names:
            with open(os.path.join(folder, name), "rb", buffering=0) as f, \
                    open(os.path.join(out_folder, name), "wb", buffering=0) as out:
                while n := f.readinto(buffer):
                    out.write(view[:n])
                os.fsync(out.fileno())


def in_memory(path: str) -> bool:
    kind = subprocess.run(["stat", "-f", "-c", "%T", path], capture_output=True, text=True).stdout.strip()
    return kind in ("tmpfs", "ramfs")


def _manifest(out: str) -> dict:
    for path in (os.path.join(out, "reshard-manifest.json"), f"{out}.reshard-manifest.json"):
        if os.path.isfile(path):
            with open(path) as f:
                return json.load(f)
    return {}


def _allocated(path: str) -> int:
    """Bytes of `path`'s files that hold blocks (holes excluded)."""
    return sum(os.stat(os.path.join(d, f)).st_blocks * 512 for d, _, files in os.walk(path) for f in files)


def _load() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def run_fast(args) -> None:
    workdir = args.workdir or "/dev/shm"
    if not in_memory(workdir):
        print(f"bench fast: note: {workdir} is not tmpfs; the figures are that file system's", file=sys.stderr)
    work = tempfile.mkdtemp(prefix="reshard-bench-fast-", dir=workdir)
    try:
        src = os.path.abspath(args.src)
        if not in_memory(src):
            subprocess.run(["cp", "-r", src, os.path.join(work, "src")], check=True)
            src = os.path.join(work, "src")
        size = du(src)
        # cp keeps a source's holes as holes (--sparse=auto) where reshard writes every byte: a sparse source
        # (`make-synthetic --holes`) is copied with every byte written too
        dense = ["--sparse=never"] if _allocated(src) < size / 2 else []
        reshard = [sys.executable, "-P", "-m", "reshard"]
        convert = reshard + ["convert", src, "{dst}", "--to", args.to, "--quiet"]
        commands = {
            "cp -r": ["sh", "-c", f'cp -r {" ".join(dense)} "$0" "$1" && sync', src, "{dst}"],
            "direct copy": [sys.executable, os.path.abspath(__file__), src, "{dst}"],
            f"convert {args.to}": convert,
            f"convert {args.to} --workers {args.workers}": convert + ["--workers", str(args.workers)],
            "export fp32": reshard + ["export", src, "{dst}.safetensors", "--dtype", "fp32", "--quiet"],
            "export bf16": reshard + ["export", src, "{dst}.safetensors", "--dtype", "bf16", "--quiet"],
            "validate --deep": reshard + ["validate", src, "--deep"],
        }
        for digest in args.digest or ():     # the manifest's other digests (sha256: the default before BLAKE3)
            commands[f"convert {args.to} --digest {digest}"] = convert + ["--digest", digest]
            commands[f"export fp32 --digest {digest}"] = commands["export fp32"] + ["--digest", digest]
        commands = {name: commands[name] for name in sorted(commands, key=lambda n: n.startswith(("export",
                                                                                                "validate")))}
        trees = {name: REPO for name in commands}
        if args.before:
            mine = [n for n in commands if n.startswith(("convert", "export", "validate")) and "--digest" not in n]
            for name in mine:
                commands[f"before: {name}"], trees[f"before: {name}"] = commands[name], os.path.abspath(args.before)
        for tree in set(trees.values()):
            byte_compile(tree)
        samples: dict[str, list] = {name: [] for name in commands}
        load_before = _load()
        for _ in range(args.repeat):
            for name, cmd in commands.items():     # alternating: the machine's load drifts between runs
                dst = os.path.join(work, "out")
                sample = measure([part.replace("{dst}", dst) for part in cmd], repo=trees[name])
                recorded = _manifest(dst) or _manifest(f"{dst}.safetensors")
                command = name.removeprefix("before: ")
                sample["gb"] = (recorded["bytes_read"] if command.startswith("export") else
                                recorded["bytes_written"] if command.startswith("convert") else
                                du(dst) if os.path.isdir(dst) else size) / 1e9
                samples[name].append(sample)
                for leftover in (dst, f"{dst}.safetensors", f"{dst}.safetensors.reshard-manifest.json"):
                    if os.path.isdir(leftover):
                        shutil.rmtree(leftover)
                    elif os.path.exists(leftover):
                        os.remove(leftover)
        load_after = _load()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    base = statistics.median(r["seconds"] for r in samples["cp -r"])
    rows = []
    for name, runs in samples.items():
        seconds, cpu = statistics.median(r["seconds"] for r in runs), statistics.median(r["cpu"] for r in runs)
        gb = statistics.median(r["gb"] for r in runs)
        rows.append({"command": name, "median_seconds": seconds, "runs_seconds": [round(r["seconds"], 2) for r in runs],
                     "ratio_to_cp": seconds / base, "cpu_seconds": cpu, "gb": gb, "cpu_seconds_per_gb": cpu / gb,
                     "runs_cpu_seconds": [round(r["cpu"], 2) for r in runs], "cores": cpu / seconds,
                     "peak_rss_mib": max(r["peak_rss"] for r in runs) / 2**20})
    print(f"source {args.src}: {size / 1e9:.2f} GB, in {workdir}; {args.repeat} alternating runs; load average "
          f"{load_before} before, {load_after} after")
    print(f"{'command':<40} {'median s':>9} {'x cp':>6} {'CPU s':>7} {'GB':>6} {'CPU s/GB':>9} {'cores':>6} "
          f"{'peak RSS MiB':>13}")
    for r in rows:
        print(f"{r['command']:<40} {r['median_seconds']:>9.2f} {r['ratio_to_cp']:>6.2f} {r['cpu_seconds']:>7.2f} "
              f"{r['gb']:>6.2f} {r['cpu_seconds_per_gb']:>9.2f} {r['cores']:>6.2f} {r['peak_rss_mib']:>13.0f}")
    one, many = (next(r for r in rows if r["command"] == f"convert {args.to}{tail}")
                 for tail in ("", f" --workers {args.workers}"))
    print(f"--workers {args.workers}: {one['median_seconds'] / many['median_seconds']:.2f}x the speed of 1 worker")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"source": args.src, "bytes": size, "workdir": workdir, "load_before": load_before,
                       "load_after": load_after, "rows": rows}, f, indent=1)


def add_parser(command) -> None:
    what = "time reshard on tmpfs (fast storage: CPU-bound) against cp -r and a direct copy, CPU seconds per GB"
    t = command("fast", what)
    t.add_argument("src", help="the checkpoint (a DeepSpeed save dir); copied into WORKDIR first unless in memory")
    t.add_argument("--to", default="dp=4", metavar="SPEC", help="the conversion timed (default dp=4)")
    t.add_argument("--workers", type=int, default=2, help="the N of `convert --workers N` (default 2)")
    t.add_argument("--repeat", type=int, default=3, help="alternating runs of each; the median is shown (default 3)")
    t.add_argument("--workdir", help="a tmpfs folder for the outputs (default /dev/shm)")
    t.add_argument("--digest", action="append", metavar="ALGORITHM", help="also `convert` and `export fp32` with "
                   "`--digest ALGORITHM` (sha256: the manifest's digest before BLAKE3; xxh3-128); repeatable")
    t.add_argument("--before", metavar="CHECKOUT", help="also time the reshard commands of another version's tree "
                   "(git worktree add /tmp/before COMMIT), alternating with this one's")
    t.add_argument("--json", metavar="FILE", help="also write the figures to FILE as JSON")


if __name__ == "__main__":      # the direct copy, as its own process
    direct_copy(sys.argv[1], sys.argv[2])
