"""Every hostile or broken checkpoint (tools/make_hostile.py), through every command: nothing runs,
one line names the file and the problem, exit 1, nothing written, the source untouched."""
import os

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import make_hostile
import reshard
from reshard.errors import ReshardError
from reshard.formats.deepspeed import pickles as deepspeed_pickles
from tests.helpers.cli import run_cli
from tests.helpers.damage import mutated
from tests.helpers.fixtures import fixture_dir, tag_dir

COMMANDS = {
    "inspect": lambda src, out: ["inspect", src],
    "validate": lambda src, out: ["validate", src],
    "validate --deep": lambda src, out: ["validate", "--deep", src],
    "plan": lambda src, out: ["plan", src, "--to", "dp=3"],
    "convert": lambda src, out: ["convert", src, out, "--to", "dp=3", "--quiet"],
    "export": lambda src, out: ["export", src, out, "--quiet"],
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    canary = root / "canary"
    cases = make_hostile.build(str(root / "cases"), str(canary))
    return cases, canary


def _snapshot(save):
    return {p: p.read_bytes() for p in sorted(save.rglob("*")) if p.is_file()}


CASE_NAMES = ["global_os_system", "global_subprocess_client_state", "global_eval_scheduler", "reduce_exec_nested",
              "reduce_getattr_chain", "zip_offset_outside", "storage_larger_than_file", "truncated_10",
              "truncated_50", "truncated_90", "truncated_last_byte", "zero_byte", "garbage", "legacy_format",
              "malformed_pickle", "missing_rank", "two_steps", "param_shapes_disagree", "nan_values"]


@pytest.mark.parametrize("case", CASE_NAMES)
def test_every_command_refuses(corpus, case, tmp_path):
    cases, canary = corpus
    save, victim, commands, needle = cases[case]
    save = type(tmp_path)(save)
    before = _snapshot(save)
    for command in commands:
        out = tmp_path / command.replace(" ", "_")
        proc = run_cli(*COMMANDS[command](save, out))
        assert proc.returncode == 1, (command, proc.stdout, proc.stderr)
        if command.startswith("validate"):   # one line per problem, then the summary
            lines = [line for line in proc.stdout.splitlines() + proc.stderr.splitlines() if victim in line]
        else:
            lines = [line for line in proc.stderr.splitlines() if line.strip()]
            assert len(lines) == 1, (command, proc.stderr)
        assert any(victim in line and needle in line for line in lines), (command, needle, proc.stdout, proc.stderr)
        assert not out.exists(), command
        assert not [p for p in tmp_path.iterdir() if "reshard" in p.name], command
        assert not canary.exists(), command
        assert _snapshot(save) == before, command
    assert set(CASE_NAMES) == set(cases)


@settings(max_examples=int(os.environ.get("RESHARD_FUZZ_EXAMPLES", 300)), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_fuzzed_rank_files_only_ever_give_a_checkpoint_error(data, tmp_path_factory):
    """Mutated real files: the reader returns or raises ReshardError, nothing else, never runs code."""
    source = tag_dir(fixture_dir(data.draw(st.sampled_from(["z2_fp32_dp2", "z3_bf16_dp2", "bf16opt_z1_dp2"]))))
    name = data.draw(st.sampled_from(sorted(os.listdir(source))))
    blob = mutated(data, (source / name).read_bytes())
    save = tmp_path_factory.mktemp("fuzz")
    tag = save / "global_step3"
    tag.mkdir()
    for other in os.listdir(source):
        (tag / other).write_bytes(bytes(blob) if other == name else (source / other).read_bytes())
    (save / "latest").write_text("global_step3")
    try:
        deepspeed_pickles.load(tag / name)
    except ReshardError:
        pass
    try:
        reshard.validate(reshard.open_checkpoint(save), deep=True)
    except ReshardError:
        pass
