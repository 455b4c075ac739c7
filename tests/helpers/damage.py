"""Checkpoint bytes changed as a writer would have written them, or mutated at random."""
from __future__ import annotations

import os
from pathlib import Path


def write_in_zip(path, offset: int, data: bytes) -> None:
    """Write `data` at byte `offset` of a torch.save zip, inside one member, and give that member the CRC-32 of
    its new bytes (local header, data descriptor if any, central directory): a file saved with other values, as
    a writer would have made it, not a corrupt one (reshard checks every member's CRC-32 as it reads it)."""
    import struct
    import zipfile
    import zlib
    with zipfile.ZipFile(path) as zf:
        infos, directory = zf.infolist(), zf.start_dir
    with open(path, "r+b") as f:
        for info in infos:
            f.seek(info.header_offset)
            local = f.read(30)
            start = info.header_offset + 30 + sum(struct.unpack_from("<HH", local, 26))
            if start <= offset and offset + len(data) <= start + info.compress_size:
                break
        else:
            raise AssertionError(f"bytes [{offset}, {offset + len(data)}) are not inside one member of {path}")
        f.seek(offset)
        f.write(data)
        f.seek(start)
        crc = struct.pack("<I", zlib.crc32(f.read(info.compress_size)))
        if info.flag_bits & 0x08:        # streamed: the CRC is in a data descriptor after the data
            f.seek(start + info.compress_size)
            signed = f.read(4) == b"PK\x07\x08"
            f.seek(start + info.compress_size + 4 * signed)
        else:
            f.seek(info.header_offset + 14)
        f.write(crc)
        at = directory
        while True:
            f.seek(at)
            entry = f.read(46)
            assert entry[:4] == b"PK\x01\x02", f"no central directory entry for {info.filename}"
            name_len, extra_len, comment_len = struct.unpack_from("<HHH", entry, 28)
            if f.read(name_len).decode() == info.filename:
                f.seek(at + 16)
                f.write(crc)
                return
            at += 46 + name_len + extra_len + comment_len


def change_dcp_element(folder, name: str, allowed: dict | None = None, state: str = "exp_avg") -> None:
    """One element of `name`'s exp_avg (or fp32 `state`: "module", its weights) changed in the DCP files under
    `folder` (its zip member's CRC-32 made to
    match, as a save of another value would have written it); `allowed`: the allow-list its `.metadata` needs
    (Megatron's), None for DCP's own."""
    import reshard
    from reshard.core.catalog import TensorKey
    from reshard.formats.dcp import metadata as dcp_metadata
    catalog = reshard.open_checkpoint(str(folder))
    fragment = catalog.tensors[TensorKey(name, state)].fragments[0]
    path = fragment.storage.file
    meta = dcp_metadata.read(os.path.join(os.path.dirname(path), ".metadata"), allowed)    # (the rank file's folder's)
    at = fragment.storage.offset + fragment.elem_offset * 4       # (an fp32 moment)
    start, length = next((info.offset, info.length) for info in meta.storage_data.values()
                         if info.relative_path == os.path.basename(path) and info.offset <= at < info.offset
                         + info.length)
    with open(path, "rb") as f:
        data = bytearray(f.read())
    item = Path(folder).parent / "item.zip"
    item.write_bytes(bytes(data[start:start + length]))
    write_in_zip(item, at - start, bytes(b ^ 0x40 for b in data[at:at + 4]))
    data[start:start + length] = item.read_bytes()
    item.unlink()
    with open(path, "wb") as f:
        f.write(data)


def mutated(data, raw: bytes) -> bytes:
    """`raw` with 1-8 random flips, cuts, insertions and zeroed runs drawn from hypothesis `data`."""
    from hypothesis import strategies as st
    blob = bytearray(raw)
    for _ in range(data.draw(st.integers(1, 8))):
        kind = data.draw(st.sampled_from(["flip", "cut", "insert", "zero"]))
        at = data.draw(st.integers(0, max(0, len(blob) - 1)))
        if kind == "flip" and blob:
            blob[at] ^= data.draw(st.integers(1, 255))
        elif kind == "cut":
            del blob[at:at + data.draw(st.integers(1, 64))]
        elif kind == "insert":
            blob[at:at] = data.draw(st.binary(min_size=1, max_size=16))
        else:
            blob[at:at + 8] = bytes(min(8, len(blob) - at))
    return bytes(blob)


