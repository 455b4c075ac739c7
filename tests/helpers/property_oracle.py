"""The oracle of the property tests: what every file of a target must hold, computed from the full tensors
with numpy indexing and DeepSpeed's own rules, and compared to the files read back by independent readers
(torch.load, torch.distributed.checkpoint's FileSystemReader). Nothing here asks reshard where anything is.

What it knows, each rule in one small function:
* tensor parallelism: AutoTP's cut (DeepSpeed's own tp_shard.get_shard_size_list, by key-value heads or
  evenly in grains) of the Llama names reshard/layouts/tp-rules/llama-autotp.json describes; Megatron's even cut
  of the names reshard/layouts/tp-rules/megatron-gpt.json describes (fused QKV, SwiGLU gate/up halves each cut,
  row parallel by columns);
* pipeline stages: DeepSpeed's partition_uniform / partition_balanced over the layers' trainable elements;
* ZeRO-1/2: a param group flattened (round-robin order, per-param alignment when configured), padded to a
  multiple of 2*dp and cut in dp equal parts; ZeRO-3: each param in ceil(n/dp) parts, grouped in sub-groups;
* DCP: every tensor cut along dim 0 as FSDP2 cuts it (torch.chunk), rank r's chunks in `__r_0.distcp`;
* universal: `zero/<param>/<state>.pt` holds the full fp32 tensor.
"""
from __future__ import annotations

import math
import os
import pickle
import re
from dataclasses import dataclass

import numpy as np
import torch

from tests.helpers.property_sources import MASTER, MODULE, Model, bits


@dataclass(frozen=True)
class Topology:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    zero: int = 1
    partition: str | None = None     # pipeline partition method named in the spec

    def spec(self, kv_heads: int | None = None) -> str:
        s = f"tp={self.tp},pp={self.pp},dp={self.dp},zero={self.zero}"
        s += f",partition={self.partition}" if self.partition else ""
        return s + (f",kv_heads={kv_heads}" if kv_heads else "")


def load(path):
    """torch.load, weights only where the file allows it (DeepSpeed's optimizer files pickle its classes)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        return torch.load(path, map_location="cpu", weights_only=False)


class Refused(Exception):
    """The oracle's verdict that the target cannot be written (a rank left empty, a dim not dividing)."""


# ------------------------------------------------------------------------------------------- tensor parallel

def _take(full, dim, sizes, rank):
    start = sum(sizes[:rank])
    return np.take(full, np.arange(start, start + sizes[rank]), axis=dim)


# which dim each family cuts (column parallel: rows, dim 0; row parallel: columns, dim 1); others are whole
AUTOTP_DIMS = ((r".*\.self_attn\.[qkv]_proj\.(weight|bias)|.*\.mlp\.(gate|up)_proj\.weight|lm_head\.weight", 0),
               (r".*\.(self_attn\.o_proj|mlp\.down_proj)\.weight", 1))
MEGATRON_DIMS = ((r".*(word_embeddings|lm_head)\.weight|.*self_attention\.query_key_value\.(weight|bias)", 0),
                 (r".*(self_attention\.dense|mlp\.dense_4h_to_h)\.weight", 1))


def _cut_dim(name, dims):
    return next((dim for pattern, dim in dims if re.fullmatch(pattern, name)), None)


def autotp_cut(name, shape, tp, kv_heads, grain):
    """(dim, per-rank sizes) of AutoTP's cut of a Llama param, or None when every rank holds it whole."""
    from deepspeed.module_inject.tp_shard import AutoTPMeta, get_shard_size_list
    if tp == 1:
        return None
    dim = _cut_dim(name, AUTOTP_DIMS)
    if dim is None:
        return None
    module = name.rsplit(".", 1)[0]     # AutoTP names the layer: "mlp" and "lm_head" in it mean an even cut
    sizes = get_shard_size_list(shape[dim], tp, AutoTPMeta(num_kv_heads=kv_heads, tp_grain_size=grain), module)
    if min(sizes) <= 0:
        raise Refused(f"{name}: AutoTP leaves a rank empty at tp={tp}")
    return dim, sizes


def autotp_shard(name, full, rank, tp, kv_heads, grain):
    cut = autotp_cut(name, full.shape, tp, kv_heads, grain)
    return full if cut is None else _take(full, cut[0], cut[1], rank)


