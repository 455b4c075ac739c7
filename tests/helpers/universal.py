"""DeepSpeed universal checkpoints made two ways (DeepSpeed's own ds_to_universal, and `reshard convert --format
universal`), and their trees compared: the files each holds, and every way two loaded objects differ."""
from __future__ import annotations

import contextlib
import io
import sys
from unittest import mock

import torch

from tests.helpers.cli import run_cli
from tests.helpers.fixtures import fixture_dir, tag_dir


def ds_to_universal(name, out):
    """Run DeepSpeed's converter on a fixture, as `python -m deepspeed.checkpoint.ds_to_universal` does, in this
    process (one worker each: it forks none); `out` is the save dir it writes latest_universal in."""
    from deepspeed.checkpoint import ds_to_universal as converter
    src = tag_dir(fixture_dir(name))
    argv = ["ds_to_universal", "--input_folder", str(src), "--output_folder", str(out / src.name),
            "--inject_missing_state", "--num_extract_workers", "1", "--num_merge_workers", "1"]
    said = io.StringIO()
    with mock.patch.object(sys, "argv", argv), contextlib.redirect_stdout(said):
        converter.main(converter.parse_arguments())
    assert (out / "latest_universal").is_file(), said.getvalue()[-2000:]
    return out


def our_universal(name, out, to=""):
    """The fixture converted by `reshard convert --format universal` into the save dir `out`."""
    run_cli("convert", fixture_dir(name), out, "--format", "universal", "--to", to, "--quiet", check=0)
    return out


def tree_files(save_dir) -> list:
    """The files of a save dir, relative, but for reshard's manifest."""
    return sorted(str(p.relative_to(save_dir)) for p in save_dir.rglob("*")
                  if p.is_file() and p.name != "reshard-manifest.json")


def differences(a, b, where=""):
    """Every way two loaded objects differ: keys and order, types, dtypes, shapes, values."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        if not (torch.is_tensor(a) and torch.is_tensor(b)):
            return [f"{where}: {type(a).__name__} vs {type(b).__name__}"]
        if (a.dtype, a.shape) != (b.dtype, b.shape):
            return [f"{where}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"]
        return [] if torch.equal(a, b) else [f"{where}: values differ"]
    if isinstance(a, dict) and isinstance(b, dict):
        out = [] if list(a) == list(b) else [f"{where}: keys {list(a)} vs {list(b)}"]
        return out + [d for k in a if k in b for d in differences(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and type(a) is type(b):
        if len(a) != len(b):
            return [f"{where}: {len(a)} vs {len(b)} items"]
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in differences(x, y, f"{where}[{i}]")]
    if type(a) is type(b) and hasattr(a, "__dict__") and not isinstance(a, type):
        return differences(vars(a), vars(b), where)
    return [] if a == b else [f"{where}: {a!r} vs {b!r}"]


def load_output(path):
    return torch.load(path, weights_only=False)   # outputs only; DeepSpeed's classes are pickled in them
