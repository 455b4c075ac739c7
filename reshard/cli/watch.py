"""`reshard watch`: validate each checkpoint of a run as its save finishes, report it, apply a retention policy."""
from __future__ import annotations

import argparse
import signal
import sys
from types import FrameType

import reshard
from reshard.cli.args import policy as policy_of
from reshard.lifecycle import watch_state
from reshard.lifecycle.listing import COMPLETE, INCOMPLETE
from reshard.lifecycle.watching import Pass, label
from reshard.text import counted


def run(args: argparse.Namespace) -> int:
    policy = policy_of(args)
    watcher = reshard.Watcher(args.path, policy if policy.keeps_by_rule() or policy.delete_incomplete else None,
                              checksums=args.checksums, export_best=args.export_best, metric=args.metric,
                              mode=args.mode, exec_cmd=args.exec_cmd, metrics=args.metrics, recent=args.recent,
                              settle=args.settle, say=say)
    if args.once:
        done = watcher.poll()
        print_watch_pass(watcher.root, done)
        return 1 if done.broken or done.problems else 0
    stopped_by = []

    # only noted: the pass under way finishes its step, then the loop ends
    def stop(signum: int, frame: FrameType | None) -> None:
        stopped_by.append(signal.Signals(signum).name)
        watcher.stop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, stop)
    print(f"watching {watcher.root} every {args.interval:g} s (state: {watch_state.path_in(watcher.root)})",
          flush=True)
    watcher.run(args.interval)
    print(f"stopped ({stopped_by[0] if stopped_by else 'stop'})", flush=True)
    return 0


def say(text: str, error: bool) -> None:
    """Where the watcher's lines go: its problems to stderr, the rest to stdout, each at once."""
    print(text, file=sys.stderr if error else sys.stdout, flush=True)


def print_watch_pass(root: str, done: Pass) -> None:
    """`reshard watch --once`, after the lines of the pass: what is still being written, and a summary."""
    for row in done.waiting:
        print(f"{label(row)}: in progress — {row.why} ({row.name})")
    print(f"{root}: {summary(done)}")


def summary(done: Pass) -> str:
    """What the pass did, each count of something done: checkpoints validated (complete, incomplete), those it
    could not verify and kept unread, those left in progress, those deleted, and those thinned where there were."""
    validated = [e for e in done.reported if e.status in (COMPLETE, INCOMPLETE)]
    broken = sum(e.status == INCOMPLETE for e in validated)
    unread = len(done.reported) - len(validated)
    return (f"validated {counted(len(validated), 'checkpoint')} ({len(validated) - broken} complete, {broken} "
            f"incomplete), kept {unread} unverifiable or unknown unread, left {len(done.waiting)} in progress, "
            f"deleted {len(done.removed)}" + (f", thinned {len(done.thinned)}" if done.thinned else ""))
