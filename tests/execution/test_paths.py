"""Every path written stays inside DST; no name read from a checkpoint leads a reader out of it (issue 24, point 2).

Writers: `--tag-out` is one folder name (exit 2 otherwise); every file of a plan is placed under the staging folder
by one function (staging.output_path), whatever writer named it; the overlap check covers every path a run
writes, resolved. Readers: a tag `latest`/`latest_universal` names, a file a manifest lists, leading out of their
folder (by '..', an absolute path or a symlink) are refused with exit 1: the checkpoint is at fault.
"""
import hashlib
import os
import shutil
from dataclasses import replace

import pytest

import reshard
from reshard.cli import main
from reshard.commands.convert import make_plan
from reshard.core.write_requests import TextFile
from reshard.errors import UsageError
from reshard.execution.executor import execute
from tests.helpers.fixtures import fixture_dir

SOURCE = "z2_fp32_dp2"


def digest_tree(root) -> dict:
    """Every file under root -> its sha256 (symlinks as their target names): what must not change."""
    out = {}
    for d, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(d, name)
            if os.path.islink(path):
                out[os.path.relpath(path, root)] = "-> " + os.readlink(path)
            elif os.path.isfile(path):
                with open(path, "rb") as f:
                    out[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
    return out


@pytest.fixture
def src(tmp_path):
    """A writable copy of a real DeepSpeed save, in a folder of its own."""
    path = tmp_path / "run" / "src"
    shutil.copytree(fixture_dir(SOURCE), path)
    return path


def cli(capsys, *args) -> tuple:
    """(exit status, stderr lines) of reshard ARGS, run in this process."""
    code = main([str(a) for a in args])
    return code, capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize("tag_out", ["../escape", "ABS_INTO_SOURCE", "a/b", "..", "."])
def test_tag_out_is_one_folder_name_inside_dst(src, tmp_path, capsys, tag_out):
    """`--tag-out ../escape` wrote the rank files beside DST (outside the staging folder and its rename),
    `--tag-out SRC/global_step3` over the source's own rank files. Now: exit 2, one line naming the value, nothing
    written anywhere, the source unchanged."""
    if tag_out == "ABS_INTO_SOURCE":
        tag_out = str(src / (src / "latest").read_text().strip())
    before, around = digest_tree(src), sorted(os.listdir(tmp_path / "run"))
    for command in ("convert", "plan"):
        dst = tmp_path / "run" / "dst"
        args = [command, src, *([dst] if command == "convert" else []), "--to", "dp=3", "--tag-out", tag_out]
        code, err = cli(capsys, *args)
        assert code == 2 and len(err) == 1 and f"--tag-out {tag_out!r}" in err[0], (command, err)
        assert digest_tree(src) == before and sorted(os.listdir(tmp_path / "run")) == around
        assert not os.path.exists(tmp_path / "escape") and not dst.exists()
    # negative control: a plain name is a tag
    assert cli(capsys, "convert", src, tmp_path / "ok", "--to", "dp=3", "--tag-out", "global_step9", "--quiet")[0] == 0
    assert (tmp_path / "ok" / "latest").read_text() == "global_step9" and digest_tree(src) == before


def test_no_writer_can_place_a_file_outside_dst(src, tmp_path):
    """A future writer naming a file `../x` or an absolute path gets no further than the executor's placing of
    its files: refused (UsageError, exit 2) before anything is written; the same plan without it is written."""
    catalog = reshard.open_checkpoint(src)
    victim = src / "latest"
    tag = victim.read_text()
    for name in ("../planted", str(victim), "global_step2/../../planted"):
        plan = make_plan(catalog, "dp=3")
        plan = replace(plan, texts=(*plan.texts, TextFile(name, "overwritten\n")))  # a Plan is frozen
        with pytest.raises(UsageError, match="every file written stays inside the destination"):
            execute(plan, str(tmp_path / "dst"), progress=False)
        assert not (tmp_path / "planted").exists() and victim.read_text() == tag
        assert not os.path.exists(tmp_path / "dst") and not os.path.exists(tmp_path / ".dst.reshard-tmp")
    plan = make_plan(catalog, "dp=3")
    plan = replace(plan, texts=(*plan.texts, TextFile("extra/note.txt", "inside\n")))  # a Plan is frozen
    execute(plan, str(tmp_path / "dst"), progress=False)
    assert (tmp_path / "dst" / "extra" / "note.txt").read_text() == "inside\n"


def test_a_symlink_planted_in_a_resumed_staging_folder_leads_nowhere(src, tmp_path, capsys):
    """--resume keeps the staging folder of an interrupted run: a symlink in it pointing into the source would
    have had the rank files written through it, over the source's. Each file's place is resolved: exit 2."""
    staging = tmp_path / ".dst.reshard-tmp"
    staging.mkdir()
    tag = (src / "latest").read_text().strip()
    (staging / tag).symlink_to(src / tag)
    before = digest_tree(src)
    code, err = cli(capsys, "convert", src, tmp_path / "dst", "--to", "dp=3", "--resume")
    assert code == 2 and len(err) == 1 and "a symlink leads out of the folder" in err[0], err
    assert digest_tree(src) == before and not (tmp_path / "dst").exists()
    (staging / tag).unlink()        # negative control: the same resume without the link writes
    assert cli(capsys, "convert", src, tmp_path / "dst", "--to", "dp=3", "--resume", "--quiet")[0] == 0
    assert reshard.validate(reshard.open_checkpoint(tmp_path / "dst")).ok and digest_tree(src) == before


def test_the_overlap_check_covers_the_staging_folder_beside_dst(tmp_path, capsys):
    """DST `out` is built in `.out.reshard-tmp` beside it, which a run removes first: a source inside that
    folder was deleted though DST itself lay apart from it. Every path written is checked, resolved."""
    src = tmp_path / ".out.reshard-tmp" / "ckpt"
    shutil.copytree(fixture_dir(SOURCE), src)
    before = digest_tree(src)
    code, err = cli(capsys, "convert", src, tmp_path / "out", "--to", "dp=3")
    assert code == 1 and len(err) == 1 and "overlaps the source checkpoint" in err[0], err
    assert digest_tree(src) == before and not (tmp_path / "out").exists()
    link = tmp_path / "elsewhere"       # the same through a symlinked parent
    link.symlink_to(tmp_path)
    code, err = cli(capsys, "convert", src, link / "out", "--to", "dp=3")
    assert code == 1 and "overlaps the source checkpoint" in err[0] and digest_tree(src) == before
    assert cli(capsys, "convert", src, tmp_path / "out2", "--to", "dp=3", "--quiet")[0] == 0     # control


@pytest.mark.parametrize("pointer", ["latest", "latest_universal"])
def test_a_tag_leading_out_of_the_save_dir_is_not_read(tmp_path, capsys, pointer):
    """`latest` naming `../x`, or a tag folder that is a symlink to another save's: reshard read (and converted,
    and validated) a checkpoint outside the save dir it was given. Now one line naming the file, exit 1."""
    outside = tmp_path / "outside"
    save = tmp_path / "save"
    if pointer == "latest":
        shutil.copytree(fixture_dir(SOURCE), outside)
    else:   # a universal tree, written by reshard, moved out of its save dir
        assert cli(capsys, "convert", fixture_dir(SOURCE), outside, "--format", "universal", "--quiet")[0] == 0
    tag = (outside / pointer).read_text().strip()
    save.mkdir()
    for named, make in (("../outside/" + tag, None), ("linked", lambda: (save / "linked").symlink_to(outside / tag))):
        if make:
            make()
        (save / pointer).write_text(named)
        for command in (["inspect", save], ["validate", save], ["convert", save, tmp_path / "dst", "--to", "dp=3"]):
            code, err = cli(capsys, *command)
            assert code == 1 and len(err) == 1 and f"{save / pointer}: names the tag {named!r}" in err[0], err
            assert not (tmp_path / "dst").exists()
    (save / "linked").unlink()          # negative control: the tag folder itself in the save dir is read
    shutil.copytree(outside / tag, save / "linked")
    assert cli(capsys, "validate", save)[0] == 0


def test_a_manifest_listing_a_file_through_a_symlink_out_is_not_vouched_for(src, tmp_path, capsys):
    """validate --checksums hashed a listed file that is a symlink to a copy outside the checkpoint, and called
    the checkpoint complete; now it names the file and the manifest, exit 1."""
    dst = tmp_path / "dst"
    assert cli(capsys, "convert", src, dst, "--to", "dp=3", "--quiet")[0] == 0
    assert cli(capsys, "validate", dst, "--checksums")[0] == 0     # control: whole
    rank = dst / (dst / "latest").read_text() / "zero_pp_rank_2_mp_rank_00_optim_states.pt"
    shutil.move(rank, tmp_path / "moved.pt")
    rank.symlink_to(tmp_path / "moved.pt")
    main(["validate", str(dst), "--checksums"])
    out = capsys.readouterr().out
    assert "names a file outside its folder" in out and "a symlink leads out" in out
    assert main(["validate", str(dst), "--checksums"]) == 1
