"""`reshard list`: every checkpoint of a run directory, complete or not; exit 1 when one shown is incomplete."""
from __future__ import annotations

import reshard
from reshard.cli.output import dump
from reshard.inspection import human_bytes
from reshard.listing import INCOMPLETE
from reshard.text import counted


def run(args) -> int:
    listing = reshard.list_checkpoints(args.path, metrics=args.metrics, metric_name=args.metric, recent=args.recent,
                                       settle=args.settle)
    if args.json:
        dump(listing.to_dict())
    else:
        print_listing(listing)
    # a cron job's test: a broken checkpoint shown is a failure, without parsing --json
    return 1 if any(r.status == INCOMPLETE for r in listing.checkpoints) else 0


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
