"""`reshard validate`: is every element of every tensor there exactly once? Exit 0 complete, 1 not."""
from __future__ import annotations

import argparse

import reshard
from reshard.cli.output import dump
from reshard.commands.inspect import unread_parts


def run(args: argparse.Namespace) -> int:
    catalog = reshard.open_checkpoint(args.path, args.tag, args.layout_rules, args.config)
    report = reshard.validate(catalog, deep=args.deep, checksums=args.checksums, progress=not args.quiet)
    if args.json:
        dump(report.to_dict())
    else:
        for problem in report.problems:
            print(problem)
        if report.checksum_line():
            print(report.checksum_line())
        # what the proof does not cover: parts of the save that are not read (their files are checked present)
        for part in unread_parts(catalog) or ():
            print(f"not read: {part['path']}: {part['what']}")
        print(report.summary())
    return 0 if report.ok else 1
