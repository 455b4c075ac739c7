"""`reshard convert`: write the checkpoint for another topology or format (or, with --dry-run, print the plan)."""
from __future__ import annotations

import argparse
import sys

import reshard
from reshard.cli import plan
from reshard.cli.output import print_written


def run(args: argparse.Namespace) -> int:
    if args.dry_run:
        plan.show(args, plan.summarize(args, args.dst))
        return 0
    written = reshard.convert(args.path, args.dst, args.to, tag=args.tag, layout_rules=args.layout_rules,
                              config=args.config, tag_out=args.tag_out, fmt=args.fmt,
                              new_rank_state=args.new_rank_state, workers=args.workers,
                              memory_budget=args.memory_budget, overwrite=args.overwrite, resume=args.resume,
                              progress=not args.quiet, names=args.names, digest=args.digest)
    if written is not None and written.stage_cut and not args.quiet:
        # which layers each stage holds; the note when the source could not tell
        if not args.json:
            print(f"stages   {written.stage_cut.line()}")
        if written.stage_cut.ambiguous:
            print(f"reshard: note: {written.stage_cut.ambiguous}", file=sys.stderr)
    print_written(args, args.dst, written)
    return 0
