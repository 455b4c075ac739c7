"""Megatron torch_dist saves as the tests of its output look at them: a `--to`'s degrees, one element of a written
save changed (the negative control), the objects a save holds."""
from __future__ import annotations

import os

import reshard
from conftest import write_in_zip
from reshard.core.catalog import TensorKey
from reshard.formats.dcp import metadata as dcp_metadata
from reshard.formats.megatron.pickles import METADATA_ALLOWED


def degrees(to: str) -> dict:
    return {k: int(v) for k, v in (item.split("=") for item in to.split(",")) if k in ("tp", "pp", "dp", "ep")}


def change_one_element(save, name: str) -> None:
    """One element of `name`'s exp_avg in the written files changed (its zip member's CRC-32 made to match, as a
    writer that saved another value would have written it)."""
    catalog = reshard.open_checkpoint(str(save))
    fragment = catalog.tensors[TensorKey(name, "exp_avg")].fragments[0]
    path = fragment.storage.file
    meta = dcp_metadata.read(os.path.join(catalog.root, ".metadata"), METADATA_ALLOWED)
    at = fragment.storage.offset + fragment.elem_offset * 4       # (an fp32 moment)
    start, length = next((info.offset, info.length) for info in meta.storage_data.values()
                         if info.relative_path == os.path.basename(path) and info.offset <= at < info.offset
                         + info.length)
    with open(path, "rb") as f:
        data = bytearray(f.read())
    item = save.parent / "item.zip"
    item.write_bytes(bytes(data[start:start + length]))
    value = bytes(b ^ 0x40 for b in data[at:at + 4])
    write_in_zip(item, at - start, value)
    data[start:start + length] = item.read_bytes()
    with open(path, "wb") as f:
        f.write(data)


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