def megatron_shard(name, full, rank, tp):
    """Megatron's cut (megatron-gpt.json): an equal 1/tp of the dim, each SwiGLU half cut on its own."""
    if tp == 1:
        return full
    if re.fullmatch(r".*mlp\.dense_h_to_4h\.(weight|bias)", name):
        halves = np.split(full, 2, axis=0) if full.shape[0] % 2 == 0 else None
        if halves is None or halves[0].shape[0] % tp:
            raise Refused(f"{name}: gate/up halves do not divide by tp={tp}")
        return np.concatenate([np.split(h, tp, axis=0)[rank] for h in halves], axis=0)
    dim = _cut_dim(name, MEGATRON_DIMS)
    if dim is None:
        return full
    if full.shape[dim] % tp:
        raise Refused(f"{name}: dim {dim} does not divide by tp={tp}")
    return np.split(full, tp, axis=dim)[rank]


# ------------------------------------------------------------------------------------------ pipeline stages

def stages(model: Model, topo: Topology) -> list:
    """Per stage, the layer indices it holds (DeepSpeed's own partition functions)."""
    from deepspeed.runtime.utils import partition_balanced, partition_uniform
    if model.layers is None:
        return [None]
    count = len(model.layers)
    if topo.pp > count:
        raise Refused(f"pp={topo.pp} but {count} layers")
    if (topo.partition or "parameters") == "uniform":
        parts = partition_uniform(count, topo.pp)
    else:
        weights = [sum(math.prod(model.param(n).shape) for _, n in layer if model.param(n).kind == "trainable")
                   for layer in model.layers]
        parts = partition_balanced(weights, topo.pp)
    return [list(range(parts[s], parts[s + 1])) for s in range(topo.pp)]


def _stage_params(model: Model, layer_ids) -> list:
    """A stage's params as its PipelineModule registers them: the tied modules its layers use, then its own."""
    used = list(dict.fromkeys(n for i in layer_ids for _, n in model.layers[i]))
    return [n for n in used if n.startswith("tied_modules.")] + [n for n in used if not n.startswith("tied_modules.")]


# --------------------------------------------------------------------------------------------------- ZeRO