def alter_weight(tag_dir, state: str, size: int, crc: bool = True, name: str = "l1.weight") -> None:
    """One element of `name`'s `state` (the module's 16-bit copy, or ZeRO-3's fp32 partition) in the thinned
    tag folder flipped, the zip member's CRC-32 made to match (a file saved with another value) unless `crc` is
    False (a corrupt file)."""
    from reshard import open_checkpoint
    from reshard.core.catalog import TensorKey
    catalog = open_checkpoint(str(tag_dir))
    fragment = catalog.tensors[TensorKey(name, state)].fragments[0]
    at = fragment.storage.offset + fragment.elem_offset * size
    path = fragment.storage.file
    original = open(path, "rb").read(at + size)[at:]
    flipped = bytes(b ^ 0x40 for b in original)
    if crc:
        write_in_zip(path, at, flipped)
        return
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(flipped)


def _holder(tensor, element):
    """(fragment, position in its shard) of the fragment holding flat element `element` of the logical tensor."""
    import numpy as np

    from reshard.core.placement import Shard, regions
    coords = np.unravel_index(element, tensor.shape)
    for frag in tensor.fragments:
        shard = frag.shard or Shard.whole(tensor.shape)
        for r in regions(shard, frag.start, frag.stop):
            if all(a <= c < a + n for c, a, n in zip(coords, r.at, r.shape, strict=True)):
                local = [c - a + lo for c, a, lo in zip(coords, r.at, r.local, strict=True)]
                return frag, int(np.ravel_multi_index(local, shard.shape))
    raise AssertionError(f"no fragment holds element {element}")


def set_element(catalog, name, state, element, change) -> None:
    """Replace one element x of the fp32 tensor (name, state) by change(x) in the file that holds it."""
    import numpy as np

    from reshard.core.dtypes import itemsize
    tensor = catalog.tensor(name, state)
    frag, position = _holder(tensor, element)
    offset = frag.storage.offset + (frag.elem_offset + position - frag.start) * itemsize(tensor.dtype)
    with open(frag.storage.file, "rb") as f:
        f.seek(offset)
        value = np.frombuffer(f.read(4), dtype="<f4")[0]
    write_in_zip(frag.storage.file, offset, np.float32(change(value)).tobytes())


def edit_dcp_metadata(path, edit) -> None:
    """`edit` (a function of the unpickled Metadata) applied to a DCP folder's .metadata, written back in place."""
    import pickle
    meta_path = Path(path) / ".metadata"
    with open(meta_path, "rb") as f:
        meta = pickle.load(f)
    edit(meta)
    with open(meta_path, "wb") as f:
        pickle.dump(meta, f)


def set_step(path, value: float) -> None:
    """Rewrite one rank's optimizer file (ZeRO-1/2 or 3) with every step it holds a float32 `value`, as torch's
    Adam saves it (what a file of another save, or a flipped bit, would hold)."""
    import torch
    sd = torch.load(path, weights_only=False)
    inner = sd["optimizer_state_dict"]
    state = inner["base_optimizer_state" if "base_optimizer_state" in inner else "optimizer_state_dict"]["state"]
    for entry in state.values():
        entry["step"] = torch.tensor(value, dtype=torch.float32)
    torch.save(sd, path)


# What validate says of a 4-rank save's file whose steps set_step made 3.0000002 among the others' 3
ODD_STEP = ("param group 0: optimizer step is 3.000000238418579 here, 3.0 in the other 3 files "
            "(a file from another save?)")


def flip_weight(folder: Path, name: str) -> None:
    """One byte of `name`'s weights flipped in place, its zip member's CRC-32 left as it was."""
    import reshard
    from reshard.core.catalog import TensorKey
    fragment = reshard.open_checkpoint(str(folder)).tensors[TensorKey(name, "module")].fragments[0]
    at = fragment.storage.offset + fragment.elem_offset * 4
    data = bytearray(open(fragment.storage.file, "rb").read())
    data[at] ^= 0x40
    open(fragment.storage.file, "wb").write(bytes(data))
