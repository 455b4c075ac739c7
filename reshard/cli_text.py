"""What the commands print for people: inspect's summary, a plan's files, reads, memory and disk."""
from __future__ import annotations

import json
import os
import shutil
import sys

from reshard.convert import batch_size_advice
from reshard.convert import framework_files as convert_framework_files
from reshard.executor import buffer_bytes
from reshard.formats import REPRODUCIBILITY
from reshard.inspection import Inspection, human_bytes
from reshard.listing import INCOMPLETE
from reshard.text import counted
from reshard.watching import label


def print_inspect(info: Inspection) -> None:
    """inspect's human-readable summary of an Inspection."""
    t = info.topology
    print(f"{info.path}")
    framework = info.framework
    tag = f" (tag {info.tag})" if info.tag else ""     # only formats with tag folders have one
    print(f"  format        {framework['title'] if framework else info.format}{tag}")
    zero = f", ZeRO stage {info.zero_stage}" if info.zero_stage else ""
    print(f"  topology      dp={t['dp']} tp={t['tp']} pp={t['pp']} (world size {t['world_size']}){zero}")
    if info.experts:
        e = info.experts
        print(f"  experts       ep={e['ep']} expert-dp={e['expert_dp']}; " + "; ".join(
            f"layer {layer['layer']}: {layer['experts']} experts, {'/'.join(map(str, layer['experts_per_rank']))} "
            "per rank" for layer in e["layers"]))
    known = {k: "unknown" if getattr(info, k) is None else getattr(info, k)
             for k in ("dtype", "master_dtype", "optimizer", "step", "global_steps", "global_samples")}
    print(f"  dtypes        model {known['dtype']}, master {known['master_dtype']}")
    print(f"  optimizer     {known['optimizer']}: states {', '.join(info.optimizer_states) or 'none'}")
    if info.options:
        print(f"  options       {', '.join(f'{k}={v}' for k, v in info.options.items())}")
    print(f"  step          {known['step']} (global_steps {known['global_steps']}, "
          f"global_samples {known['global_samples']})")
    print(f"  parameters    {info.parameters} ({info.elements:,} element{'s' * (info.elements != 1)}): "
          f"{info.trainable} trainable, {info.frozen} frozen; {counted(info.buffers, 'buffer')}")
    for alias, source in info.aliases.items():
        print(f"  tied          {alias} -> {source}")
    for g, group in enumerate(info.param_groups):
        hyper = ", ".join(f"{k}={hyper_parameter(v)}" for k, v in group.items() if k != "params")
        print(f"  group {g:<7} {counted(group['params'], 'param')}; {hyper}")
        split = [s for s in info.split_scalars if s["group"] == g]
        for key in dict.fromkeys(s["key"] for s in split):
            print(f"  {'':<13} {key} differs per parameter: " +
                  ", ".join(f"{s['value']} at {s['param']}" for s in split if s["key"] == key))
    for state, n in info.bytes_per_state.items():
        print(f"  {state:<13} {human_bytes(n)}")
    print(f"  files         {len(info.files)}, {human_bytes(sum(f['bytes'] for f in info.files))}")
    for f in info.files:
        print(f"    {f['path']:<48} {human_bytes(f['bytes']):>10}")
    if framework:
        print(f"  {framework['name']} {counted(len(framework['files']), 'file')} beside the DeepSpeed save, "
              f"{human_bytes(sum(f['bytes'] for f in framework['files']))}")
        for f in framework["files"]:
            rank = "" if f["rank"] is None else f" (process {f['rank']})"
            print(f"    {f['path']:<32} {human_bytes(f['bytes']):>10}  {f['what']}{rank}")
    if info.problems:
        print(f"  problems      {info.problems} (run `reshard validate`)")
    for row in info.parameter_table or []:
        shape = "x".join(map(str, row["shape"])) or "scalar"
        group = "" if row["group"] is None else f"group {row['group']}"
        tied = f"tied: {', '.join(row['tied_to_it'])}" if row["tied_to_it"] else ""
        where = f"tp {row['tensor_parallel']}" if "tensor_parallel" in row else ""
        if len(row.get("stages", [])) > 1:
            where = f"stages {','.join(map(str, row['stages']))}"
        print(f"    {row['name']:<32} {shape:<12} {row['kind']:<9} {row['dtype'] or '':<9} {group:<8} "
              f"{','.join(row['states'])} {tied} {where}".rstrip())


def hyper_parameter(value) -> str:
    """A saved hyper-parameter for people: a float to the 12 significant digits it was configured with (an lr a
    scheduler computed, 0.0028000000000000004, is 0.0028: the float's last bits are arithmetic, not intent; --json
    keeps every bit)."""
    return f"{value:.12g}" if isinstance(value, float) else str(value)


def framework_files(catalog, plan, args) -> tuple:
    """What becomes of each file of the training framework around the source (framework.Disposition)."""
    return convert_framework_files(catalog, plan.target, args.fmt, args.new_rank_state)


