"""Megatron torch_dist saves as the tests of its output look at them: a `--to`'s degrees, one element of a written
save changed (the negative control), the objects a save holds, where a DCP item lies and an edit of its archive."""
from __future__ import annotations

import os
import struct
import zipfile

from reshard.formats.dcp import metadata as dcp_metadata
from reshard.formats.megatron.pickles import METADATA_ALLOWED
from tests.helpers.damage import change_dcp_element, write_in_zip


def degrees(to: str) -> dict:
    return {k: int(v) for k, v in (item.split("=") for item in to.split(",")) if k in ("tp", "pp", "dp", "ep")}


def change_one_element(save, name: str) -> None:
    """One element of `name`'s exp_avg in the written files changed (its zip member's CRC-32 made to match, as a
    writer that saved another value would have written it)."""
    change_dcp_element(save, name, METADATA_ALLOWED)


def objects(save) -> dict:
    """{key: the unpickled value} of every object (not tensor) in a torch_dist save's DCP checkpoint."""
    import io

    import torch

    from reshard.core.catalog import CatalogBuilder
    from reshard.core.layout import Layout
    from reshard.formats.dcp.chunks import Chunks
    folder = os.path.join(save, "iter_0000003")
    meta = dcp_metadata.read(os.path.join(folder, ".metadata"), METADATA_ALLOWED)
    chunks = Chunks(folder, meta, CatalogBuilder(folder, "megatron", Layout.of(1, 1, 1)))
    return {key: torch.load(io.BytesIO(chunks.blob(key)), weights_only=False)
            for key, entry in meta.state_dict_metadata.items()
            if not isinstance(entry, dcp_metadata.TensorStorageMetadata)}


def chunk_span(save, key_start: str, at: tuple[int, ...] | None = None):
    """(file, offset, length) of the first DCP item whose key starts with `key_start` (the chunk at offsets `at`,
    where given) in the save's iteration folder."""
    folder = next(p for p in save.iterdir() if p.name.startswith("iter_"))
    meta = dcp_metadata.read(str(folder / ".metadata"), METADATA_ALLOWED)
    for index, info in meta.storage_data.items():
        if index.fqn.startswith(key_start) and (at is None or tuple(index.offset) == at):
            return folder / info.relative_path, info.offset, info.length
    raise AssertionError(key_start)


def rewrite_in_span(path, offset, length, edit):
    """Apply `edit(zip path)` to the torch.save archive at [offset, offset + length) of `path`, its size kept."""
    blob = path.read_bytes()
    part = path.with_suffix(".part")
    part.write_bytes(blob[offset:offset + length])
    edit(part)
    new = part.read_bytes()
    assert len(new) == length
    path.write_bytes(blob[:offset] + new + blob[offset + length:])
    part.unlink()


def bump_last_count(part) -> None:
    """The last integer the pickle of the torch.save archive `part` holds (a per_bucket_numel count, BININT2 or
    BININT) raised by 64, its CRC-32 made to match: a save that recorded another bucket size."""
    with zipfile.ZipFile(part) as zf:
        member = next(i for i in zf.infolist() if i.filename.endswith("data.pkl"))
        pickled = zf.read(member)
    header = part.read_bytes()[member.header_offset:member.header_offset + 30]
    start = member.header_offset + 30 + sum(struct.unpack_from("<HH", header, 26))
    at = max(pickled.rfind(b"M"), pickled.rfind(b"J"))       # the last count: BININT2 or BININT
    width = 2 if pickled[at:at + 1] == b"M" else 4
    value = int.from_bytes(pickled[at + 1:at + 1 + width], "little")
    write_in_zip(part, start + at + 1, (value + 64).to_bytes(width, "little"))
