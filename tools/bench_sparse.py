"""`bench.py make-synthetic --sparse`: a Llama-70B-shaped tp=8 x pp=2 ZeRO-1 checkpoint as sparse files.

The model is a Megatron-DeepSpeed GPTModelPipe of Llama-2-70B's shapes (hidden 8192, SwiGLU 28672, 64
query / 8 key-value heads fused in query_key_value, 80 layers, vocabulary 32000, untied head, RMSNorm):
a PipelineModule of Megatron-style TP layers, what reshard/layouts/tp-rules/megatron-gpt.json describes. reshard's own
DeepSpeed writer lays out every file (pickles, ZeRO-1 flat partitions, layer files, `latest`), from a
catalog of that model at tp=1 re-cut to the target by Megatron's even cut; this module writes each file's
zip framing and header for real and leaves every storage's bytes a hole (lseek past them), with the CRC32
the zip entry of that many zero bytes has. About 0.97 TB apparent, a few MB on disk; a reader that
opens a storage reads zeros.
"""
from __future__ import annotations

import hashlib
import os
import struct
import zipfile

from reshard.core.catalog import (
    MASTER,
    MODULE,
    Catalog,
    CatalogBuilder,
    ParamInfo,
    ScalarTensor,
    TensorDraft,
    TrainingState,
)
from reshard.core.layout import Layout
from reshard.core.write_requests import CopiedFile, TensorFile, TextFile
from reshard.execution.target_bytes import constant
from reshard.formats import writer
from reshard.formats.deepspeed import standins
from reshard.formats.deepspeed.notes import DeepSpeedNotes
from reshard.formats.deepspeed.topology import DeepSpeedTopology
from reshard.formats.torchsave_write import ALIGNMENT

VOCAB, HIDDEN, FFN, HEADS, KV_HEADS, HEAD_DIM = 32000, 8192, 28672, 64, 8, 128
RULES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "reshard", "layouts", "tp-rules",
                     "megatron-gpt.json")
STATES = ["exp_avg", "exp_avg_sq"]
TAG = "global_step1"


def llama70b_layers(layers: int) -> list:
    """[(layer index, [(key in its layer file, shape)])], as GPTModelPipe numbers its layer files."""
    block = [("input_layernorm.weight", (HIDDEN,)),
             ("self_attention.query_key_value.weight", ((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN)),
             ("self_attention.dense.weight", (HIDDEN, HEADS * HEAD_DIM)),
             ("post_attention_layernorm.weight", (HIDDEN,)),
             ("mlp.dense_h_to_4h.weight", (2 * FFN, HIDDEN)),
             ("mlp.dense_4h_to_h.weight", (HIDDEN, FFN))]
    return ([(0, [("word_embeddings.weight", (VOCAB, HIDDEN))])] + [(1 + i, block) for i in range(layers)]
            + [(layers + 1, [("final_layernorm.weight", (HIDDEN,))]),
               (layers + 2, [("lm_head.weight", (VOCAB, HIDDEN))])])


def source_catalog(root: str, layers: int) -> Catalog:
    """The catalog a tp=1, pp=1 save of the model would read as (no fragments: only its files are written)."""
    import deepspeed
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 16, "steps_per_print": 10**9,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "weight_decay": 0.01, "torch_adam": True}},
              "zero_optimization": {"stage": 1}, "bf16": {"enabled": True},
              "pipeline": {"activation_checkpoint_interval": 1}}
    catalog = CatalogBuilder(root=root, format="deepspeed",
                             layout=Layout.of(1, dtype="bfloat16", format_topology=DeepSpeedTopology(zero=1)))
    scaler = standins.LossScaler()
    scaler.__dict__.update(cur_scale=1.0, dynamic=False)
    layer_files, layer_of, stages = {}, {}, {}
    for index, entries in llama70b_layers(layers):
        layer_files[index] = []
        for key, shape in entries:
            name = f"{index}.{key}"
            layer_files[index].append((key, name))
            catalog.params[name] = ParamInfo(name, shape, "trainable", 0)
            catalog.order.append(name)
            layer_of[name] = (index, key)
            stages[name] = [0]
            catalog.add(TensorDraft(name, MODULE, shape, "bfloat16"))
            for state in [MASTER, *STATES]:
                catalog.add(TensorDraft(name, state, shape, "float32"))
    catalog.tag = TAG
    catalog.training = TrainingState(global_steps=1, global_samples=16, skipped_steps=0, optimizer="AdamW")
    catalog.notes = DeepSpeedNotes(ds_config=config, ds_version=deepspeed.__version__, loss_scaler=scaler,
                                   dynamic_loss_scale=False, overflow=False, clip_grad=1.0, tp_rules=RULES,
                                   layers=layer_of, stages=stages, pipe_layer_files=layer_files)
    hyper = {"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01, "amsgrad": False,
             "maximize": False, "foreach": None, "capturable": False, "differentiable": False, "fused": None,
             "decoupled_weight_decay": True}
    catalog.param_groups.append({**hyper, "params": list(catalog.order)})
    catalog.group_scalars.append({"step": ScalarTensor(1.0, "float32")})
    return catalog.freeze()


