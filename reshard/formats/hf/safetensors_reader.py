"""safetensors weights: one file, or a folder with model.safetensors / a shard index (save_pretrained).

Weights only: there is no optimizer, so inspect, validate and export work and conversion to a
training format is refused. A folder with config.json gets the model's order and ties (hf_model), unless the
caller says it names every param itself (ModelOrderOption).
"""
from __future__ import annotations

from reshard.core.catalog import Catalog, CatalogBuilder
from reshard.core.layout import Layout
from reshard.formats.hf import files as hf_files, weights as hf_weights
from reshard.formats.protocol import ModelOrderOption
from reshard.formats.single import model, safetensors_header
from reshard.formats.unpartitioned import UNPARTITIONED
from reshard.storage import files as fs

SUFFIX = ".safetensors"
INDEX_SUFFIX = ".safetensors.index.json"
FORMAT = "safetensors"
OPTIONS = ModelOrderOption
IN_FRAMEWORK_FOLDERS = False


def sniff(path: str, tag: str | None) -> bool:
    if fs.isfile(path):
        return path.endswith((SUFFIX, INDEX_SUFFIX))
    return fs.isdir(path) and hf_weights.present(path) in (hf_weights.SAFE, hf_weights.SAFE_INDEX)


def read(path: str, options: ModelOrderOption) -> Catalog:
    path = fs.abspath(path)
    if fs.isdir(path):
        folder = path
        weights = hf_weights.read(path, options.model_order is not False)
    else:
        folder = path      # a one-file source is its own root
        if path.endswith(INDEX_SUFFIX):
            tensors = safetensors_header.read_sharded(path)
            shards = dict.fromkeys(safetensors_header.read_index(path).values())
            weights = hf_weights.Weights(tensors, {}, None, [(path, "index")] + [(p, "weights") for p in shards])
        else:
            tensors, metadata = safetensors_header.read_header(path)
            tied = hf_weights.tied_metadata(path, metadata)
            weights = hf_weights.Weights(tensors, tied, list(tensors) + list(tied), [(path, "weights")])
    catalog = CatalogBuilder(root=folder, format="safetensors", layout=Layout.of(1, format_topology=UNPARTITIONED))
    for file, role in weights.files:
        model.add_file(catalog, file, role)
    model.build(catalog, weights.tensors, weights.files[-1][0], None, "", weights.aliases, weights.order,
                weights.buffers)
    if fs.isdir(path):     # a save_pretrained folder: its config and tokenizer go with the weights
        catalog.model_files = hf_files.present(path)
        catalog.save_dir = folder       # (the folder is the whole save: output beside it does not overlap it)
    return catalog.freeze()
