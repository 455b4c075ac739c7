"""Plan -> files on disk. The only place that writes tensor bytes.

Each target file is written front to back: its header, then every storage filled op by op from
source byte ranges (pread into bounded blocks, read ahead in a thread, cast if the dtypes differ)
or constants. Files are built in a Staging area (reshard.staging) and committed only when all of
them are complete; on any failure but a hard kill the staging area is removed.

Ctrl-C is acted on only where nothing is half done (class Interrupts). Python raises KeyboardInterrupt
wherever the main thread happens to be: inside a lock's `with` it leaves the lock held (a hang); inside
a zip archive's close, the archive is finished later by its garbage collection, into a sink whose
hashing pool has shut down ("cannot schedule new futures after shutdown"); before the staging area's
`try`, the lock file stays behind.
"""
from __future__ import annotations

import bisect
import contextlib
import functools
import math
import mmap
import multiprocessing
import os
import shutil
import signal
import threading
from collections import deque
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, ThreadPoolExecutor, wait
from dataclasses import dataclass

import numpy as np

from reshard import manifest
from reshard.dtypes import itemsize, numpy_carrier
from reshard.errors import ReshardError
from reshard.distributed import Solo, share
from reshard.formats import container_writer
from reshard.geometry import strides
from reshard.placement import flat_boxes, intersect
from reshard.planner import Copy, FilePlan, Gather, Plan
from reshard.progress import bar as progress_bar
from reshard.staging import Staging, fsync, write_text
from reshard.targets import Output

DEFAULT_MEMORY_BUDGET = 512 * 2**20
READ_AHEAD = 2                  # blocks read ahead of the one being written
# blocks alive per worker: read ahead, being written, waiting for the hash (HashingSink.HASH_BEHIND)
BUFFERS_PER_WORKER = READ_AHEAD + 1 + 2
MAX_CHUNK = 16 << 20            # larger blocks do not copy faster here, they only take memory
DROP_CACHE_BYTES = 1 << 20      # source reads at least this big are dropped from the page cache
SPARSE_SPAN = 2                 # a box spanning more than twice its bytes is mapped, not read whole
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
class Written:
    """What a run left on disk once committed: every file the manifest lists, with its size, and the manifest."""
    path: str
    output: Output | None
    files: tuple        # WrittenFile, in the plan's order
    manifest: str

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)

    def to_dict(self) -> dict:
        output = self.output or Output("")
        return {"path": self.path, "format": output.format, "topology": output.topology, "tag": output.tag,
                "files": [{"path": f.path, "bytes": f.size} for f in self.files], "bytes": self.size,
                "manifest": self.manifest}