def make_sparse(dst: str, tp: int, pp: int, dp: int, layers: int) -> tuple:
    """Write the checkpoint under dst; returns (files, apparent bytes)."""
    catalog = source_catalog(dst, layers)
    target = catalog.layout.with_degrees({"tp": tp, "pp": pp, "dp": dp})
    items = writer("deepspeed").target_files(catalog, target, TAG)
    count = apparent = 0
    for item in items:
        path = os.path.join(dst, getattr(item, "path", ""))
        if isinstance(item, TensorFile):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            apparent += write_sparse_torch_file(path, item.header(), item.slots, item.pieces,
                                                item.container().archive)
        elif isinstance(item, TextFile):
            with open(path, "wb") as f:
                f.write(item.text.encode() if isinstance(item.text, str) else item.text)
        elif isinstance(item, CopiedFile):
            continue        # the engine's zero_to_fp32.py (none from this catalog)
        else:
            continue        # the stage cut: a record for plans, no file
        count += 1
    return count, apparent


class HoleSink:
    """A write-only stream zipfile sees as not seekable (so it streams members with data descriptors, as
    reshard's writer does); `skip(n)` moves past n bytes without writing them: a hole."""

    def __init__(self, path):
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.pos = 0

    def write(self, data) -> int:
        n = os.write(self.fd, data)
        self.pos += n
        return n

    def skip(self, n: int) -> None:
        self.pos = os.lseek(self.fd, n, os.SEEK_CUR)

    def tell(self) -> int:
        return self.pos

    def seekable(self) -> bool:
        return False

    def flush(self) -> None:
        pass

    def close(self) -> None:
        os.ftruncate(self.fd, self.pos)     # a trailing hole still has its length
        os.close(self.fd)


def write_sparse_torch_file(path: str, data_pkl: bytes, storages: list, pieces: dict, archive: str = "archive") -> int:
    """A torch.save zip laid out as reshard's TorchZipWriter lays it out, storage bytes left as holes but for
    the storages made of constants only (a `step` counter): those are written."""
    sink = HoleSink(path)
    try:
        with zipfile.ZipFile(sink, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
            def member(name, nbytes):
                info = zipfile.ZipInfo(f"{archive}/{name}", date_time=(1980, 1, 1, 0, 0, 0))
                info.file_size = nbytes
                zip64 = nbytes * 1.05 > zipfile.ZIP64_LIMIT
                header_end = sink.tell() + 30 + len(info.filename.encode()) + (20 if zip64 else 0)
                pad = (-(header_end + 4)) % ALIGNMENT
                info.extra = struct.pack("<HH", 0x4246, pad) + b"Z" * pad   # torch's alignment field
                return zf.open(info, "w", force_zip64=zip64)

            for name, data in (("data.pkl", data_pkl), (".format_version", b"1"),
                               (".storage_alignment", str(ALIGNMENT).encode()), ("byteorder", b"little")):
                with member(name, len(data)) as f:
                    f.write(data)
            for storage in storages:
                with member(f"data/{storage.key}", storage.nbytes) as f:
                    if all(p.source is None for p in pieces[storage.key]) and storage.nbytes <= 1 << 20:
                        for p in pieces[storage.key]:
                            f.write(constant(p.value, storage.dtype, p.count))
                        continue
                    sink.skip(storage.nbytes)
                    # what write() would have counted for that many zero bytes (zipfile's stream keeps no
                    # public way to account for bytes it did not see)
                    f._file_size = f._compress_size = storage.nbytes
                    f._crc = crc32_of_zeros(storage.nbytes)
            for name, data in (("version", b"3\n"),
                               (".data/serialization_id", hashlib.sha1(data_pkl).hexdigest().encode())):
                with member(name, len(data)) as f:
                    f.write(data)
        return sink.tell()
    finally:
        sink.close()


_POLY = 0xEDB88320      # CRC-32 (zip), reflected


def _mult_mod_p(a: int, b: int) -> int:
    """a * b modulo the CRC polynomial (zlib's multmodp, reflected bit order)."""
    m, p = 1 << 31, 0
    while m:
        if a & m:
            p ^= b
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
        m >>= 1
    return p


def crc32_of_zeros(n: int) -> int:
    """zlib.crc32(bytes(n)) in O(log n): the register after n zero bytes is x^(8n) times its start."""
    power, square, k = 1 << 31, 1 << 30, 8 * n     # x^0, x^1, exponent
    while k:
        if k & 1:
            power = _mult_mod_p(square, power)
        square = _mult_mod_p(square, square)
        k >>= 1
    return _mult_mod_p(power, 0xFFFFFFFF) ^ 0xFFFFFFFF
