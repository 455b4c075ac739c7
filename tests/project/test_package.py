"""The wheel ships the rule files, found by name: reshard built as a wheel from this checkout's sources, installed
(not editable) into a fresh venv outside the checkout, run from elsewhere with no PYTHONPATH, reads a Megatron
tensor-parallel fixture with `--layout-rules megatron-gpt`, which needs the shipped rule file. The wheel is built
and installed once for the module (a few seconds, no network: --no-index, --no-build-isolation).
"""
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile

import pytest

from tests.helpers.fixtures import fixture_dir
from tests.helpers.repo import REPO

FIXTURE = "megatron_tp2_z1_fp32_dp2"      # refused without rules: it carries no universal_checkpoint_info


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(python of a venv holding the built wheel, a folder outside the checkout to run in)."""
    tmp = tmp_path_factory.mktemp("package")
    source = tmp / "source"         # a copy: the build leaves build/ and *.egg-info where it runs
    shutil.copytree(REPO / "reshard", source / "reshard", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", tmp / "wheel", source],
                   check=True, cwd=tmp)
    (wheel,) = (tmp / "wheel").iterdir()
    shipped = {n for n in zipfile.ZipFile(wheel).namelist() if n.startswith("reshard/layouts/")}
    in_tree = {p.relative_to(REPO).as_posix() for p in (REPO / "reshard" / "layouts").rglob("*") if p.is_file()}
    assert "reshard/layouts/tp-rules/megatron-gpt.json" in shipped and in_tree == shipped, in_tree ^ shipped
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", venv], check=True)
    python = venv / "bin" / "python"
    subprocess.run([*pip, "--python", python, "install", "--no-deps", "--no-index", wheel], check=True, cwd=tmp)
    # the dependencies (torch, numpy, safetensors) from this interpreter's site-packages, after the venv's own
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    with open(os.path.join(site, "dependencies.pth"), "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")
    work = tmp / "elsewhere"
    work.mkdir()
    return python, work


def run_installed(installed, *args):
    python, work = installed
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([python, "-m", "reshard", *map(str, args)], capture_output=True, text=True, cwd=work,
                          env=env)


def test_the_installed_package_finds_its_rule_files_by_name(installed):
    python, work = installed
    where = subprocess.run([python, "-c", "import reshard; print(reshard.__file__)"], capture_output=True, text=True,
                           cwd=work, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"}).stdout
    assert where.startswith(str(python.parent.parent)), where      # the installed copy, not the checkout
    source = fixture_dir(FIXTURE)
    proc = run_installed(installed, "inspect", source, "--layout-rules", "megatron-gpt")
    assert proc.returncode == 0, proc.stderr
    assert "tp=2" in proc.stdout
    proc = run_installed(installed, "validate", source, "--layout-rules", "megatron-gpt")
    assert proc.returncode == 0 and "complete" in proc.stdout, proc.stdout + proc.stderr
    # --help names the shipped files
    proc = run_installed(installed, "inspect", "--help")
    assert "llama-autotp, llama-autotp-tied, megatron-gpt" in " ".join(proc.stdout.split())
    # negative control: without the rules the same checkpoint is refused
    assert run_installed(installed, "inspect", source).returncode == 1


def test_an_unknown_rule_file_name_lists_the_shipped_ones(installed):
    proc = run_installed(installed, "inspect", fixture_dir(FIXTURE), "--layout-rules", "megatron-gtp")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == ("reshard: megatron-gtp: no such file, nor a tensor-parallel rule file shipped with reshard "
                           "(llama-autotp, llama-autotp-tied, megatron-gpt)\n")
