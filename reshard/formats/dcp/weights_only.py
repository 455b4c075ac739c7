"""DCP's weights-only forms: the model's state dict alone, saved by `dcp.save` as the framework's model-only option
writes it, and loaded by `dcp.load` of the model's state dict alone.

A DCP folder's `.distcp` files hold the model's chunks and the optimizer's together, so no form is a subset of its
files: the folder is written again by the DCP writer (dcp/writer.py folder_files) at the save's data-parallel size,
the model's tensors only (each parameter's weights as the model holds them, MODULE: never the fp32 masters), under
the keys the framework's model-only save gives them, every byte copied from the source's chunks.

Plain DCP (`reshard.formats.dcp.reader`): the model is what the reader names so (dcp/reader.py _model_names): the
entries under `model.` (`{"model": get_model_state_dict(m)}`, get_state_dict's spelling), under `state_dict.`, or,
with neither, every tensor outside the optimizer's `optim.`/`optimizer.`/`optimizer_0.` keys, written under the same
top-level key; `dcp.load({"model": get_model_state_dict(m)})` (or the flat dict) loads it.
"""
from __future__ import annotations

import os
from dataclasses import replace

from reshard.core.catalog import MASTER, MODULE, Catalog, TensorKey
from reshard.errors import ReshardError
from reshard.formats.dcp import keys, metadata as md, reader, writer
from reshard.formats.dcp.chunks import METADATA
from reshard.formats.weights_only import Form
from reshard.storage import files as fs

LOAD = 'dcp.load({"model": get_model_state_dict(model)}, checkpoint_id=folder) (the keys it was saved under)'
WHAT = "the optimizer state (moments, steps, param groups) and what else the save held: the model's state dict " \
       "written alone"


def model_files(catalog: Catalog, top: str | None) -> list:
    """The DCP folder of the model alone, each entry under `top.<fqn>` (planner path (top, fqn)), or its bare FQN
    (planner path (fqn,)) where `top` is None, cut over the save's data-parallel ranks."""
    tensors = []
    for entry in keys.tensor_entries(catalog):
        if not entry.key.startswith(f"{keys.MODEL}."):
            continue
        holder = entry.source[0] if isinstance(entry.source, tuple) else entry.name
        source = TensorKey(holder, MODULE)
        if source not in catalog.tensors:
            raise ReshardError.at(catalog.root, f"no weights for {entry.name} (the model's own)")
        key, path = (f"{top}.{entry.name}", (top, entry.name)) if top else (entry.name, (entry.name,))
        tensors.append((replace(entry, key=key, source=source, dtype=catalog.tensors[source].dtype), path))
    if not tensors:
        raise ReshardError.at(catalog.root, "no model entries: nothing to keep")
    return writer.folder_files(catalog, catalog.layout.dp, catalog.tag, "", tensors, [])


def check_full(catalog: Catalog, path: str) -> None:
    """A folder whose optimizer state is there to drop, thinned as the folder it is."""
    if fs.normpath(fs.abspath(path)) != fs.normpath(catalog.root):
        raise ReshardError.at(path, "thin the DCP folder itself, as `reshard list` shows it")
    if not catalog.param_groups and all(t.state in (MODULE, MASTER) for t in catalog.tensors.values()):
        raise ReshardError.at(path, "no optimizer state in it: already the model alone")


def replaced(catalog: Catalog) -> tuple[str, ...]:
    return tuple(sorted(f.path for f in catalog.files))


def form(catalog: Catalog, path: str, keep_masters: bool) -> Form:
    """A plain DCP folder written again as the model alone, under its own model key."""
    check_full(catalog, path)
    meta = md.read(os.path.join(catalog.root, METADATA))
    tops = {key.split(".", 1)[0] for key in meta.state_dict_metadata}
    top = next((t for t in reader.MODEL_KEYS if t in tops), None)
    return Form((), replaced(catalog), WHAT, LOAD, tuple(model_files(catalog, top)))
