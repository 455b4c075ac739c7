"""Plan -> files on disk. The only place that writes tensor bytes.

Each target file is written front to back: its header, then every storage filled op by op from
source byte ranges (positioned reads into bounded blocks, read ahead in a thread, cast if the dtypes differ)
or constants. Bytes are read and written through the storage interface (reshard.storage). Files are built in a
Staging area (reshard.execution.staging) and committed only when all of them are complete and every source member read
has the CRC-32 its zip stores (reshard.reading.checksums); on any failure but a hard kill the staging area is removed.

Ctrl-C is acted on only where nothing is half done (class Interrupts). Python raises KeyboardInterrupt
wherever the main thread happens to be: inside a lock's `with` it leaves the lock held (a hang); inside
a zip archive's close, the archive is finished later by its garbage collection, into a sink whose
hashing pool has shut down ("cannot schedule new futures after shutdown"); before the staging area's
`try`, the lock file stays behind.
"""
from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import threading
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, BinaryIO, cast

from reshard import digests, paths
from reshard.core.planner import FilePlan, Plan
from reshard.core.write_requests import Output, StageCut
from reshard.errors import ReshardError
from reshard.execution import manifest
from reshard.execution.distributed import Solo, share
from reshard.execution.progress import bar as progress_bar
from reshard.execution.staging import Staging, output_path
from reshard.execution.target_bytes import BlockRing, SourceFiles, storage_blocks
from reshard.reading import checksums
from reshard.reading.checksums import Tally
from reshard.storage import files as fs
from reshard.storage.protocol import OutputStorage
from reshard.storage.routing import LOCAL_STREAM_BUFFER_BYTES, output_for

DEFAULT_MEMORY_BUDGET = 512 * 2**20
READ_AHEAD = 2                  # blocks read ahead of the one being written
RING_BLOCKS = READ_AHEAD + 1            # blocks alive per worker: read ahead, and the one being written
# the memory of blocks per worker, besides its file's stream (STREAM_BUFFER_BYTES): the ring's, and its scratch a
# block to cast is read into (BlockRing.scratch)
BUFFERS_PER_WORKER = RING_BLOCKS + 1
MAX_CHUNK = 16 << 20            # larger blocks do not copy faster here, they only take memory
POLL_SECONDS = 0.1              # how often a parent waiting for its workers looks for a Ctrl-C


class Interrupts:
    """SIGINT while the executor runs: its handler only notes it; `check()` raises KeyboardInterrupt at the
    points where nothing is half done: before each block, between files, before the commit. A worker
    process also stops when its parent sets `stop`. The executor's pools, sinks and staging area then
    close in their ordinary order, and the interrupt reaches the caller as a KeyboardInterrupt."""

    def __init__(self):
        self.noted = self.armed = False
        self.stop = None        # in a worker process: the parent's multiprocessing Event

    def note(self, signum, frame) -> None:
        self.noted = True

    def check(self) -> None:
        if self.noted or (self.stop is not None and self.stop.is_set()):
            raise KeyboardInterrupt

    def __enter__(self):
        # Only Python's own handler in the main thread is replaced: a SIGINT the shell ignores (a
        # background job) or a handler the embedding program installed is left alone.
        self.armed = (threading.current_thread() is threading.main_thread()
                      and signal.getsignal(signal.SIGINT) is signal.default_int_handler)
        if self.armed:
            self.noted = False
            signal.signal(signal.SIGINT, self.note)
        return self

    def __exit__(self, exc_type, *exc):
        if self.armed:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            if exc_type is None:
                self.check()    # a Ctrl-C during the commit: the destination is whole, and still say so


INTERRUPTS = Interrupts()      # SIGINT is per process: one instance, also in each worker process


@dataclass(frozen=True)
class WrittenFile:
    path: str       # where it is now, under the destination
    size: int       # bytes on disk


@dataclass(frozen=True)
class StagedFile:
    """One target file written in the staging area (by this process or a worker): what the journal and the
    manifest record of it, and the CRC-32s of the source blocks its copies read (checksums.Tally.pieces)."""
    path: str       # relative to the destination
    size: int
    digest: str     # hex, of the run's algorithm (reshard.digests)
    pieces: dict


