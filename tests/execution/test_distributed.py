"""`torchrun -m reshard convert|export`: the ranks share the files; output identical to one process. Under torchrun
itself at 2 ranks; the other launches fork their ranks (tools/forked_ranks.py: the same environment, a fraction of
the start-up)."""

import pytest

from tests.helpers.cli import run_cli
from tests.helpers.fixtures import fixture_dir
from tests.helpers.torchrun import torchrun


def _torchrun(k, *args, forked=True):
    return torchrun(k, "-m", "reshard", *args, check=False, deepspeed=False, timeout=600, forked=forked)


def _tree(root):
    return {p.relative_to(root): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("k", [2, 3])
def test_ranks_write_their_share_and_rank0_commits(k, tmp_path):
    src = fixture_dir("z3_fp32_frozen_tied_dp2")
    run_cli("convert", src, tmp_path / "single", "--to", "dp=5,zero=1", "--quiet", check=0)
    proc = _torchrun(k, "convert", src, tmp_path / "multi", "--to", "dp=5,zero=1", "--quiet", forked=k != 2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _tree(tmp_path / "single") == _tree(tmp_path / "multi")
    assert not [p for p in tmp_path.iterdir() if "reshard-tmp" in p.name]

    run_cli("export", src, tmp_path / "single-export", "--max-shard-size", "1KB", "--quiet", check=0)
    proc = _torchrun(k, "export", src, tmp_path / "multi-export", "--max-shard-size", "1KB", "--quiet", forked=k != 2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _tree(tmp_path / "single-export") == _tree(tmp_path / "multi-export")


def test_a_refusal_is_one_line_from_rank0(tmp_path):
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep").write_text("x")
    proc = _torchrun(2, "convert", fixture_dir("z2_fp32_dp2"), busy, "--to", "dp=3")
    assert proc.returncode != 0
    assert [line for line in proc.stderr.splitlines() if line.startswith("reshard:")] == \
        [f"reshard: {busy}: exists and is not empty (use --overwrite to replace it)"]
    assert (busy / "keep").read_text() == "x"


def test_a_corrupt_source_is_found_across_ranks_and_nothing_is_committed(tmp_path):
    """Bit rot (issue 24): one flipped bit in a member the ranks read parts of; rank 0 gathers every rank's block
    CRCs, finds the mismatch before the commit, and nothing is left."""
    import shutil

    import reshard
    src = tmp_path / "src"
    shutil.copytree(fixture_dir("z3_fp32_frozen_tied_dp2"), src)
    frag = next(f for t in reshard.open_checkpoint(src).tensors.values() if t.state == "fp32" for f in t.fragments)
    at = frag.storage.offset + frag.elem_offset * 4
    with open(frag.storage.file, "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 1]))
    proc = _torchrun(2, "convert", src, tmp_path / "multi", "--to", "dp=5,zero=1", "--quiet")
    assert proc.returncode != 0
    assert f"reshard: {frag.storage.file}: member {frag.storage.member}: CRC-32 mismatch" in proc.stderr, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
