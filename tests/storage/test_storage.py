"""reshard.storage.posix: the storage interface on a local filesystem. Positioned reads stop short only at a
file's end; a commit makes a staged tree appear whole or not at all (an old destination stays whole when it
fails); listing and delete see and remove exactly what is there; a lock keeps a second writer out."""
from __future__ import annotations

import errno
import os

import numpy as np
import pytest

from reshard.storage import posix
from reshard.storage.posix import PosixOutput, PosixSource
from reshard.storage.protocol import LockHeld

DATA = bytes(range(256)) * 64       # 16 KiB


def _tree(root) -> dict:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _stage(storage: PosixOutput, staged, files: dict) -> None:
    """Each file written as the executor writes: big ones streamed, the rest put whole."""
    for rel, data in files.items():
        path = os.path.join(staged, rel)
        storage.make_folder(os.path.dirname(path))
        if len(data) > 1000:
            with storage.stream(path, len(data)) as out:
                out.write(data[:1000])
                out.write(data[1000:])
            storage.sync(path)
        else:
            storage.put(path, data)


NEW = {"a/big.bin": DATA, "b.txt": b"latest\n", "a/c/small": b"x"}
OLD = {"old.bin": DATA[::-1], "a/big.bin": DATA[:10]}


def test_commit_puts_the_staged_tree_in_place_of_the_old_one(tmp_path):
    storage = PosixOutput()
    staged, final = tmp_path / ".out.tmp", tmp_path / "out"
    _stage(storage, final, OLD)
    _stage(storage, staged, NEW)
    storage.commit(str(staged), str(final))
    assert _tree(final) == NEW and sorted(storage.list(str(tmp_path))) == ["out"]


def test_a_failed_commit_leaves_the_old_destination_whole(tmp_path, monkeypatch):
    """The rename that would put the staged tree in place fails: the destination is the old one, whole; the
    staged tree is still there to be deleted. Negative control: the same failure hits a tree written in place."""
    storage = PosixOutput()
    staged, final = tmp_path / ".out.tmp", tmp_path / "out"
    _stage(storage, final, OLD)
    _stage(storage, staged, NEW)
    rename = os.rename

    def failing(src, dst):
        if src == str(staged):
            raise OSError(errno.EIO, "injected")
        rename(src, dst)

    monkeypatch.setattr(posix.os, "rename", failing)
    with pytest.raises(OSError, match="injected"):
        storage.commit(str(staged), str(final))
    monkeypatch.undo()
    # the old destination was moved aside before the failing rename: it is found whole under one of two names
    kept = final if final.exists() else tmp_path / ".out.tmp.old"
    assert _tree(kept) == OLD and _tree(staged) == NEW
    storage.delete(str(staged))
    assert not staged.exists()


def test_a_failed_stream_leaves_nothing_once_deleted_and_the_old_destination_untouched(tmp_path, monkeypatch):
    """Disk full half way through a big file: the error reaches the writer; deleting the staged tree leaves the
    folder as it was. Negative control: the same failure writing in place leaves a file cut short."""
    storage = PosixOutput()
    staged, final = tmp_path / ".out.tmp", tmp_path / "out"
    _stage(storage, final, OLD)
    before = _tree(tmp_path)
    monkeypatch.setattr(posix.posix_sink, "BLOCK", 4096)    # several blocks for 16 KiB
    pwrite, calls = os.pwrite, []

    def full(fd, data, offset):
        calls.append(offset)
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return pwrite(fd, data, offset)

    monkeypatch.setattr(posix.posix_sink.os, "pwrite", full)
    with pytest.raises(OSError, match="No space"):
        _stage(storage, staged, {"a/big.bin": DATA})
    storage.delete(str(staged))
    assert _tree(tmp_path) == before and sorted(storage.list(str(tmp_path))) == ["out"]
    calls.clear()
    with pytest.raises(OSError, match="No space"):     # the control: in place
        _stage(storage, final, {"a/big.bin": DATA})
    assert (final / "a/big.bin").read_bytes() != DATA and _tree(final) != OLD


def test_list_and_delete(tmp_path):
    storage = PosixOutput()
    _stage(storage, tmp_path / "t", NEW)
    assert sorted(storage.list(str(tmp_path / "t"))) == ["a", "b.txt"]
    assert sorted(storage.list(str(tmp_path / "t" / "a"))) == ["big.bin", "c"]
    storage.delete(str(tmp_path / "t" / "b.txt"))
    assert sorted(storage.list(str(tmp_path / "t"))) == ["a"] and storage.exists(str(tmp_path / "t" / "a"))
    storage.delete(str(tmp_path / "t" / "b.txt"))       # already gone: nothing to do
    storage.delete(str(tmp_path / "t"))
    assert not storage.exists(str(tmp_path / "t")) and storage.list(str(tmp_path)) == []


