"""`bench.py thin`: `reshard thin --yes` of one checkpoint of a run against a direct copy of the bytes it keeps.

Each repeat lays the run out afresh as hard links of SAVE_DIR (`cp -al`: nothing is copied, and thinning the
copy's tag folder removes only its links), its mtimes an hour back (a save long finished), drops the caches when
permitted, then alternates the baseline, `cp` of the files the thinned form keeps (its weights) into a new folder then
`sync`, `reshard thin RUN/TAG` (the dry run: start-up, listing the run, reading the checkpoint's structure) and
`reshard thin RUN/TAG --yes`, reshard byte-compiled first (as an installed package is). Medians of the wall times,
block I/O and the peak RSS of each command's whole process tree (bench_run.measure). Nothing is asserted: it prints
figures for people.
"""
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from bench_run import byte_compile, drop_caches, du, measure


def kept_files(folder: str) -> list[str]:
    """The files `reshard thin` keeps of the checkpoint at `folder` (its weights-only form), as paths."""
    from reshard.formats import read, weights_only_form
    form = weights_only_form(read(folder), folder)
    if form.written:
        sys.exit(f"bench thin: {folder}: its weights-only form is written anew, not copied: no direct copy "
                 "to compare with")
    return [os.path.join(folder, n) for n in form.kept]


def _fresh_run(src: str, run: str) -> None:
    if os.path.exists(run):
        shutil.rmtree(run)
    subprocess.run(["cp", "-al", src, run], check=True)
    when = time.time() - 3600
    for folder, dirs, files in os.walk(run):
        for name in files + dirs:
            os.utime(os.path.join(folder, name), (when, when))
    os.utime(run, (when, when))


def run_thin(args) -> None:
    src = os.path.abspath(args.src)
    work = tempfile.mkdtemp(prefix="reshard-bench-thin-", dir=args.workdir or os.path.dirname(src))
    run, copy = os.path.join(work, "run"), os.path.join(work, "copy")
    target = os.path.join(run, args.tag)
    kept = [os.path.relpath(p, os.path.join(src, args.tag)) for p in kept_files(os.path.join(src, args.tag))]
    kept_bytes = sum(os.path.getsize(os.path.join(src, args.tag, n)) for n in kept)
    before = du(os.path.join(src, args.tag))
    thin = [sys.executable, "-P", "-m", "reshard", "thin", target, "--yes"]
    direct = ["sh", "-c", 'mkdir -p "$0" && cp "$@" "$0"/ && sync', copy, *[os.path.join(target, n) for n in kept]]
    dry = thin[:-1]
    order = (("copy of the kept files + sync", direct), ("reshard thin (dry run)", dry), ("reshard thin --yes", thin))
    samples: dict[str, list] = {name: [] for name, _ in order}
    byte_compile()
    cold = True
    after = None
    try:
        for _ in range(args.repeat):
            for name, cmd in order:
                _fresh_run(src, run)
                shutil.rmtree(copy, ignore_errors=True)
                cold = drop_caches() and cold
                samples[name].append(measure(cmd))
                if name == "reshard thin --yes":
                    after = du(target)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    base = statistics.median(s["seconds"] for s in samples["copy of the kept files + sync"])
    rows = []
    for name, runs in samples.items():
        seconds = statistics.median(r["seconds"] for r in runs)
        rows.append({"command": name, "median_seconds": seconds, "runs_seconds": [round(r["seconds"], 2) for r in runs],
                     "ratio_to_copy": seconds / base, "peak_rss_mib": max(r["peak_rss"] for r in runs) / 2**20,
                     "read_gb": statistics.median(r["read"] for r in runs) / 1e9,
                     "written_gb": statistics.median(r["written"] for r in runs) / 1e9})
    print(f"{args.tag} of {src}: {before / 1e9:.3f} GB -> {after / 1e9:.3f} GB thinned (kept {len(kept)} file(s), "
          f"{kept_bytes / 1e9:.3f} GB: {(before - after) / 1e9:.3f} GB saved); {args.repeat} alternating runs; caches "
          f"{'dropped before each run' if cold else 'NOT dropped (no permission)'}")
    print(f"{'command':<32} {'median s':>9} {'x copy':>7} {'read GB':>8} {'written GB':>10} {'peak RSS MiB':>13}  runs")
    for r in rows:
        print(f"{r['command']:<32} {r['median_seconds']:>9.2f} {r['ratio_to_copy']:>7.2f} {r['read_gb']:>8.2f} "
              f"{r['written_gb']:>10.2f} {r['peak_rss_mib']:>13.0f}  {r['runs_seconds']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"source": src, "tag": args.tag, "bytes_before": before, "bytes_after": after,
                       "kept_bytes": kept_bytes, "cold": cold, "rows": rows}, f, indent=1)


def add_parser(command) -> None:
    what = "time `reshard thin --yes` of one checkpoint of a run against a copy of the files it keeps (+ sync)"
    t = command("thin", what)
    t.add_argument("src", help="a save dir of at least two saves (`bench.py make ... --saves 2`)")
    t.add_argument("--tag", default="global_step1", help="the checkpoint thinned (default global_step1)")
    t.add_argument("--repeat", type=int, default=3, help="alternating runs of each; the median is shown (default 3)")
    t.add_argument("--workdir", help="where the run's copies go (default: beside the source; the same file system)")
    t.add_argument("--json", metavar="FILE", help="also write the figures to FILE as JSON")