def print_plan(catalog, plan, args):
    """The plan as `reshard plan` (and `convert --dry-run`) prints it, or its JSON; returns the summary."""
    fmt, dst, memory_budget, workers, as_json = args.fmt, args.dst, args.memory_budget, args.workers, args.json
    summary = plan.summary()
    dispositions = framework_files(catalog, plan, args)
    if catalog.framework is not None:
        summary["framework"] = {"name": catalog.framework.name, "new_rank_state": args.new_rank_state,
                                "policy": catalog.framework.policy_line(args.new_rank_state),
                                "reproducibility": REPRODUCIBILITY, "files": [d.to_dict() for d in dispositions]}
    summary["estimated_peak_buffer_bytes"] = buffer_bytes(memory_budget, workers)
    where = os.path.abspath(dst) if dst else os.getcwd()
    while not os.path.exists(where):
        where = os.path.dirname(where)
    free = shutil.disk_usage(where).free
    summary["free_disk_bytes"] = free
    summary["free_disk_at"] = where
    summary["disk_ok"] = free > plan.bytes_written
    summary["advice"] = batch_size_advice(catalog, plan.target, fmt)
    if as_json:
        json.dump(summary, sys.stdout, indent=2)
        print()
        return summary
    print(f"source   {plan.source}")
    print(f"         {summary['source_topology']}")
    print(f"target   {plan.output.words()}")
    if plan.stage_cut:
        print(f"stages   {plan.stage_cut.line()}")
        if plan.stage_cut.ambiguous:
            print(f"note     {plan.stage_cut.ambiguous}")
    print(f"files    {len(summary['files'])} to write:")
    for f in summary["files"]:
        copied = " (copied)" if "copied_from" in f else ""
        print(f"           {f['path']:<56} {human_bytes(f['bytes']):>10}{copied}")
    print(f"read     {human_bytes(summary['bytes_read'])}")
    print(f"write    {human_bytes(summary['bytes_written'])}")
    print(f"memory   copy buffers at most {human_bytes(summary['estimated_peak_buffer_bytes'])} "
          f"(--memory-budget {human_bytes(memory_budget)}, {counted(workers, 'worker')})")
    verdict = "enough" if summary["disk_ok"] else "NOT ENOUGH"
    print(f"disk     {human_bytes(free)} free at {where}: {verdict}")
    if summary["advice"]:
        print(f"advice   {summary['advice']}")
    if catalog.framework is not None:
        print(f"framework {catalog.framework.name}: {counted(len(catalog.framework.files), 'file')} of its own")
        for d in dispositions:
            print(f"           {d.line()}")
        print(f"per-rank {summary['framework']['policy']}")
        print(f"note     {REPRODUCIBILITY}")
    return summary


def _when(mtime: float) -> str:
    import time
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(mtime)) if mtime else "-"


def _metrics_words(metrics: dict) -> str:
    return " ".join(f"{k}={v:g}" for k, v in sorted(metrics.items()))


def print_listing(listing) -> None:
    """`reshard list`: one row per checkpoint, oldest first."""
    rows = listing.checkpoints
    print(f"{listing.root}: {len(rows)} checkpoint{'s' * (len(rows) != 1)} (complete: the {listing.check} proof "
          "on each one's metadata; `reshard validate --deep --checksums` reads the bytes)")
    width = max([len(r.name) for r in rows] + [4])
    print(f"  {'STEP':>8}  {'SAVED':<19}  {'SIZE':>10}  {'FORMAT':<12} {'TOPOLOGY':<16} {'STATUS':<12} NAME")
    for r in rows:
        step = "-" if r.step is None else str(r.step)
        status = "INCOMPLETE" if r.status == "incomplete" else r.status
        extra = [f"<- {', '.join(r.pinned)}"] if r.pinned else []
        if r.metrics:
            extra.append(_metrics_words(r.metrics))
        print(f"  {step:>8}  {_when(r.mtime):<19}  {human_bytes(r.bytes):>10}  {r.format or '?':<12} "
              f"{r.topology or '-':<16} {status:<12} {r.name:<{width}} {'  '.join(extra)}".rstrip())
        if r.why:
            print(f"  {'':>8}  {r.why}")
    for note in listing.notes:
        print(f"note: {note}")
    if listing.trash:
        print(f"note: {counted(len(listing.trash), 'checkpoint')} an interrupted prune renamed still on disk; "
              "`reshard prune DIR --yes` removes them")


def print_watch_pass(root: str, done) -> None:
    """`reshard watch --once`, after the lines of the pass: what is still being written, and a summary."""
    for row in done.waiting:
        print(f"{label(row)}: in progress — {row.why} ({row.name})")
    broken = sum(e.status == INCOMPLETE for e in done.reported)
    print(f"{root}: {counted(len(done.reported), 'checkpoint')} newly validated ({broken} broken), "
          f"{len(done.waiting)} in progress, {len(done.removed)} deleted")


def print_prune(plan, quiet: bool) -> None:
    """`reshard prune`: the plan (keep / delete / untouched, why), then what it frees or freed."""
    for d in plan.decisions:
        r = d.checkpoint
        step = "" if r.step is None else f"step {r.step}"
        print(f"{d.action:<9} {r.name}  {step}  {human_bytes(r.disk_bytes)}: {'; '.join(d.reasons)}")
    count = len(plan.deleting())
    if plan.executed:
        for path in plan.changed:
            print(f"reshard: {path}: its files changed since it was listed: left alone", file=sys.stderr)
        if plan.trash and not quiet:
            print(f"finished an interrupted prune: removed {counted(len(plan.trash), 'renamed checkpoint')}")
        print(f"deleted {counted(len(plan.removed), 'checkpoint')}, freed {human_bytes(plan.bytes_freed)}")
    else:
        print(f"dry run: would delete {counted(count, 'checkpoint')}, freeing {human_bytes(plan.bytes_freed)} on disk"
              + ("" if quiet else "; --yes deletes them"))