@dataclass(frozen=True)
class Written:
    """What a run left on disk once committed: every file the manifest lists, with its size, and the manifest;
    for a conversion also how its pipeline stages cut the layers and what became of the training framework's
    own files (Disposition)."""
    path: str
    output: Output | None
    files: tuple[WrittenFile, ...]      # in the plan's order
    manifest: str
    stage_cut: StageCut | None = None
    framework_files: tuple = ()
    # the source's other models an export does not hold (a verl step's critic/ beside the actor it exports)
    left_out: tuple[str, ...] = ()

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)

    def to_dict(self) -> dict:
        """Plain data: what `reshard convert --json` and `reshard export --json` print."""
        output = self.output or Output("")
        data: dict[str, object] = {
            "path": self.path, "format": output.format, "topology": output.topology, "tag": output.tag,
            "files": [{"path": f.path, "bytes": f.size} for f in self.files], "bytes": self.size,
            "manifest": self.manifest}
        if self.framework_files:
            data["framework_files"] = [d.to_dict() for d in self.framework_files]
        if self.left_out:
            data["left_out"] = list(self.left_out)
        return data


def chunk_bytes(memory_budget: int, workers: int, stream_bytes: int = LOCAL_STREAM_BUFFER_BYTES) -> int:
    """Bytes of one block read, the budget shared by the workers, each also holding one open stream's
    `stream_bytes` (the storage's STREAM_BUFFER_BYTES)."""
    per_worker = memory_budget // max(1, workers) - stream_bytes
    return max(1 << 16, min(MAX_CHUNK, per_worker // BUFFERS_PER_WORKER))


def buffer_bytes(memory_budget: int, workers: int, stream_bytes: int = LOCAL_STREAM_BUFFER_BYTES) -> int:
    """The bytes of blocks alive at once while writing (reads ahead, the streams' buffers)."""
    return (BUFFERS_PER_WORKER * chunk_bytes(memory_budget, workers, stream_bytes) + stream_bytes) * max(1, workers)


def check_destination(plan: Plan, staging: Staging, overwrite: bool, single_file: bool = False) -> None:
    """Refuse, before anything is written, a run that would write into the source: every path it writes (its
    files placed under the staging folder, each refused if its name leads out; the destination; the folder,
    lock and manifest beside it), resolved, must lie apart from the source checkpoint."""
    src = fs.realpath(plan.source)
    dst = staging.dst
    # A folder source protects its save dir too; a one-file source (a .pt, .ckpt) only itself: writing
    # beside it in its folder touches nothing it holds.
    protected = (src, fs.realpath(plan.save_dir or os.path.dirname(src))) if fs.isdir(src) else (src,)
    for path in staging.paths(plan, single_file):
        hit = next((p for p in protected if paths.overlap(path, p)), None)
        if hit is not None:
            also = "" if path == dst else f" (it would write {path})"
            raise ReshardError.at(dst, f"the destination overlaps the source checkpoint {hit}{also}")
    if single_file:
        if fs.isdir(dst):
            raise ReshardError.at(dst, "is a directory, not a file name")
        if fs.exists(dst) and not overwrite:
            raise ReshardError.at(dst, "exists (use --overwrite to replace it)")
    elif fs.exists(dst):
        if not fs.isdir(dst):
            raise ReshardError.at(dst, "exists and is not a directory")
        if fs.listdir(dst) and not overwrite and not staging.leftover():     # (what a killed run left is its own)
            raise ReshardError.at(dst, "exists and is not empty (use --overwrite to replace it)")


def execute(plan: Plan, dst: str, *, overwrite: bool = False, memory_budget: int = DEFAULT_MEMORY_BUDGET,
            workers: int = 1, progress: bool = True, single_file: bool = False, resume: bool = False,
            group=None, storage: OutputStorage | None = None, digest: str = digests.DEFAULT) -> Written | None:
    """Write the plan's files under directory `dst` (or, with single_file, its one file as `dst`);
    returns what was written (None on ranks other than 0, which do not commit).

    Output is built in a temporary sibling (`.DST.reshard-tmp`) under a lock; each finished file
    is journaled with its digest, so after a crash `resume=True` keeps the files that are whole.
    With a `group` (reshard.execution.distributed) every rank writes its share; rank 0 commits once all
    ranks report success. Any failure but a hard kill removes the temporary sibling. `storage`: where the output
    is written (reshard.storage; by default the local filesystem). `digest`: the algorithm of every file's digest in
    the manifest (reshard.digests: BLAKE3 by default, sha256 or XXH3-128).
    """
    with INTERRUPTS:
        return _execute(plan, Staging(dst, storage), overwrite, memory_budget, workers, progress, single_file,
                        resume, group or Solo(), digest)


def _execute(plan, staging, overwrite, memory_budget, workers, progress, single_file, resume,
             group, algorithm) -> Written | None:
    problem = None
    if group.rank == 0:
        try:
            check_destination(plan, staging, overwrite, single_file)
            staging.acquire()
            staging.choose(single_file)
            check_free_space(plan, staging, resume)
            staging.prepare(plan, resume)
        except ReshardError as e:
            staging.release()
            problem = e
    problem, in_place = group.broadcast((problem, staging.in_place))
    if problem is not None:
        raise problem
    staging.use(in_place)
    error, written, tally = None, {}, Tally()
    try:
        mine = share(plan.files, group.rank, group.world)
        chunk = chunk_bytes(memory_budget, workers, staging.storage.STREAM_BUFFER_BYTES)
        written = _write_files(mine, staging, chunk, workers, resume,
                               progress_bar(sum(f.nbytes for f in mine), "writing", progress and group.rank == 0),
                               plan.reread(), _by_file(plan.checked), tally, algorithm)
    except BaseException as e:      # report to the others first, then re-raise
        error = e
    everyone_ok = group.all_ok(error is None)
    written = group.gather_dicts(written)
    read = group.gather_dicts({group.rank: tally.pieces()})
    if group.rank != 0:
        if error is not None:
            raise error
        if not everyone_ok:
            raise ReshardError.at(staging.dst, "another rank failed; nothing was written")
        return None
    try:
        if not everyone_ok:
            raise error or ReshardError.at(staging.dst, "another rank failed; nothing was written")
        _verify_sources(plan, read.values())
        try:
            written.update(_write_small_files(plan, staging.tmp, staging.storage, algorithm))
            INTERRUPTS.check()
            manifest_path = staging.commit(plan, written, single_file, algorithm)
        except OSError as e:
            raise ReshardError.at(e.filename or staging.dst, f"write failed: {e.strerror or e}") from None
    except BaseException:
        staging.discard()
        raise
    finally:
        staging.release()
    order = [f.path for f in plan.files] + [c.path for c in plan.copied] + [t.path for t in plan.texts]
    files = tuple(WrittenFile(staging.dst if single_file else os.path.join(staging.dst, path), written[path][0])
                  for path in order)
    return Written(staging.dst, plan.output, files, manifest_path)


def _verify_sources(plan: Plan, pieces) -> None:
    """The CRC-32 of every checksummed member the plan reads from, each whole, from the blocks every rank read
    (and what they left out, read now); the first mismatch raised. Before the commit: a corrupt source leaves
    nothing, whatever --resume kept."""
    for problem in checksums.problems_of(pieces, plan.checked):
        raise problem


def check_free_space(plan: Plan, staging, resume: bool) -> None:
    need = plan.bytes_written - (staging.reusable_bytes() if resume else 0)
    free = staging.storage.free_bytes(os.path.dirname(staging.dst))
    if free is not None and need > free:     # (None: a store stating no free space refuses a write itself)
        raise ReshardError.at(staging.dst, f"needs {need / 2**30:.2f} GiB to write, "
                                           f"{os.path.dirname(staging.dst)} has {free / 2**30:.2f} GiB free")


def _by_file(storages) -> dict:
    """{source path: [storage]}: what each target file's reads are looked up in."""
    out: dict[str, list] = {}
    for storage in storages:
        out.setdefault(storage.file, []).append(storage)
    return out


def _write_files(files, staging, chunk: int, workers: int, resume: bool, bar, reread: dict, checked: dict,
                 tally: Tally, algorithm: str) -> dict:
    """Write the files (keeping whole ones from an interrupted run); returns {path: (size, hex digest)}.
    `reread`: Plan.reread(), the source ranges read more than once; `checked`: the checksummed source storages
    by path, whose blocks read are noted in `tally`; `algorithm`: the digest's (reshard.digests)."""
    written, todo = {}, []
    done = staging.finished() if resume else {}
    for f in files:
        path = staging.place(f.path)
        size, journaled, digest = done.get(f.path, (None, None, None))
        # kept only with the run's algorithm (one per manifest), and only if it still has what the journal says
        if journaled == algorithm and fs.isfile(path) and manifest.file_digest(path, algorithm) == (size, digest):
            written[f.path] = (size, digest)
            bar.update(f.nbytes)
        else:
            todo.append(f)
    try:
        if workers > 1 and len(todo) > 1:
            context = multiprocessing.get_context()
            stop = context.Event()
            with ProcessPoolExecutor(max_workers=workers, mp_context=context, initializer=_worker_started,
                                     initargs=(stop,)) as pool:
                jobs = {pool.submit(write_file, f, staging.tmp, chunk, None, reread, _members(f, checked),
                                    staging.storage, algorithm): f
                        for f in _balanced(todo)}
                try:
                    running = set(jobs)
                    while running:
                        done, running = wait(running, timeout=POLL_SECONDS, return_when=FIRST_COMPLETED)
                        for job in done:
                            _staged(job.result(), staging, written, tally, algorithm)
                            bar.update(jobs[job].nbytes)
                        INTERRUPTS.check()
                except BaseException:
                    stop.set()      # running jobs stop at their next block, queued ones never start
                    for job in jobs:
                        job.cancel()
                    raise
        else:
            for f in todo:
                _staged(write_file(f, staging.tmp, chunk, bar.update, reread, _members(f, checked), staging.storage,
                                   algorithm), staging, written, tally, algorithm)
    finally:
        bar.close()
    return written


def _staged(done: StagedFile, staging: Staging, written: dict, tally: Tally, algorithm: str) -> None:
    """A file finished: journaled (for --resume), its digest kept for the manifest, its source reads tallied."""
    tally.merge(done.pieces)
    staging.record(done.path, done.size, algorithm, done.digest)
    written[done.path] = (done.size, done.digest)


def _write_small_files(plan: Plan, root: str, storage: OutputStorage, algorithm: str) -> dict:
    written = {}
    for copied in plan.copied:
        path = output_path(root, copied.path)
        storage.copy(copied.source, path)
        written[copied.path] = manifest.file_digest(path, algorithm)
    for text in plan.texts:     # `latest` last: it names the tag only once the tag is whole
        path = output_path(root, text.path)
        storage.put(path, text.text.encode() if isinstance(text.text, str) else text.text)
        written[text.path] = manifest.file_digest(path, algorithm)
    return written


def _balanced(files):
    return sorted(files, key=lambda f: -f.nbytes)


def _worker_started(stop) -> None:
    """A worker process: a Ctrl-C reaches it with its parent (one process group); both stop at a block."""
    INTERRUPTS.stop = stop
    signal.signal(signal.SIGINT, INTERRUPTS.note)


def _members(file: FilePlan, checked: dict) -> list:
    return [storage for path in file.source_files() for storage in checked.get(path, ())]


def write_file(plan: FilePlan, root: str, chunk: int, report=None, reread: dict | None = None,
               members=(), output: OutputStorage | None = None, algorithm: str = digests.DEFAULT) -> StagedFile:
    """Write one target file; returns what was written, with the CRC-32s of the blocks read from `members`.
    Runs in worker processes too. `reread`: source byte ranges other reads need again (Plan.reread), kept in the
    page cache. `output`: where the file is written (by default the local filesystem).

    A reader thread fetches (and casts) the next blocks while this thread writes the current
    one, so disk reads and writes overlap; at most READ_AHEAD + 1 blocks are held.
    """
    path = output_path(root, plan.path)
    storage_out: OutputStorage = output or output_for(path)
    INTERRUPTS.check()
    sources = SourceFiles(reread or {}, Tally(members))
    sources.will_read(plan.source_reads())
    ring = BlockRing(chunk, RING_BLOCKS)
    try:
        # (a WriteStream is written as a binary file: the containers' zip and header writers take it as one)
        with ThreadPoolExecutor(max_workers=1) as reader, storage_out.stream(path, plan.size, algorithm) as stream, \
                plan.container.writer(cast(BinaryIO, stream), plan.header, plan.storages) as zw:
            for storage in plan.storages:
                produce = storage_blocks(storage, chunk, sources, ring)
                with zw.storage(storage.key, storage.nbytes) as out, \
                        contextlib.closing(_read_ahead(reader, produce)) as blocks:
                    for block in blocks:
                        INTERRUPTS.check()
                        out.write(block)
                        if report:
                            report(memoryview(block).nbytes)
    except OSError as e:
        raise ReshardError.at(path, f"write failed: {e.strerror or e}") from None
    finally:
        sources.close()
    storage_out.sync(path)
    return StagedFile(plan.path, stream.size, stream.digest, sources.tally.pieces())


def _read_ahead(pool, tasks):
    pending: deque[Future[Any]] = deque()
    try:
        for task in tasks:
            pending.append(pool.submit(task))
            if len(pending) > READ_AHEAD:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:    # the writer stopped (an error, a Ctrl-C): read nothing more, before the pool closes
        for job in pending:
            job.cancel()