def _zero12_flat(model: Model, members, sizes, dp, lp_size):
    """(flat order, element offset of each param, padded length) of one param group of params of `sizes`."""
    order = list(members)
    if model.options.get("round_robin_gradients"):
        order = [n for j in range(dp) for i, n in enumerate(members) if i % dp == j]
    align = 16 // math.gcd(16, lp_size) if model.options.get("parameter_alignment") else 1
    offsets, at = {}, 0
    for i, name in enumerate(order):
        offsets[name] = at
        at += sizes[name]
        if i < len(order) - 1:
            at += (-at) % align
    return order, offsets, at, -(-at // (2 * dp)) * 2 * dp


def _flat(values, order, offsets, length, state, shard):
    out = np.zeros(length, np.uint32)
    for name in order:
        piece = shard(name, values[(name, state)]).ravel()
        out[offsets[name]:offsets[name] + piece.size] = piece
    return out


def _zero3_sub_groups(model: Model, members, dp):
    parts = [-(-math.prod(model.param(n).shape) // dp) for n in members]
    size = model.options.get("sub_group_size", 10 ** 9)
    if size >= sum(parts):
        return [list(members)]
    out, current, total = [], [], 0
    for name, part in zip(members, parts, strict=True):
        current.append(name)
        total += part
        if total >= size or name == members[-1]:
            out.append(current)
            current, total = [], 0
    return out


# --------------------------------------------------------------------------------------------------- files

class Checker:
    """Compares what a file holds to what the oracle says, collecting every difference."""

    def __init__(self):
        self.problems = []
        self.compared = 0

    def same(self, where, got, want):
        if not isinstance(got, torch.Tensor):
            self.problems.append(f"{where}: not a tensor ({type(got).__name__})")
            return
        got_bits = bits(got).reshape(got.shape)
        if got_bits.shape != want.shape or got_bits.dtype != want.dtype or not np.array_equal(got_bits, want):
            self.problems.append(f"{where}: {got.dtype}{list(got.shape)} differs from the oracle's "
                                 f"{want.dtype}{list(want.shape)}")
        self.compared += want.size

    def equal(self, where, got, want):
        if got != want:
            self.problems.append(f"{where}: {got!r} != {want!r}")


def assert_ok(check: Checker) -> None:
    assert not check.problems, "\n".join(check.problems[:20])
    assert check.compared > 0


def tag_dir(save_dir) -> str:
    """A DeepSpeed save dir's tag folder, as `latest` names it."""
    with open(os.path.join(save_dir, "latest")) as f:
        return os.path.join(save_dir, f.read().strip())


def shard_function(model: Model, topo: Topology, kv_heads=None, grain=1):
    """rank -> (name, full) -> the shard that tensor-parallel rank holds at topo.tp."""
    if model.layers is not None:
        return lambda t: (lambda name, full: megatron_shard(name, full, t, topo.tp))
    return lambda t: (lambda name, full: autotp_shard(name, full, t, topo.tp, kv_heads, grain))


def expected_files(model: Model, topo: Topology) -> set:
    layers = [] if model.layers is None else \
        [f"layer_{i:02d}{'' if topo.tp == 1 else f'-model_{t:02d}'}-model_states.pt"
         for i in range(len(model.layers)) for t in range(topo.tp)]
    bf16 = "bf16_" if model.lp == "bfloat16" else ""
    mp = topo.tp * topo.pp
    if topo.zero == 3:
        ranks = [f"{prefix}zero_pp_rank_{r}_mp_rank_{m:02d}_{kind}_states.pt" for r in range(topo.dp)
                 for m in range(mp) for prefix, kind in (("", "model"), (bf16, "optim"))]
        return set(ranks) | set(layers)
    return ({f"mp_rank_{m:02d}_model_states.pt" for m in range(mp)} | set(layers) |
            {f"{bf16}zero_pp_rank_{r}_mp_rank_{m:02d}_optim_states.pt" for r in range(topo.dp) for m in range(mp)})


def check_deepspeed(tag_dir: str, model: Model, values: dict, topo: Topology, kv_heads=None, grain=1) -> Checker:
    """Every tensor of every file of a DeepSpeed save at `topo`, against numpy slices of the full tensors."""
    check = Checker()
    present = {n for n in os.listdir(tag_dir) if n.endswith(".pt")}
    check.equal("files", sorted(present), sorted(expected_files(model, topo)))
    shard_of = shard_function(model, topo, kv_heads, grain)
    stage_layers = stages(model, topo)
    bf16 = "bf16_" if model.lp == "bfloat16" else ""
    lp_size = 4 if model.lp == "float32" else 2
    for s, layer_ids in enumerate(stage_layers):
        held = [p.name for p in model.params] if layer_ids is None else _stage_params(model, layer_ids)
        for t in range(topo.tp):
            shard, mp = shard_of(t), s * topo.tp + t
            if topo.zero == 3:
                _check_zero3(check, tag_dir, model, values, topo, mp, shard)
                continue
            model_states = load(os.path.join(tag_dir, f"mp_rank_{mp:02d}_model_states.pt"))
            if model.layers is None:
                module = model_states["module"]
                check.equal(f"mp {mp} module keys", list(module), [p.name for p in model.params])
                for p in model.params:
                    check.same(f"mp {mp} module {p.name}", module[p.name], shard(p.name, values[(p.name, MODULE)]))
            else:
                check.equal(f"mp {mp} module", model_states["module"], None)
            check.equal(f"mp {mp} buffer_names", model_states["buffer_names"],
                        [p.name for p in model.params if p.kind == "buffer"])
            check.equal(f"mp {mp} dp_world_size", model_states["dp_world_size"], topo.dp)
            check.equal(f"mp {mp} mp_world_size", model_states["mp_world_size"], topo.tp * topo.pp)
            groups = [[n for n in held if n in set(members)] for members in model.groups]
            sizes = {n: shard(n, values[(n, MASTER)]).size for n in held if (n, MASTER) in values}
            flats = [_zero12_flat(model, members, sizes, topo.dp, lp_size) for members in groups]
            check.equal(f"mp {mp} param_shapes",
                        [{n: tuple(s) for n, s in g.items()} for g in model_states["param_shapes"]],
                        [{n: shard(n, values[(n, MASTER)]).shape for n in order} for order, *_ in flats])
            frozen = {p.name: shard(p.name, values[(p.name, MODULE)]) for p in model.params if p.kind == "frozen"
                      and p.name in held}
            if topo.zero == 2:       # ZeRO-2 also keeps each frozen param whole beside the module
                fragments = model_states["frozen_param_fragments"]
                check.equal(f"mp {mp} frozen params", list(fragments), list(frozen))
                for n, want in frozen.items():
                    check.same(f"mp {mp} frozen {n}", fragments[n], want)
            for r in range(topo.dp):
                name = f"{bf16}zero_pp_rank_{r}_mp_rank_{mp:02d}_optim_states.pt"
                inner = load(os.path.join(tag_dir, name))["optimizer_state_dict"]
                for g, (order, offsets, end, padded) in enumerate(flats):
                    part = padded // topo.dp
                    lo, hi = r * part, (r + 1) * part
                    master = _flat(values, order, offsets, padded, MASTER, shard)
                    check.same(f"{name} fp32 group {g}", inner["single_partition_of_fp32_groups"][g],
                               master[lo:max(lo, min(hi, end))])
                    for state in model.states:
                        check.same(f"{name} {state} group {g}", inner["base_optimizer_state"]["state"][g][state],
                                   _flat(values, order, offsets, padded, state, shard)[lo:hi])
                    check.equal(f"{name} partition_count", inner["partition_count"][g], topo.dp)
        if layer_ids is not None:
            for i in layer_ids:
                for t in range(topo.tp):
                    name = f"layer_{i:02d}{'' if topo.tp == 1 else f'-model_{t:02d}'}-model_states.pt"
                    layer = load(os.path.join(tag_dir, name))
                    check.equal(f"{name} keys", list(layer), [k for k, _ in model.layers[i]])
                    for key, full_name in model.layers[i]:
                        check.same(f"{name} {key}", layer[key], shard_of(t)(full_name, values[(full_name, MODULE)]))
    return check


def _check_zero3(check, tag_dir, model, values, topo, mp, shard):
    dp = topo.dp

    def part(name, state, r):
        flat = shard(name, values[(name, state)]).ravel()
        size = -(-flat.size // dp)
        out = np.zeros(size, flat.dtype)
        piece = flat[r * size:(r + 1) * size]
        out[:piece.size] = piece
        return out

    sub_groups = [sg for members in model.groups for sg in _zero3_sub_groups(model, members, dp)]
    for r in range(dp):
        name = f"zero_pp_rank_{r}_mp_rank_{mp:02d}_model_states.pt"
        states = load(os.path.join(tag_dir, name))
        check.equal(f"{name} param_shapes", [{n: tuple(s) for n, s in g.items()} for g in states["param_shapes"]],
                    [{n: model.param(n).shape for n in sg} for sg in sub_groups])
        check.equal(f"{name} buffer_names", states["buffer_names"],
                    [p.name for p in model.params if p.kind == "buffer"])
        for p in model.params:
            if p.kind == "buffer":
                check.same(f"{name} {p.name}", states["module"][p.name], values[(p.name, MODULE)])
            elif p.kind == "frozen":     # ZeRO-3 keeps a frozen param's saved dtype (ZeRO-1/2 the model's)
                got = states["frozen_param_fragments"][p.name]
                want = part(p.name, MODULE, r)
                check.same(f"{name} frozen {p.name}", got.float() if want.dtype == np.uint32 else got, want)
        name = f"{'bf16_' if model.lp == 'bfloat16' else ''}zero_pp_rank_{r}_mp_rank_{mp:02d}_optim_states.pt"
        inner = load(os.path.join(tag_dir, name))["optimizer_state_dict"]
        check.equal(f"{name} sub-groups", len(inner["fp32_flat_groups"]), len(sub_groups))
        for i, members in enumerate(sub_groups):
            check.same(f"{name} fp32 sub-group {i}", inner["fp32_flat_groups"][i],
                       np.concatenate([part(n, MASTER, r) for n in members]))
            for state in model.states:
                check.same(f"{name} {state} sub-group {i}", inner["optimizer_state_dict"]["state"][i][state],
                           np.concatenate([part(n, state, r) for n in members]))


def check_universal(save_dir: str, model: Model, values: dict, zero: int) -> Checker:
    """`zero/<param>/<state>.pt` of every trainable param: the full fp32 tensor ({'param': ...} and a step.pt
    for ZeRO-1/2; ZeRO-3's loader takes a bare flat tensor and the step from optimizer_state.pt)."""
    check = Checker()
    tag = open(os.path.join(save_dir, "latest_universal")).read().strip()
    zero_dir = os.path.join(save_dir, tag, "zero")
    folders = sorted(n for n in os.listdir(zero_dir) if os.path.isdir(os.path.join(zero_dir, n)))
    listed = model.params if zero != 3 else model.trainable()
    check.equal("param folders", folders, sorted(p.name for p in listed))
    for p in listed:      # ds_to_universal writes the module value of the others as fp32, unread
        if p.kind != "trainable":
            check.equal(f"{p.name} files", os.listdir(os.path.join(zero_dir, p.name)), [f"{MASTER}.pt"])
            check.same(f"{p.name}/{MASTER}", load(os.path.join(zero_dir, p.name, f"{MASTER}.pt"))["param"],
                       widened(model, p.name, values))
    for p in model.trainable():
        for state in (MASTER, *model.states):
            got = load(os.path.join(zero_dir, p.name, f"{state}.pt"))
            want = values[(p.name, state)]
            check.same(f"{p.name}/{state}", got if zero == 3 else got["param"], want.ravel() if zero == 3 else want)
        if zero != 3:
            check.equal(f"{p.name}/step", float(load(os.path.join(zero_dir, p.name, "step.pt"))), 7.0)
    return check


def check_dcp(path: str, model: Model, values: dict, dp: int) -> Checker:
    """Each tensor loaded whole by dcp.load; each chunk where FSDP2's dim-0 cut over dp ranks puts it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    check = Checker()
    reader = dcp.FileSystemReader(path)
    metadata = reader.read_metadata()
    want = {}
    for p in model.params:
        key = (p.name, MASTER) if p.kind == "trainable" else (p.name, MODULE)
        want[f"model.{p.name}"] = values[key]
    for p in model.trainable():
        for state in model.states:
            want[f"optim.state.{p.name}.{state}"] = values[(p.name, state)]
    tensors = {k for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    steps = {k for k in tensors if k.endswith(".step")}
    check.equal("tensor keys", sorted(tensors - steps), sorted(want))
    check.equal("step keys", sorted(steps), sorted(f"optim.state.{p.name}.step" for p in model.trainable()))
    from tests.helpers.property_sources import TORCH
    state_dict = {k: torch.empty(v.shape, dtype=TORCH[_dtype(model, k)]) for k, v in want.items()}
    dcp.load(state_dict, storage_reader=reader, no_dist=True)
    for key, array in want.items():
        check.same(key, state_dict[key], array)
        rows = array.shape[0] if array.ndim else 1
        ranks = 1 if key.startswith("model.") and model.param(key[len("model."):]).kind == "buffer" else dp
        per = -(-rows // ranks)
        expected = [((r * per,) + (0,) * (array.ndim - 1), (min(rows, (r + 1) * per) - r * per,) + array.shape[1:], r)
                    for r in range(ranks) if r * per < rows]
        entry = metadata.state_dict_metadata[key]
        got = []
        for _i, chunk in enumerate(entry.chunks):
            index = next(ix for ix in metadata.storage_data
                         if ix.fqn == key and tuple(ix.offset) == tuple(chunk.offsets))
            got.append((tuple(chunk.offsets), tuple(chunk.sizes), metadata.storage_data[index].relative_path))
        check.equal(f"{key} chunks", got, [(o, s, f"__{r}_0.distcp") for o, s, r in expected])
    return check


def _dtype(model, key):
    name = key[len("model."):] if key.startswith("model.") else None
    if name is None:
        return "float32"
    kind = model.param(name).kind
    return "int64" if kind == "buffer" else (model.lp if kind == "frozen" else "float32")


def without_16bit_copy(model: Model, values: dict) -> tuple:
    """The model and truth a DCP directory gives back: no 16-bit copy, so an fp32 model whose module weights
    are the masters, its frozen params widened to fp32 (exactly: every 16-bit number is an fp32 number)."""
    import dataclasses
    out = dict(values)
    for p in model.params:
        if p.kind == "trainable":
            out[(p.name, MODULE)] = values[(p.name, MASTER)]
        elif p.kind == "frozen":
            out[(p.name, MODULE)] = widened(model, p.name, values)
    return dataclasses.replace(model, lp="float32"), out


def widened(model: Model, name: str, values: dict) -> np.ndarray:
    """A module value cast to fp32 by torch."""
    from tests.helpers.property_sources import BITS, TORCH, dtype_of
    dtype = dtype_of(model, (name, MODULE))
    raw = values[(name, MODULE)]
    signed = {np.uint32: np.int32, np.uint16: np.int16, np.int64: np.int64}[BITS[dtype]]
    return bits(torch.from_numpy(raw.view(signed)).view(TORCH[dtype]).float())
