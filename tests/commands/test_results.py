"""The typed results between the library and the CLI: each one's plain data is what `--json` prints, and
completeness is a proof object that planning takes."""
import dataclasses

import pytest

import reshard
from reshard.commands.convert import make_plan, plan_for
from reshard.commands.validate import Complete, ValidationReport, prove_complete
from reshard.core.problems import MISSING, READER, Problem
from tests.helpers.fixtures import copy_fixture, fixture_dir, tag_dir


def test_a_problem_reads_as_the_line_it_was():
    line = "/ckpt/global_step2/zero_pp_rank_1_mp_rank_00_optim_states.pt: missing (expected for data-parallel rank 1)"
    problem = Problem.from_line(line)
    assert problem.file == "/ckpt/global_step2/zero_pp_rank_1_mp_rank_00_optim_states.pt" and problem.kind == READER
    assert str(problem) == line and "missing" in problem
    # negative control: a line that starts with no path keeps its words whole, with no file
    plain = Problem.from_line("group 0: no fp32 master partition")
    assert plain.file is None and str(plain) == "group 0: no fp32 master partition"
    assert Problem.from_line("ckpt: x", root="ckpt").file == "ckpt"


def test_validation_problems_are_typed(tmp_path):
    save = copy_fixture("z3_fp32_dp2", tmp_path)
    for path in tag_dir(save).glob("*zero_pp_rank_1_*"):
        path.unlink()
    report = reshard.validate(reshard.open_checkpoint(save))
    assert isinstance(report, ValidationReport) and not report.ok
    kinds = {p.kind for p in report.problems}
    assert {READER, MISSING} <= kinds
    gap = next(p for p in report.problems if p.kind == MISSING)
    assert gap.file == str(tag_dir(save)) and gap.tensor and gap.tensor.split(" (")[0] in gap.message
    assert report.to_dict()["problems"] == [str(p) for p in report.problems]
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.ok = True


def test_completeness_is_a_proof_that_planning_takes(tmp_path):
    catalog = reshard.open_checkpoint(fixture_dir("z2_fp32_dp2"))
    complete = prove_complete(catalog)
    assert isinstance(complete, Complete) and complete.catalog is catalog and complete.report.ok
    assert make_plan(complete, "dp=4").target.dp == 4     # the proof made once is taken as it is
    # negative controls: no proof of a report with problems; a broken checkpoint is refused in one line
    with pytest.raises(ValueError):
        Complete(catalog, ValidationReport(problems=(Problem(None, None, READER, "broken"),)))
    save = copy_fixture("z2_fp32_dp2", tmp_path)
    next(tag_dir(save).glob("*zero_pp_rank_1_*optim*")).unlink()
    with pytest.raises(reshard.ReshardError, match="the checkpoint is not complete"):
        prove_complete(reshard.open_checkpoint(save))
    with pytest.raises(AttributeError):
        plan_for(catalog, catalog.layout)      # a catalog is not a proof


def test_an_inspection_is_typed_and_its_plain_data_is_the_json(capsys):
    import json

    from reshard.commands.inspect import Inspection
    from tests.helpers.cli import run_cli
    info = reshard.inspect(reshard.open_checkpoint(fixture_dir("z2_fp32_dp2")), params=True)
    assert isinstance(info, Inspection) and info.topology.dp == 2 and info.zero_stage == 2
    assert json.loads(run_cli("inspect", fixture_dir("z2_fp32_dp2"), "--params", "--json").stdout) == info.to_dict()
    # negative control: without the table, its key is absent from the data, as from the JSON
    plain = reshard.inspect(reshard.open_checkpoint(fixture_dir("z2_fp32_dp2")))
    assert "parameter_table" not in plain.to_dict() and "parameter_table" in info.to_dict()
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.step = 0


def test_a_plan_summary_is_typed_and_says_when_the_disk_is_short():
    summary = reshard.plan(fixture_dir("z2_fp32_dp2"), "dp=4")
    assert summary.disk_ok and summary.to_dict()["disk_ok"] is True
    assert [f.path for f in summary.files] == [f["path"] for f in summary.to_dict()["files"]]
    assert "framework" not in summary.to_dict()     # a bare DeepSpeed save: no training framework's folder
    # negative control: the same plan on a disk with fewer free bytes than it writes
    short = dataclasses.replace(summary, free_disk_bytes=summary.bytes_written)
    assert not short.disk_ok and short.to_dict()["disk_ok"] is False


def test_written_lists_the_framework_files_only_where_there_are_some(tmp_path):
    written = reshard.convert(fixture_dir("z2_fp32_dp2"), tmp_path / "out", "dp=4")
    assert written.framework_files == () and "framework_files" not in written.to_dict()
    assert written.size == sum(f.size for f in written.files) == written.to_dict()["bytes"]

    class Kept:     # a Disposition as Written sees it
        def to_dict(self):
            return {"path": "trainer_state.json", "action": "copied"}
    assert dataclasses.replace(written, framework_files=(Kept(),)).to_dict()["framework_files"] == \
        [{"path": "trainer_state.json", "action": "copied"}]


def test_a_plan_outlines_itself_in_a_frozen_summary_that_the_manifest_and_plan_read(tmp_path):
    """Plan.summary() is a frozen PlanOutline (no dict picked apart by key); PlanSummary extends it, and the
    manifest of the conversion states the same totals and target; the control: another target's totals differ."""
    import json

    from reshard.core.planner import PlanOutline
    from reshard.storage.names import MANIFEST
    summary = reshard.plan(fixture_dir("z2_fp32_dp2"), "dp=3")
    outline = summary.plan.summary()
    assert isinstance(outline, PlanOutline) and isinstance(summary, PlanOutline)
    assert (outline.files, outline.bytes_written, outline.tag) == (summary.files, summary.bytes_written, summary.tag)
    with pytest.raises(dataclasses.FrozenInstanceError):
        outline.bytes_read = 0
    reshard.convert(fixture_dir("z2_fp32_dp2"), tmp_path / "dp3", "dp=3")
    manifest = json.loads((tmp_path / "dp3" / MANIFEST).read_text())
    assert (manifest["bytes_written"], manifest["target"]) == \
        (outline.bytes_written, {"format": outline.format, "topology": outline.target_topology, "tag": outline.tag})
    assert reshard.plan(fixture_dir("z2_fp32_dp2"), "dp=1").plan.summary().target_topology != outline.target_topology


def test_write_requests_are_frozen():
    """Every write request, TensorFile too (built by its TensorFileBuilder: tests/core/test_containers.py)."""
    from reshard.core.write_requests import CopiedFile, NewTensor, Output, Piece, StageCut, TensorFile, TextFile
    for request in (NewTensor, TextFile, CopiedFile, Output, StageCut, Piece, TensorFile):
        assert request.__dataclass_params__.frozen, request
    with pytest.raises(dataclasses.FrozenInstanceError):
        TextFile("latest", "global_step2").text = "global_step3"

    @dataclasses.dataclass
    class Unfrozen:         # the control: the check tells a mutable dataclass
        path: str
    assert not Unfrozen.__dataclass_params__.frozen
