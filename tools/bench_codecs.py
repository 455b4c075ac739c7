#!/usr/bin/env python
"""Would an archive tier pay? Lossless codecs on a real checkpoint's weights, masters and Adam moments.

    python tools/bench_codecs.py CKPT [--max-mb 64] [--repeat 3] [--json out.json]

CKPT is any checkpoint reshard reads. Its tensors are found by reshard's own reader and split as `reshard list`
splits them (reshard.lifecycle.sizes): the 16-bit weights (state `module`), the fp32 masters (`fp32`) and the
optimizer's moments (`exp_avg`, `exp_avg_sq`); each kind's bytes, up to --max-mb of them, are read from the files and
compressed on one core by:

- zstd: plain zstandard, level 3, one thread;
- blosc2: byte shuffle (typesize = the element size) + zstd level 3 (Blosc2's default filter and a zstd codec),
  one thread;
- zipnn: ZipNN, its byte grouping of the exponent + Huffman/zstd, for bfloat16 or float32, one thread.

For each: ratio (raw / compressed), compression and decompression GB/s (10^9 bytes a second, best of --repeat)
per core, and a round-trip check (decompressed == raw; a codec that fails it is flagged and left out of the
whole-checkpoint rows). The last rows weigh each codec's
per-kind ratio by the whole checkpoint's bytes by kind (the other bytes taken as incompressible): what an archive
of the full checkpoint would save. The codecs are not reshard dependencies: `pip install zipnn blosc2 zstandard`.

Nothing here is asserted: it prints figures for docs/performance.md.
"""
from __future__ import annotations

import argparse
import json
import os
import time

from reshard.core.catalog import MASTER, MODULE
from reshard.core.dtypes import itemsize
from reshard.formats import read
from reshard.lifecycle.sizes import split

KINDS = (("bf16 weights", (MODULE,), "bfloat16"), ("fp32 masters", (MASTER,), "float32"),
         ("Adam moments", ("exp_avg", "exp_avg_sq"), "float32"))


def kind_bytes(catalog, states, dtype: str, limit: int) -> bytes:
    """Up to `limit` bytes of the `states` tensors of `dtype`, fragment by fragment as the files hold them."""
    out = bytearray()
    for tensor in catalog.tensors.values():
        if tensor.state not in states or tensor.dtype != dtype:
            continue
        for fragment in tensor.fragments:
            size = itemsize(fragment.storage.dtype)
            with open(fragment.storage.file, "rb") as f:
                f.seek(fragment.storage.offset + fragment.elem_offset * size)
                out += f.read(min(fragment.numel * size, limit - len(out)))
            if len(out) >= limit:
                return bytes(out)
    return bytes(out)


def codecs(dtype: str):
    """{name: (compress, decompress)}, each on one thread."""
    import blosc2
    import zstandard
    from zipnn import ZipNN

    zc, zd = zstandard.ZstdCompressor(level=3, threads=0), zstandard.ZstdDecompressor()
    blosc2.set_nthreads(1)
    typesize = itemsize(dtype)
    cparams = {"codec": blosc2.Codec.ZSTD, "clevel": 3, "filters": [blosc2.Filter.SHUFFLE], "typesize": typesize,
               "nthreads": 1}
    zipnn = ZipNN(input_format="byte", bytearray_dtype=dtype, threads=1)
    return {"zstd-3": (zc.compress, zd.decompress),
            "blosc2 shuffle+zstd-3": (lambda b: blosc2.compress2(b, **cparams),
                                      lambda b: blosc2.decompress2(b, nthreads=1)),
            "zipnn": (zipnn.compress, zipnn.decompress)}


def timed(fn, data, repeat: int):
    best, out = float("inf"), None
    for _ in range(repeat):
        start = time.perf_counter()
        out = fn(data)
        best = min(best, time.perf_counter() - start)
    return out, best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("ckpt", help="a checkpoint reshard reads (a DeepSpeed save dir or tag, DCP, ...)")
    p.add_argument("--max-mb", type=float, default=64, help="bytes of each kind compressed, at most (default 64 MB)")
    p.add_argument("--repeat", type=int, default=3, help="timings of each, the best kept (default 3)")
    p.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    args = p.parse_args()
    catalog = read(args.ckpt)
    root = catalog.root
    total_files = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs)
    kinds = split(catalog, total_files, root)
    print(f"{root}: {total_files / 1e6:.1f} MB in files; by kind: {kinds.to_dict() if kinds else 'unknown'}")
    print(f"{'data':<14} {'codec':<22} {'MB':>7} {'ratio':>6} {'comp GB/s':>10} {'decomp GB/s':>12}")
    rows = []
    for label, states, dtype in KINDS:
        data = kind_bytes(catalog, states, dtype, int(args.max_mb * 1e6))
        if not data:
            print(f"{label:<14} (none in this checkpoint)")
            continue
        for name, (compress, decompress) in codecs(dtype).items():
            packed, seconds = timed(compress, data, args.repeat)
            back, back_seconds = timed(decompress, packed, args.repeat)
            row = {"data": label, "codec": name, "bytes": len(data), "ratio": len(data) / len(packed),
                   "compress_gb_s": len(data) / seconds / 1e9, "decompress_gb_s": len(data) / back_seconds / 1e9,
                   "lossless": bytes(back) == data}
            rows.append(row)
            print(f"{label:<14} {name:<22} {len(data) / 1e6:>7.1f} {row['ratio']:>6.3f} "
                  f"{row['compress_gb_s']:>10.3f} {row['decompress_gb_s']:>12.3f}"
                  + ("" if row["lossless"] else "  ROUND TRIP FAILED: the bytes came back changed"))
    whole = []
    if kinds is not None:
        masters = sum(t.numel * 4 for t in catalog.tensors.values() if t.state == MASTER and t.dtype == "float32")
        moments = kinds.optimizer - masters
        parts = {"bf16 weights": kinds.weights, "fp32 masters": masters, "Adam moments": moments}
        for name in dict.fromkeys(r["codec"] for r in rows):
            got = {r["data"]: r for r in rows if r["codec"] == name and r["lossless"]}   # a lossy one never counts
            if set(got) != set(parts):
                continue
            packed = kinds.other + sum(n / got[label]["ratio"] for label, n in parts.items())
            seconds = sum(n / 1e9 / got[label]["compress_gb_s"] for label, n in parts.items())
            whole.append({"codec": name, "ratio": kinds.total / packed,
                          "compress_gb_s": (kinds.total - kinds.other) / 1e9 / seconds})
            print(f"{'full ckpt':<14} {name:<22} {kinds.total / 1e6:>7.1f} {whole[-1]['ratio']:>6.3f} "
                  f"{whole[-1]['compress_gb_s']:>10.3f}   (weighted by bytes by kind)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"checkpoint": root, "bytes_by_kind": kinds.to_dict() if kinds else None, "rows": rows,
                       "full": whole}, f, indent=1)


if __name__ == "__main__":
    main()