def test_append_and_get_and_free_bytes(tmp_path):
    storage = PosixOutput()
    path = str(tmp_path / "journal")
    storage.append(path, b"one\n")
    storage.append(path, b"two\n")
    assert storage.get(path) == b"one\ntwo\n" and storage.free_bytes(str(tmp_path)) > 0
    storage.copy(path, str(tmp_path / "copy"))
    assert storage.get(str(tmp_path / "copy")) == b"one\ntwo\n"
    with pytest.raises(OSError):
        storage.get(str(tmp_path / "missing"))


def test_a_held_lock_keeps_a_second_writer_out_until_released(tmp_path):
    storage = PosixOutput()
    path = str(tmp_path / ".out.lock")
    first = storage.lock(path)
    with pytest.raises(LockHeld):
        storage.lock(path)
    first.release()
    storage.lock(path).release()
    assert not os.path.exists(path)


def test_positioned_reads_stop_short_only_at_the_end(tmp_path):
    path = str(tmp_path / "f")
    with open(path, "wb") as f:
        f.write(DATA)
    source = PosixSource()
    try:
        assert source.size(path) == len(DATA) and source.read(path, 100, 50) == DATA[100:150]
        out = np.zeros(300, dtype=np.uint8)
        assert source.read_into(path, 1000, memoryview(out)) == 300 and out.tobytes() == DATA[1000:1300]
        assert source.read_into(path, len(DATA) - 10, memoryview(out)) == 10     # the file ends
        assert source.read(path, len(DATA) - 10, 50) == DATA[-10:]
        source.done_with(path, 0, len(DATA))
        with source.window(path, 5000, 7000) as window:
            assert bytes(window[:7000]) == DATA[5000:12000]
        assert bytes(source.view(path)[20:30]) == DATA[20:30]
        with pytest.raises((OSError, ValueError)):
            with source.window(path, len(DATA) + 4096 * 16, 10):
                pass
    finally:
        source.close()


def test_the_lifecycle_operations_replace_swap_link_and_set_aside_as_said(tmp_path):
    """What prune, watch and thin ask of a local disk (reshard.storage.protocol Renaming): put_atomic replaces a file
    whole and leaves no sibling; exchange swaps two folders in one step; link_or_copy gives the same inode (no byte
    written) with the source's times; set_aside moves a folder out of sight; found_under names a link that leads
    out and never enters it. Each checked against the state before (the controls: what changed is what was asked)."""
    from reshard.storage import files
    storage = PosixOutput()
    state = tmp_path / "state.json"
    storage.put_atomic(str(state), b"old")
    storage.put_atomic(str(state), b"new")
    assert state.read_bytes() == b"new" and sorted(os.listdir(tmp_path)) == ["state.json"]
    a, b = tmp_path / "a", tmp_path / "b"
    _stage(storage, str(a), {"x": b"from a"})
    _stage(storage, str(b), {"x": b"from b"})
    assert storage.exchange(str(a), str(b)) is True     # (Linux: renameat2 on this file system)
    assert (a / "x").read_bytes() == b"from b" and (b / "x").read_bytes() == b"from a"
    os.utime(a / "x", ns=(1_000_000_000, 2_000_000_000))
    storage.link_or_copy(str(a / "x"), str(tmp_path / "kept" / "x"))
    kept, source = os.stat(tmp_path / "kept" / "x"), os.stat(a / "x")
    assert (kept.st_ino, kept.st_mtime_ns) == (source.st_ino, 2_000_000_000)
    os.symlink(tmp_path / "b", a / "out")
    found = {f.path: f for f in files.found_under(str(a))}
    assert found[str(a / "out")].link == str(b) and str(a / "out" / "x") not in found
    assert found[str(a / "x")].size == len(b"from b") and found[str(a)].folder
    trash = storage.set_aside(str(a), str(tmp_path / ".a.trash"))
    assert not a.exists() and (tmp_path / ".a.trash" / "x").read_bytes() == b"from b"
    storage.delete(trash)
    assert not os.path.lexists(trash) and (b / "x").read_bytes() == b"from a"     # the link's target untouched
