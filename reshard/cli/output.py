"""What every command prints alike: errors in one line, JSON, and what a write left on disk."""
from __future__ import annotations

import argparse
import json
import os
import sys

import reshard
from reshard.commands.inspect import human_bytes
from reshard.errors import ReshardError
from reshard.execution.executor import Written
from reshard.storage import files as fs
from reshard.text import counted


def error(args: argparse.Namespace, message: str, file: object) -> None:
    """One line on stderr; with --json also {"error", "file"} on stdout. Under torchrun, from rank 0 only."""
    if os.environ.get("RANK", "0") != "0":
        return
    print(f"reshard: {message}", file=sys.stderr)
    if getattr(args, "json", False):
        dump({"error": message, "file": None if file is None else str(file)})


def dump(data: object) -> None:
    json.dump(data, sys.stdout, indent=2)
    print()


def print_written(args: argparse.Namespace, dst: str, written: Written | None) -> None:
    """What is on disk now, as `validate --checksums` will find it (rank 0 only: the others have None), and what
    became of each file of the training framework around the source (Written.framework_files)."""
    if written is None:
        return
    if args.json:
        dump(written.to_dict())
    elif not args.quiet:
        assert written.output is not None       # (a write reports what it wrote)
        print(f"wrote {dst} ({written.output.words()}): {files_words(written)}, {human_bytes(written.size)}")
        for d in written.framework_files:
            print(f"  {d.line()}")
        for folder in written.left_out:
            print(f"  {folder}/ not in it: another model of the checkpoint, exported from its own folder")


def files_words(written: Written) -> str:
    """`4 checkpoint files and 3 others (latest, ...)`: the checkpoint's files counted as `validate` counts them
    (its reader, metadata only, on what was written), then the rest by name. The files are all it needs: a Hugging
    Face folder is not put in its model's order (that builds the model class with transformers: seconds, and
    hundreds of MiB for a large model)."""
    try:
        catalog = reshard.open_checkpoint(written.path, model_order=False)
    except ReshardError:    # an output no reader opens alone: every file counted
        return counted(len(written.files), "file")
    read_back = {fs.realpath(os.path.join(each.root if fs.isdir(each.root) else os.path.dirname(each.root), f.path))
                 for each in (catalog, *catalog.companions) for f in each.files}     # (every model of it)
    others = sorted(os.path.relpath(f.path, written.path) for f in written.files
                    if fs.realpath(f.path) not in read_back)
    rest = f" and {counted(len(others), 'other')} ({', '.join(others)})" if others else ""
    return f"{counted(len(written.files) - len(others), 'checkpoint file')}{rest}"
