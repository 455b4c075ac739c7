"""The names the commit protocol gives its files, in one place: what marks an output whole or unfinished, where it
is built and locked, the journals that let a killed run be resumed or finished, and what is moved aside before it
is removed. The storages (an object store's commit and delete order), staging, the manifest and the run-directory
scan import them from here; nothing else spells them.
"""
from __future__ import annotations

MANIFEST = "reshard-manifest.json"      # written last: an output holding it is whole
# An output written in place (object storage has no rename: reshard.execution.staging) holds this object from before its
# first file until after its manifest: a folder holding it and no manifest is a conversion not finished (in progress, or
# killed), never a checkpoint
UNFINISHED = ".reshard-unfinished"
STAGING_SUFFIX = ".reshard-tmp"         # `.DST.reshard-tmp`: where an output is built before its commit
LOCK_SUFFIX = ".reshard-lock"           # `.DST.reshard-lock`: held by the one writer of DST
REPLACED_SUFFIX = ".old"                # `.DST.reshard-tmp.old`: the destination a commit replaces, until it is gone
JOURNAL = ".reshard-journal"            # in the staging folder: each finished file and its sha256 (--resume)
TRASH_SUFFIX = ".reshard-trash"         # `.X.reshard-trash`: a checkpoint renamed for deletion (reshard prune)
# reshard thin's names beside a checkpoint X (reshard.lifecycle.thinning): `.X.reshard-thin` its thinned form being
# written and proven, `.X.reshard-thin-journal` the swap's journal, `.X.reshard-thinned-from` the full checkpoint once
# swapped out
THIN_SUFFIX, THIN_JOURNAL_SUFFIX, THIN_TRASH_SUFFIX = ".reshard-thin", ".reshard-thin-journal", ".reshard-thinned-from"
WATCH_STATE = ".reshard-watch.json"     # reshard watch's memory in the run directory: hidden, so never an entry
WATCH_LOCK = ".reshard-watch.lock"      # held while a watcher runs: one watcher per run directory
ATOMIC_SUFFIX = ".tmp"                  # a small file written whole beside its name, then renamed over it

