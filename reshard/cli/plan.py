"""`reshard plan`: what a conversion would read and write, without writing; exit 1 when the disk has no room."""
from __future__ import annotations

import argparse
import sys

import reshard
from reshard.cli.output import dump
from reshard.commands.inspect import human_bytes
from reshard.commands.plan import PlanSummary
from reshard.formats import REPRODUCIBILITY
from reshard.text import counted


def run(args: argparse.Namespace) -> int:
    summary = summarize(args, args.dst)
    show(args, summary)
    if not summary.disk_ok:
        print(f"reshard: {summary.free_disk_at}: {human_bytes(summary.free_disk_bytes or 0)} free, the conversion "
              f"writes {human_bytes(summary.bytes_written)}", file=sys.stderr)
        return 1
    return 0


def summarize(args: argparse.Namespace, dst: str | None) -> PlanSummary:
    """The plan of plan's (and convert's) arguments, its free-disk check at `dst`."""
    return reshard.plan(args.path, args.to, tag=args.tag, layout_rules=args.layout_rules, config=args.config,
                        tag_out=args.tag_out, fmt=args.fmt, new_rank_state=args.new_rank_state,
                        dst=dst, memory_budget=args.memory_budget, workers=args.workers,
                        names=args.names)


def show(args: argparse.Namespace, summary: PlanSummary) -> None:
    """The plan as JSON or text."""
    if args.json:
        dump(summary.to_dict())
    else:
        print_plan(summary)


def print_plan(summary: PlanSummary) -> None:
    """The plan as `reshard plan` (and `convert --dry-run`) prints it."""
    print(f"source   {summary.source}")
    print(f"         {summary.source_topology}")
    print(f"target   {summary.target}")
    if summary.stage_cut:
        print(f"stages   {summary.stage_cut.line()}")
        if summary.stage_cut.ambiguous:
            print(f"note     {summary.stage_cut.ambiguous}")
    print(f"files    {len(summary.files)} to write:")
    for f in summary.files:
        copied = " (copied)" if f.copied_from is not None else ""
        print(f"           {f.path:<56} {human_bytes(f.bytes):>10}{copied}")
    print(f"read     {human_bytes(summary.bytes_read)}")
    print(f"write    {human_bytes(summary.bytes_written)}")
    print(f"memory   copy buffers at most {human_bytes(summary.estimated_peak_buffer_bytes)} "
          f"(--memory-budget {human_bytes(summary.memory_budget)}, {counted(summary.workers, 'worker')})")
    if summary.workers > 1:
        shares = " | ".join(human_bytes(n) for n in summary.worker_bytes)
        print(f"workers  {summary.workers} copying {shares} of tensors (the largest {summary.worker_balance:.2f}× "
              "an even split; a worker takes the largest file left)")
    if summary.free_disk_bytes is None:
        print(f"disk     none needed: the output goes to object storage at {summary.free_disk_at}, streamed up "
              "(no local copy; an object store states no free space to check)")
    else:
        verdict = "enough" if summary.disk_ok else "NOT ENOUGH"
        print(f"disk     {human_bytes(summary.free_disk_bytes)} free at {summary.free_disk_at}: {verdict}")
    if summary.advice:
        print(f"advice   {summary.advice}")
    if summary.framework is not None:
        print(f"framework {summary.framework.name}: {counted(summary.framework.own_files, 'file')} of its own")
        for d in summary.framework.files:
            print(f"           {d.line()}")
        print(f"per-rank {summary.framework.policy}")
        print(f"note     {REPRODUCIBILITY}")