def chunk_bytes(memory_budget: int, workers: int) -> int:
    return max(1 << 16, min(MAX_CHUNK, memory_budget // (BUFFERS_PER_WORKER * max(1, workers))))


def check_destination(source_root: str, dst: str, overwrite: bool, single_file: bool = False,
                      save_dir: str | None = None) -> None:
    src = os.path.realpath(source_root)
    real = os.path.realpath(dst)
    save_dir = os.path.realpath(save_dir) if save_dir else os.path.dirname(src)
    # A folder source protects its save dir too; a one-file source (a .pt, .ckpt) only itself: writing
    # beside it in its folder touches nothing it holds.
    for protected in (src, save_dir) if os.path.isdir(src) else (src,):
        if real == protected or real.startswith(protected + os.sep) or protected.startswith(real + os.sep):
            raise ReshardError.at(dst, f"the destination overlaps the source checkpoint {protected}")
    if single_file:
        if os.path.isdir(dst):
            raise ReshardError.at(dst, "is a directory, not a file name")
        if os.path.exists(dst) and not overwrite:
            raise ReshardError.at(dst, "exists (use --overwrite to replace it)")
    elif os.path.exists(dst):
        if not os.path.isdir(dst):
            raise ReshardError.at(dst, "exists and is not a directory")
        if os.listdir(dst) and not overwrite:
            raise ReshardError.at(dst, "exists and is not empty (use --overwrite to replace it)")


def execute(plan: Plan, dst: str, *, overwrite: bool = False, memory_budget: int = DEFAULT_MEMORY_BUDGET,
            workers: int = 1, progress: bool = True, single_file: bool = False, resume: bool = False,
            group=None) -> Written | None:
    """Write the plan's files under directory `dst` (or, with single_file, its one file as `dst`);
    returns what was written (None on ranks other than 0, which do not commit).

    Output is built in a temporary sibling (`.DST.reshard-tmp`) under a lock; each finished file
    is journaled with its sha256, so after a crash `resume=True` keeps the files that are whole.
    With a `group` (reshard.distributed) every rank writes its share; rank 0 commits once all
    ranks report success. Any failure but a hard kill removes the temporary sibling.
    """
    with INTERRUPTS:
        return _execute(plan, dst, overwrite, memory_budget, workers, progress, single_file, resume, group or Solo())


def _execute(plan, dst, overwrite, memory_budget, workers, progress, single_file, resume, group) -> Written | None:
    staging = Staging(dst)
    problem = None
    if group.rank == 0:
        try:
            check_destination(plan.source, staging.dst, overwrite, single_file, plan.save_dir)
            staging.acquire()
            check_free_space(plan, staging, resume)
            staging.prepare(plan, resume)
        except ReshardError as e:
            staging.release()
            problem = e
    problem = group.broadcast(problem)
    if problem is not None:
        raise problem
    error, digests = None, {}
    try:
        mine = share(plan.files, group.rank, group.world)
        digests = _write_files(mine, staging, chunk_bytes(memory_budget, workers), workers, resume,
                               progress_bar(sum(f.nbytes for f in mine), "writing", progress and group.rank == 0),
                               plan.reread())
    except BaseException as e:      # report to the others first, then re-raise
        error = e
    everyone_ok = group.all_ok(error is None)
    digests = group.gather_dicts(digests)
    if group.rank != 0:
        if error is not None:
            raise error
        if not everyone_ok:
            raise ReshardError.at(staging.dst, "another rank failed; nothing was written")
        return None
    try:
        if not everyone_ok:
            raise error or ReshardError.at(staging.dst, "another rank failed; nothing was written")
        try:
            digests.update(_write_small_files(plan, staging.tmp))
            INTERRUPTS.check()
            manifest_path = staging.commit(plan, digests, single_file)
        except OSError as e:
            raise ReshardError.at(e.filename or staging.dst, f"write failed: {e.strerror or e}") from None
    except BaseException:
        staging.discard()
        raise
    finally:
        staging.release()
    order = [f.path for f in plan.files] + [c.path for c in plan.copied] + [t.path for t in plan.texts]
    files = tuple(WrittenFile(staging.dst if single_file else os.path.join(staging.dst, path), digests[path][0])
                  for path in order)
    return Written(staging.dst, plan.output, files, manifest_path)


def check_free_space(plan: Plan, staging, resume: bool) -> None:
    need = plan.bytes_written - (staging.reusable_bytes() if resume else 0)
    free = shutil.disk_usage(os.path.dirname(staging.dst)).free
    if need > free:
        raise ReshardError.at(staging.dst, f"needs {need / 2**30:.2f} GiB to write, "
                                           f"{os.path.dirname(staging.dst)} has {free / 2**30:.2f} GiB free")


def _write_files(files, staging, chunk: int, workers: int, resume: bool, bar, reread: dict) -> dict:
    """Write the files (keeping whole ones from an interrupted run); returns {path: (size, sha256)}.
    `reread`: Plan.reread(), the source ranges read more than once."""
    digests, todo = {}, []
    done = staging.finished() if resume else {}
    for f in files:
        path = os.path.join(staging.tmp, f.path)
        if f.path in done and os.path.isfile(path) and manifest.file_digest(path) == done[f.path]:
            digests[f.path] = done[f.path]
            bar.update(f.nbytes)
        else:
            todo.append(f)
    try:
        if workers > 1 and len(todo) > 1:
            context = multiprocessing.get_context()
            stop = context.Event()
            with ProcessPoolExecutor(max_workers=workers, mp_context=context, initializer=_worker_started,
                                     initargs=(stop,)) as pool:
                jobs = {pool.submit(write_file, f, staging.tmp, chunk, None, reread): f for f in _balanced(todo)}
                try:
                    running = set(jobs)
                    while running:
                        done, running = wait(running, timeout=POLL_SECONDS, return_when=FIRST_COMPLETED)
                        for job in done:
                            path, size, sha = job.result()
                            staging.record(path, size, sha)
                            digests[path] = (size, sha)
                            bar.update(jobs[job].nbytes)
                        INTERRUPTS.check()
                except BaseException:
                    stop.set()      # running jobs stop at their next block, queued ones never start
                    for job in jobs:
                        job.cancel()
                    raise
        else:
            for f in todo:
                path, size, sha = write_file(f, staging.tmp, chunk, bar.update, reread)
                staging.record(path, size, sha)
                digests[path] = (size, sha)
    finally:
        bar.close()
    return digests


def _write_small_files(plan: Plan, root: str) -> dict:
    digests = {}
    for copied in plan.copied:
        shutil.copyfile(copied.source, os.path.join(root, copied.path))
        fsync(os.path.join(root, copied.path))
        digests[copied.path] = manifest.file_digest(os.path.join(root, copied.path))
    for text in plan.texts:     # `latest` last: it names the tag only once the tag is whole
        write_text(os.path.join(root, text.path), text.text)
        digests[text.path] = manifest.file_digest(os.path.join(root, text.path))
    return digests


def _balanced(files):
    return sorted(files, key=lambda f: -f.nbytes)


def _worker_started(stop) -> None:
    """A worker process: a Ctrl-C reaches it with its parent (one process group); both stop at a block."""
    INTERRUPTS.stop = stop
    signal.signal(signal.SIGINT, INTERRUPTS.note)


def write_file(plan: FilePlan, root: str, chunk: int, report=None, reread: dict | None = None) -> tuple:
    """Write one target file; returns (path, size, sha256). Runs in worker processes too. `reread`: source
    byte ranges other reads need again (Plan.reread), kept in the page cache.

    A reader thread fetches (and casts) the next blocks while this thread writes the current
    one, so disk reads and writes overlap; at most READ_AHEAD + 1 blocks are held.
    """
    path = os.path.join(root, plan.path)
    INTERRUPTS.check()
    sources = _SourceFiles(reread or {})
    try:
        writer = container_writer(plan.container)(path, plan.header, plan.storages, **plan.options)
        with ThreadPoolExecutor(max_workers=1) as reader, writer as zw:
            for storage in plan.storages:
                with zw.storage(storage.key, storage.nbytes) as out, \
                        contextlib.closing(_read_ahead(reader, _blocks(storage, chunk, sources))) as blocks:
                    for block in blocks:
                        INTERRUPTS.check()
                        out.write(block)
                        if report:
                            report(len(block))
    except OSError as e:
        raise ReshardError.at(path, f"write failed: {e.strerror or e}") from None
    finally:
        sources.close()
    fsync(path)
    return plan.path, writer.size, writer.sha256


def _read_ahead(pool, tasks):
    pending = deque()
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


def _blocks(storage, chunk: int, sources):
    """Callables producing the storage's bytes (target dtype) in blocks of at most `chunk` bytes."""
    dtype = storage.dtype
    out_size = itemsize(dtype)
    for op in storage.ops:
        if isinstance(op, Copy):
            in_size = itemsize(op.src_dtype)
            step = max(1, chunk // max(in_size, out_size))
            for first in range(0, op.count, step):
                n = min(step, op.count - first)
                yield functools.partial(_copy_block, sources, op, first * in_size, n * in_size, dtype)
        elif isinstance(op, Gather):
            step = max(1, chunk // max([out_size] + [itemsize(box.src_dtype) for box in op.copies]))
            for first in range(0, op.count, step):
                yield functools.partial(_gather_block, sources, op, first, min(step, op.count - first), dtype)
        else:
            step = max(1, chunk // out_size)
            for first in range(0, op.count, step):
                yield functools.partial(constant, op.value, dtype, min(step, op.count - first))


def _copy_block(sources, op, offset, nbytes, dtype):
    raw = sources.read(op.src_file, op.src_offset + offset, nbytes)
    return raw if op.src_dtype == dtype else cast(raw, op.src_dtype, dtype)


def _gather_block(sources, op, first: int, count: int, dtype: str) -> bytes:
    """Elements [first, first + count) of a Gather: the boxes of that flat range of its shard, each copied
    with strided views from one block read of its source."""
    out = np.empty(count, dtype=numpy_carrier(dtype))
    lo = op.start + first
    shard_strides = strides(op.shape)
    byte_strides = tuple(s * out.itemsize for s in shard_strides)
    filled = 0
    for box_at, box_shape in flat_boxes(op.shape, lo, lo + count):
        for box in op.copies:
            hit = intersect(box_at, box_shape, box.local, box.shape)
            if hit is None:
                continue
            at, shape = hit
            offset = box.src_offset + itemsize(box.src_dtype) * sum(
                (a - l) * s for a, l, s in zip(at, box.local, box.src_strides))
            dst = sum(a * s for a, s in zip(at, shard_strides)) - lo
            target = np.lib.stride_tricks.as_strided(out[dst:], shape, byte_strides)
            sources.copy_box(target, box.src_file, offset, box.src_strides, box.src_dtype, dtype)
            filled += math.prod(shape)
    if filled != count:
        raise AssertionError(f"a gather filled {filled} of {count} elements")   # the planner counted them
    return out.tobytes()


def constant(value, dtype: str, count: int) -> bytes:
    if dtype == "bfloat16":
        return cast(np.full(count, value, dtype="<f4").tobytes(), "float32", "bfloat16")
    return np.full(count, value, dtype=numpy_carrier(dtype)).tobytes()


def cast(raw: bytes, src: str, dst: str) -> bytes:
    """Convert element type, rounding to nearest even as torch does (bfloat16 included)."""
    return cast_array(np.frombuffer(raw, dtype=numpy_carrier(src)), src, dst).tobytes()


def cast_array(values: np.ndarray, src: str, dst: str) -> np.ndarray:
    """`cast` on an array of carrier dtype (any shape and strides); returns a new array."""
    if src == "bfloat16":
        values = (values.astype("<u4") << 16).view("<f4")
    if dst == "bfloat16":
        wide = values.astype("<f4")
        bits = wide.view("<u4")
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2")
        rounded[np.isnan(wide)] = 0x7FC0
        return rounded
    return values.astype(numpy_carrier(dst))


def _assign(target: np.ndarray, values: np.ndarray, src: str, dst: str) -> None:
    target[...] = values if src == dst else cast_array(values, src, dst)


class _SourceFiles:
    """Open source files by path; positioned reads into fresh buffers (no mapped pages kept). A big read is
    dropped from the page cache after it, unless it overlaps a range `reread` says is read again."""

    def __init__(self, reread: dict):
        self._fds = {}
        self._reread = reread

    def _read_again(self, path: str, offset: int, nbytes: int) -> bool:
        ranges = self._reread.get(path)
        if not ranges:
            return False
        i = bisect.bisect_right(ranges, (offset + nbytes,)) - 1
        return i >= 0 and ranges[i][1] > offset

    def _fd(self, path: str) -> int:
        fd = self._fds.get(path)
        if fd is None:
            try:
                fd = self._fds[path] = os.open(path, os.O_RDONLY)
            except OSError as e:
                raise ReshardError.at(path, f"cannot open: {e.strerror}") from None
        return fd

    def read(self, path: str, offset: int, nbytes: int) -> bytes:
        data = os.pread(self._fd(path), nbytes, offset)
        if len(data) != nbytes:
            raise ReshardError.at(path, f"truncated: needed bytes [{offset}, {offset + nbytes})")
        if nbytes >= DROP_CACHE_BYTES and not self._read_again(path, offset, nbytes):   # read once: drop them
            os.posix_fadvise(self._fd(path), offset, nbytes, os.POSIX_FADV_DONTNEED)
        return data

    def copy_box(self, target: np.ndarray, path: str, offset: int, box_strides: tuple, src: str, dst: str) -> None:
        """Fill `target` with the box of `target.shape` whose first element is at byte `offset` of `path` and
        whose elements are `box_strides` elements apart. The box's span is read in one block; a sparse one
        (a column slice of wide rows) is mapped instead, so only the pages it touches are read, and left in
        the page cache for the targets that take the other columns."""
        size = itemsize(src)
        span = (sum((n - 1) * s for n, s in zip(target.shape, box_strides)) + 1) * size
        byte_strides = tuple(s * size for s in box_strides)
        if span <= SPARSE_SPAN * target.size * size:
            block = np.frombuffer(self.read(path, offset, span), dtype=numpy_carrier(src))
            _assign(target, np.lib.stride_tricks.as_strided(block, target.shape, byte_strides), src, dst)
            return
        first, block = offset - offset % mmap.ALLOCATIONGRANULARITY, None
        try:
            window = mmap.mmap(self._fd(path), offset + span - first, access=mmap.ACCESS_READ, offset=first)
        except (OSError, ValueError) as e:
            raise ReshardError.at(path, f"truncated: needed bytes [{offset}, {offset + span}) ({e})") from None
        window.madvise(mmap.MADV_WILLNEED)     # read the window ahead, not page by page as it is touched
        try:
            block = np.frombuffer(window, dtype=numpy_carrier(src), offset=offset - first,
                                  count=(span - size) // size + 1)
            _assign(target, np.lib.stride_tricks.as_strided(block, target.shape, byte_strides), src, dst)
        finally:
            del block
            window.close()

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

