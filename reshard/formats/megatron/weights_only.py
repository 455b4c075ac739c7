"""Megatron-LM's weights-only form: the model's torch_dist alone, as `--no-save-optim --no-save-rng` saves it and
`--no-load-optim --no-load-rng` (or `--finetune`) loads it.

An iteration folder's `.distcp` files hold the model's chunks and the optimizer's together, so the form is no subset
of its files: the folder is written again by the Megatron writer at its own topology with `sharding=none` (the
model's chunks, the layers' extra states, `common.pt` without optimizer and scheduler, `args.no_save_optim` and
`no_save_rng` set), every byte of the model's tensors copied from the source's chunks.
"""
from __future__ import annotations

import dataclasses

from reshard.core.catalog import Catalog
from reshard.errors import ReshardError
from reshard.formats.megatron import writer
from reshard.formats.megatron.topology import WEIGHTS_ONLY, MegatronTopology
from reshard.formats.weights_only import Form
from reshard.storage import files as fs

LOAD = "Megatron-LM's load_checkpoint with --no-load-optim --no-load-rng (or --finetune)"


def form(catalog: Catalog, path: str, keep_masters: bool) -> Form:
    """The iteration folder `path` written again as the model alone."""
    topology = catalog.layout.format_topology
    if fs.normpath(fs.abspath(path)) != fs.normpath(catalog.root) or not isinstance(topology, MegatronTopology):
        raise ReshardError.at(path, "thin a Megatron-LM save's iteration folder (iter_NNNNNNN), as `reshard list` "
                                    "shows it")
    if topology.sharding == WEIGHTS_ONLY:
        raise ReshardError.at(path, "already the model alone (saved without its optimizer)")
    model, master = catalog.weight_dtypes()
    if keep_masters and master and model != master:
        raise ReshardError.at(path, f"--keep-masters: Megatron's model of this {model} run is saved in {model}; "
                                    "writing its fp32 masters as the model is not built")
    target = dataclasses.replace(catalog.layout, format_topology=dataclasses.replace(topology, sharding=WEIGHTS_ONLY,
                                                                                     vocab=None))
    prefix = f"{catalog.tag}/"
    # (the save dir's tracker lies beside the iteration folder: no file of the checkpoint)
    written = tuple(dataclasses.replace(f, path=f.path[len(prefix):])
                    for f in writer.target_files(catalog, target, catalog.tag) if f.path.startswith(prefix))
    replaced = tuple(sorted(f.path for f in catalog.files))
    return Form((), replaced, "the optimizer state (fp32 masters, both moments), its scheduler and the RNG state: "
                              "the model's torch_dist written alone", LOAD, written)


__all__ = ["form", "LOAD"]
