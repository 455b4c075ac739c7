"""Checks on the pickles a conversion writes: which globals they name (read without unpickling), and that
torch.load(weights_only=False) loads them in a Python where reshard cannot be imported."""
import os
import pickletools
import subprocess
import sys
import zipfile
from pathlib import Path

PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".pkl")
# -I: no PYTHONPATH, no user site, no cwd on the path; and reshard's editable install hidden
LOAD_WITHOUT_RESHARD = (
    "import sys; sys.modules['reshard'] = None\n"
    "try:\n    import reshard\nexcept ImportError:\n    pass\n"
    "else:\n    raise SystemExit('reshard importable')\n"
    "import torch\n"
    "for path in sys.argv[1:]:\n    torch.load(path, weights_only=False)\n"
    "print('loaded', len(sys.argv) - 1)")


def pickle_globals(path: Path) -> set:
    """The globals every pickle of a torch.save file (or a plain pickle) names."""
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


def pickles(folder: Path) -> list:
    return sorted(p for p in Path(folder).rglob("*") if p.suffix in PICKLE_SUFFIXES)


def check_pickles(source: Path, converted: Path, cwd: Path) -> int:
    """Every pickle of `converted` names only globals the pickles of `source` name, and loads where reshard is
    not importable; returns how many were loaded."""
    source_globals = set().union(*map(pickle_globals, pickles(source)))
    files = pickles(converted)
    for f in files:
        assert pickle_globals(f) <= source_globals, (f, pickle_globals(f) - source_globals)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-I", "-c", LOAD_WITHOUT_RESHARD, *map(str, files)], capture_output=True,
                          text=True, cwd=cwd, env=env, check=False)
    assert proc.returncode == 0 and f"loaded {len(files)}" in proc.stdout, proc.stderr[-3000:]
    return len(files)
