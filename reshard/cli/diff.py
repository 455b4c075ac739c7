"""`reshard diff`: two checkpoints compared tensor by tensor; exit 0 equal, 1 different, 2 trouble."""
from __future__ import annotations

import argparse

import reshard
from reshard.cli.output import dump


def run(args: argparse.Namespace) -> int:
    report = reshard.diff(args.a, args.b, tag_a=args.tag_a, tag_b=args.tag_b, layout_rules=args.layout_rules,
                          config=args.config, atol=args.atol, progress=not args.quiet)
    if args.json:
        dump(report.to_dict())
    else:
        for note in [] if args.quiet else report.notes:
            print(f"note: {note}")
        for d in report.differences:
            print(d.line())
        print(report.summary())
    return 0 if report.equal else 1
