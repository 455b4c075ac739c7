"""What a torch.save file's pickle names, and what torch alone makes of it where reshard is not installed.

A converted file is loaded by the training job, where reshard is not installed: it must name no global the
source did not, and load with plain `torch.load(weights_only=False)`.
"""
import json
import os
import pickletools
import subprocess
import sys
import zipfile
from pathlib import Path


class NoReshard:
    """A finder that refuses reshard: reshard is installed (editable) in this venv, yet the files it writes must
    load as on a machine without it."""

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "reshard":
            raise ModuleNotFoundError(f"No module named {name!r}")


def block_reshard() -> None:
    sys.meta_path.insert(0, NoReshard())
    try:
        import reshard  # noqa: F401
    except ModuleNotFoundError:
        return
    raise AssertionError("reshard is still importable")


# Run with `python -I` outside the repository, PYTHONPATH unset, reshard refused (sys.argv[1]: this folder)
LOADER = r'''
import json, sys
sys.path.insert(0, sys.argv[1])
from pickles import block_reshard
block_reshard()
import torch

def leaves(value, path):
    if torch.is_tensor(value):
        raw = value.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        yield path, {"class": type(value).__name__, "dtype": str(value.dtype), "shape": list(value.shape),
                     "stride": list(value.stride()), "offset": value.storage_offset(), "bytes": raw.hex(),
                     "requires_grad": value.requires_grad, "attrs": {k: repr(v) for k, v in vars(value).items()}}
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from leaves(v, path + [str(k)])
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from leaves(v, path + [i])
    elif value is None or isinstance(value, (str, int, float, bool)):
        yield path, value
    else:
        yield path, {"class": f"{type(value).__module__}.{type(value).__qualname__}"}

out = {}
for path, keys in json.loads(sys.argv[2]).items():
    obj = torch.load(path, weights_only=False, map_location="cpu")
    out[path] = [[p, v] for k in keys for p, v in leaves(obj.get(k), [k])]
print(json.dumps(out))
'''


def load_without_reshard(files: dict, cwd) -> dict:
    """{file: [[key path, leaf]]}: the given top-level keys of each file as torch alone loads them, every tensor
    as its class, dtype, shape, strides, storage offset and bytes (hex)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-I", "-c", LOADER, os.path.dirname(os.path.abspath(__file__)),
                           json.dumps({str(f): k for f, k in files.items()})],
                          cwd=str(cwd), env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])     # the last line: DeepSpeed, once imported, may print


def pickle_globals(path) -> set:
    """The globals (`module.name`) every pickle of a torch.save file (its *.pkl members) or a plain pickle names,
    read without unpickling."""
    path = Path(path)
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as z:
            blobs = [z.read(n) for n in z.namelist() if n.endswith(".pkl")]
    else:
        blobs = [path.read_bytes()]
    names = set()
    for blob in blobs:
        strings = []
        for op, arg, _ in pickletools.genops(blob):
            if op.name in ("GLOBAL", "INST"):
                names.add(arg.replace(" ", "."))
            elif op.name == "STACK_GLOBAL":
                names.add(".".join(strings[-2:]))
            elif isinstance(arg, str):
                strings.append(arg)
    return names


PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".pkl")
# -I: no PYTHONPATH, no user site, no cwd on the path; and reshard's editable install hidden
LOAD_ALL = (
    "import sys; sys.modules['reshard'] = None\n"
    "try:\n    import reshard\nexcept ImportError:\n    pass\n"
    "else:\n    raise SystemExit('reshard importable')\n"
    "import torch\n"
    "for path in sys.argv[1:]:\n    torch.load(path, weights_only=False)\n"
    "print('loaded', len(sys.argv) - 1)")


def pickles(folder) -> list:
    return sorted(p for p in Path(folder).rglob("*") if p.suffix in PICKLE_SUFFIXES)


def check_pickles(source, converted, cwd) -> int:
    """Every pickle of `converted` names only globals the pickles of `source` name, and loads where reshard is
    not importable; returns how many were loaded."""
    source_globals = set().union(*map(pickle_globals, pickles(source)))
    files = pickles(converted)
    for f in files:
        assert pickle_globals(f) <= source_globals, (f, pickle_globals(f) - source_globals)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-I", "-c", LOAD_ALL, *map(str, files)], capture_output=True,
                          text=True, cwd=cwd, env=env, check=False)
    assert proc.returncode == 0 and f"loaded {len(files)}" in proc.stdout, proc.stderr[-3000:]
    return len(files)
