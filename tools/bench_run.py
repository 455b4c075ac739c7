"""`bench.py run`: time commands on one checkpoint against `cp -r` + sync, in the same run.

Commands alternate (the disk drifts between runs), caches are dropped before each when permitted, and
each command's wall time, block I/O and the peak RSS of its whole process tree are recorded; the median
of the runs is printed. The reshard timed is this repository's (PYTHONPATH), whichever one is installed.
"""
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

def byte_compile(tree=REPO) -> None:
    """Byte-compile the reshard package of `tree`, as an installed package is: a run under PYTHONDONTWRITEBYTECODE
    would otherwise compile its modules again each time (0.2-1 s of a command's wall time)."""
    subprocess.run([sys.executable, "-m", "compileall", "-q", os.path.join(tree, "reshard")], check=True)


def drop_caches() -> bool:
    try:
        subprocess.run(["sync"], check=True)
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def _tree_rss(root: int) -> int:
    """Resident bytes of a process and all its descendants (the whole tree, summed)."""
    children, rss = {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
        rss[int(entry)] = int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += rss.get(pid, 0)
        todo.extend(children.get(pid, []))
    return total


def measure(cmd, max_rss=None, timeout=None, repo=REPO):
    """Wall seconds, CPU seconds, peak RSS of the process tree (sampled), block I/O bytes read and written. A command
    whose tree passes max_rss bytes or runs past timeout seconds is killed (its figures are then lower bounds, and
    "stopped" says why): a baseline that needs more than a shared machine has must not take it from the others.
    `repo`: the checkout whose reshard is measured (default this one)."""
    start = time.perf_counter()
    # the reshard measured is this repository's (or `repo`'s), whichever one is installed
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, start_new_session=True)
    peak, stopped = [0], [None]
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], _tree_rss(proc.pid))
            over = (f"peak RSS past {max_rss / 2**20:.0f} MiB" if max_rss and peak[0] > max_rss else
                    f"running past {timeout:.0f} s" if timeout and time.perf_counter() - start > timeout else None)
            if over and not stopped[0]:
                stopped[0] = over
                os.killpg(proc.pid, signal.SIGKILL)     # its own session: the whole tree
            stop.wait(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    stderr = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    stop.set()
    sampler.join()
    code = os.waitstatus_to_exitcode(status)
    # `plan` exits 1 saying the disk cannot hold the output (a 1 TB simulation never fits); it made the plan
    too_big = code == 1 and "plan" in cmd and b"free, the conversion writes" in stderr
    if code != 0 and not too_big and not stopped[0]:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{stderr.decode()[-2000:]}")
    # CPU: user + system of the process and of every child it waited for (worker processes, cp's)
    return {"seconds": wall, "cpu": usage.ru_utime + usage.ru_stime, "peak_rss": max(peak[0], usage.ru_maxrss * 1024),
            "read": usage.ru_inblock * 512, "written": usage.ru_oublock * 512, "stopped": stopped[0]}


def _commands(args, src, work) -> dict:
    """name -> (destination -> argv), in the order they alternate."""
    # -P: the working directory is not put first on sys.path, so the reshard timed is this repository's
    # (PYTHONPATH) even when the bench runs from another checkout
    reshard = [sys.executable, "-P", "-m", "reshard"]
    rules = ["--layout-rules", args.layout_rules] if args.layout_rules else []
    # the copy limit: cp -r, then sync, since reshard fsyncs what it writes
    commands = {} if args.no_cp else {"cp -r": lambda dst: ["sh", "-c", 'cp -r "$0" "$1" && sync', src, dst]}
    fmt = ["--format", args.format] if args.format else []
    names = ["--names", args.names] if getattr(args, "names", None) else []

    def convert(spec):
        return lambda dst: reshard + ["convert", src, dst, "--to", spec, "--quiet", *fmt, *rules, *names]

    def plan(spec):
        return lambda dst: reshard + ["plan", src, "--to", spec, "--quiet", *fmt, *rules, *names]

    for spec in args.to:
        commands[f"convert {spec}"] = convert(spec)
    # reading commands: what they print is thrown away, their time and memory is the figure
    if args.inspect:
        commands["inspect"] = lambda dst: reshard + ["inspect", src, *rules]
    if args.validate:
        commands["validate"] = lambda dst: reshard + ["validate", src, *rules]
    for spec in args.plan:
        commands[f"plan {spec}"] = plan(spec)
    others = not args.reshard_only
    if args.export:
        commands["export fp32"] = lambda dst: reshard + ["export", src, dst + ".safetensors", "--dtype", "fp32",
                                                         "--quiet", *rules]
        script = os.path.join(src, "zero_to_fp32.py")
        if others and os.path.exists(script):
            commands["zero_to_fp32"] = lambda dst: [sys.executable, script, src, dst, "--safe_serialization"]
    if args.universal:
        commands["convert universal"] = lambda dst: reshard + ["convert", src, dst, "--format", "universal", "--quiet",
                                                               *rules]
        if others:
            with open(os.path.join(src, "latest")) as f:
                tag_dir = os.path.join(src, f.read().strip())
            commands["ds_to_universal"] = lambda dst: [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
                                                       "--input_folder", tag_dir, "--output_folder", dst,
                                                       "--inject_missing_state"]
    if args.dcp:
        # the DCP source for the export comparison is made once, untimed
        dcp_src = os.path.join(work, "dcp-source")
        subprocess.run(reshard + ["convert", src, dcp_src, "--format", "dcp", "--quiet", *rules], check=True)
        commands["convert dcp"] = lambda dst: reshard + ["convert", src, dst, "--format", "dcp", "--quiet", *rules]
        # both write model and optimizer state: dcp_to_torch consolidates everything the DCP holds
        commands["export from dcp"] = lambda dst: reshard + ["export", dcp_src, dst, "--with-optimizer", "--quiet"]
        if others:
            commands["dcp_to_torch_save"] = lambda dst: [sys.executable, "-m",
                                                         "torch.distributed.checkpoint.format_utils",
                                                         "dcp_to_torch", dcp_src, dst + ".pt"]
    return commands


def run(args):
    src = os.path.abspath(args.src)
    size = du(src)
    if args.workdir:
        os.makedirs(args.workdir, exist_ok=True)
    work = tempfile.mkdtemp(prefix="reshard-bench-", dir=args.workdir or os.path.dirname(src))
    commands = _commands(args, src, work)
    samples = {name: [] for name in commands}
    cold = True
    try:
        for _ in range(args.repeat):
            for name, make_cmd in commands.items():     # alternate: the disk drifts between runs
                if any(r["stopped"] for r in samples[name]):
                    continue            # it would only be stopped again
                dst = os.path.join(work, "out")
                cold = drop_caches() and cold
                samples[name].append(measure(make_cmd(dst), args.max_rss and args.max_rss * 2**20, args.timeout))
                for leftover in (dst, dst + ".safetensors", dst + ".pt"):
                    if os.path.isdir(leftover):
                        shutil.rmtree(leftover)
                    elif os.path.exists(leftover):
                        os.remove(leftover)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    base = statistics.median(s["seconds"] for s in samples["cp -r"]) if "cp -r" in samples else None
    table = []
    for name, runs in samples.items():
        row = {"command": name, "median_seconds": statistics.median(r["seconds"] for r in runs),
               "runs_seconds": [round(r["seconds"], 2) for r in runs],
               "peak_rss_mib": max(r["peak_rss"] for r in runs) / 2**20,
               "read_gb": statistics.median(r["read"] for r in runs) / 1e9,
               "written_gb": statistics.median(r["written"] for r in runs) / 1e9,
               "stopped": next((r["stopped"] for r in runs if r["stopped"]), None)}
        row["ratio_to_cp"] = row["median_seconds"] / base if base else None
        row["gb_per_s"] = size / 1e9 / row["median_seconds"]
        table.append(row)
    by_name = {r["command"]: r for r in table}
    pairs = (("export fp32", "zero_to_fp32"), ("convert universal", "ds_to_universal"),
             ("export from dcp", "dcp_to_torch_save")) + tuple((f"convert {t}", "ds_to_universal") for t in args.to)
    for ours, theirs in pairs:
        if ours in by_name and theirs in by_name:
            by_name[ours][f"ratio_to_{theirs}"] = by_name[ours]["median_seconds"] / by_name[theirs]["median_seconds"]
    print(f"source {src}: {size / 1e9:.2f} GB; {args.repeat} alternating runs; caches "
          f"{'dropped before each run' if cold else 'NOT dropped (no permission)'}")
    print(f"{'command':<30} {'median s':>9} {'x cp':>6} {'GB/s':>6} {'read GB':>8} {'written GB':>10} "
          f"{'peak RSS MiB':>13}")
    for r in table:
        versus = ", ".join(f"{v:.2f}x {k[9:]}" for k, v in r.items()
                           if k.startswith("ratio_to_") and k != "ratio_to_cp")
        ratio = "" if r["ratio_to_cp"] is None else f"{r['ratio_to_cp']:.2f}"
        if r["stopped"]:
            versus = f"STOPPED ({r['stopped']}): seconds and RSS are lower bounds"
        print(f"{r['command']:<30} {r['median_seconds']:>9.2f} {ratio:>6} {r['gb_per_s']:>6.2f} "
              f"{r['read_gb']:>8.2f} {r['written_gb']:>10.2f} {r['peak_rss_mib']:>13.0f}  {versus}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"source": src, "bytes": size, "cold": cold, "rows": table}, f, indent=1)


def alternate(commands: dict, work, repeat: int, before=None) -> tuple[dict, dict, bool]:
    """Run each of `commands` (name -> (output path -> argv)) `repeat` times, alternating, caches dropped before each
    run when permitted, each into its own path under `work`; `before()` is called before each run. Gives the
    measures by name, the last run's output path by name, and whether every run started cold. Earlier runs' outputs
    are removed as the next begins."""
    samples: dict[str, list] = {name: [] for name in commands}
    last: dict[str, str] = {}
    cold = True
    for i in range(repeat):
        for index, (name, argv) in enumerate(commands.items()):
            if name in last:
                shutil.rmtree(last[name], ignore_errors=True)
            last[name] = os.path.join(work, f"{index}-{i}")
            if before:
                before()
            cold = drop_caches() and cold
            samples[name].append(measure(argv(last[name])))
    return samples, last, cold


def print_medians(samples: dict, baseline: str, gb: float, per: str) -> None:
    """Each command's medians — wall seconds, × the `baseline` command's, CPU seconds and per GB of `gb` GB (`per`
    says of what) — its peak RSS and every run's seconds."""
    base = statistics.median(s["seconds"] for s in samples[baseline])
    print(f"{'command':<32} {'median s':>9} {'x base':>7} {'CPU s':>6} {'CPU s/GB ' + per:>14} "
          f"{'peak RSS MiB':>13}  runs")
    for name, runs in samples.items():
        seconds = statistics.median(r["seconds"] for r in runs)
        cpu = statistics.median(r["cpu"] for r in runs)
        print(f"{name:<32} {seconds:>9.2f} {seconds / base:>7.2f} {cpu:>6.2f} {cpu / gb:>14.2f} "
              f"{max(r['peak_rss'] for r in runs) / 2**20:>13.0f}  {[round(r['seconds'], 2) for r in runs]}")


def du(path) -> int:
    """Apparent bytes of the files under path (a sparse file counts its holes)."""
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)
