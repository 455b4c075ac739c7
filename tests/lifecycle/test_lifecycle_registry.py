"""`list`, `prune` and `watch` take every checkpoint a reader of the format registry reads whole (issue 39, point 1):
runs laid out from the shipped fixtures (real saves of the HF Trainer and Accelerate with FSDP, sharded and full
state dict, Lightning's FSDPStrategy, Megatron-core 0.15/0.16/0.19 torch_dist and the legacy format, torchtitan),
each checkpoint copied under the series' names. Every run holds one checkpoint made incomplete (a data file
truncated): the negative control, listed INCOMPLETE, never deleted, `list` exits 1.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import reshard
from reshard.lifecycle.listing import COMPLETE, INCOMPLETE
from tests.helpers import lifecycle_runs as lr
from tests.helpers.cli import run_cli
from tests.helpers.fixtures import FIXTURES

MCORE = "megatron_core"
# series folder: (the fixture's checkpoint, the names its copies take, the unit list shows)
SERIES = {
    "hf_sharded": ("hf_fsdp_sharded_dp2/checkpoint-3", "checkpoint-{}", "HF Trainer with FSDP (sharded state dict)"),
    "hf_full": ("hf_fsdp_full_dp2/checkpoint-3", "checkpoint-{}", "HF Trainer with FSDP (full state dict)"),
    "acc_sharded": ("accelerate_fsdp_sharded_dp2/state", "checkpoint_{}", "Accelerate with FSDP (sharded state dict)"),
    "acc_full": ("accelerate_fsdp_full_dp2/state", "checkpoint_{}", "Accelerate with FSDP (full state dict)"),
    "lightning": ("lightning_fsdp_dp2/step=3.ckpt", "epoch=0-step={}.ckpt", "Lightning with FSDP (sharded)"),
    "mcore_016": (f"{MCORE}/mcore_dp_reshardable_tp2_dp2/save/iter_0000003", "iter_{:07d}", "Megatron-LM (torch_dist)"),
    "mcore_015": (f"{MCORE}/mcore_fully_sharded_model_space_tp2_dp2_v015/save/iter_0000003", "iter_{:07d}",
                  "Megatron-LM (torch_dist)"),
    "mcore_019": (f"{MCORE}/mcore_dp_reshardable_tp2_dp2_v019/save/iter_0000003", "iter_{:07d}",
                  "Megatron-LM (torch_dist)"),
    "mcore_legacy": (f"{MCORE}/mcore_legacy_plain_tp2_pp2/save/iter_0000003", "iter_{:07d}",
                     "Megatron-LM (torch, legacy)"),
    "torchtitan": ("torchtitan/torchtitan_llama_fsdp2/checkpoint/step-3", "step-{}", "torchtitan (DCP)"),
}
STEPS = (1, 2, 3)
BROKEN = 1      # the step whose copy has a truncated data file, in every series
TRACKED = 2     # the iteration Megatron-LM's tracker names (not the newest: kept as `latest` is)


def _largest_data_file(folder: Path) -> Path:
    return max((p for p in folder.rglob("*") if p.is_file() and p.suffix in (".distcp", ".bin", ".pt")),
               key=lambda p: p.stat().st_size)


def registry_run(root: Path) -> Path:
    """`root/run/<series>/<name of step N>` for each series and step, step BROKEN's largest data file cut in half;
    Megatron-LM's tracker names iteration TRACKED."""
    run = root / "run"
    for series, (source, name, _) in SERIES.items():
        for step in STEPS:
            shutil.copytree(FIXTURES / source, run / series / name.format(step))
        broken = _largest_data_file(run / series / name.format(BROKEN))
        with open(broken, "r+b") as f:
            f.truncate(broken.stat().st_size // 2)
        if series.startswith("mcore"):
            (run / series / "latest_checkpointed_iteration.txt").write_text(str(TRACKED))
    lr.age(run)
    return run


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    return registry_run(tmp_path_factory.mktemp("registry"))


@pytest.fixture
def run(template, tmp_path):
    return Path(shutil.copytree(template, tmp_path / "run", symlinks=True))


def _rows(run) -> dict:
    return {r.name: r for r in reshard.list_checkpoints(run).checkpoints}


def test_list_reads_every_registry_format_whole_and_exits_1_on_the_broken_one(template):
    rows = _rows(template)
    assert len(rows) == len(SERIES) * len(STEPS)
    for series, (_, name, unit) in SERIES.items():
        for step in STEPS:
            row = rows[f"{series}/{name.format(step)}"]
            assert (row.unit, row.step) == (unit, step), row
            assert row.status == (INCOMPLETE if step == BROKEN else COMPLETE), (row.name, row.why)
    tracker = "named by {}/latest_checkpointed_iteration.txt"
    assert {r.name: r.pinned for r in rows.values() if r.pinned} == \
        {f"{s}/iter_{TRACKED:07d}": (tracker.format(s),) for s in SERIES if s.startswith("mcore")}
    listed = run_cli("list", template, check=1)
    assert listed.stdout.count("INCOMPLETE") == len(SERIES) and "unverifiable" not in listed.stdout
    as_json = run_cli("list", template, "--json", check=1)     # the same exit status, the JSON as before
    assert [c["status"] for c in json.loads(as_json.stdout)["checkpoints"]].count(INCOMPLETE) == len(SERIES)


def test_prune_keeps_the_newest_what_the_tracker_names_and_the_broken_one(run):
    """`--keep-last 1 --yes`: step 2 of every series goes whole (but Megatron-LM's, which its tracker names);
    step 3 and the incomplete step 1 (no --delete-incomplete) stay byte-identical."""
    before = lr.snapshot(run)
    plan = json.loads(run_cli("prune", run, "--keep-last", "1", "--yes", "--json").stdout)
    gone = {f"{s}/{name.format(2)}" for s, (_, name, _) in SERIES.items() if not s.startswith("mcore")}
    assert set(plan["removed"]) == {str(run / g) for g in gone} and plan["bytes_freed"] > 0
    after = lr.snapshot(run)
    assert set(after) == {f for f in before if not any(f.startswith(g + "/") for g in gone)}
    assert all(after[f] == before[f] for f in after)


def test_prune_delete_incomplete_deletes_the_broken_ones_whole(run):
    run_cli("prune", run, "--keep-last", "3", "--delete-incomplete", "--yes")
    rows = _rows(run)
    assert all(r.status == COMPLETE and r.step != BROKEN for r in rows.values())
    assert len(rows) == len(SERIES) * (len(STEPS) - 1)


def test_watch_says_what_it_validated_per_checkpoint(run):
    """One line per checkpoint validated, complete or INCOMPLETE, and per one held back: an iteration newer than the
    one Megatron-LM's tracker names is still being saved (as a tag newer than DeepSpeed's `latest`). The summary
    counts what was done; the next pass validates nothing again and says so."""
    first = run_cli("watch", run, "--once", "--settle", "0", check=1)
    lines = first.stdout.splitlines()
    megatron = [s for s in SERIES if s.startswith("mcore")]
    validated = len(SERIES) * len(STEPS) - len(megatron)
    assert sum(": complete, " in line for line in lines) == validated - len(SERIES)
    assert sum(": INCOMPLETE — " in line for line in lines) == len(SERIES)
    held = [line for line in lines if ": in progress — newer than " in line]
    assert sorted(line.split("(")[-1] for line in held) == sorted(f"{s}/iter_0000003)" for s in megatron)
    assert all("named by mcore_" in line and "latest_checkpointed_iteration.txt" in line for line in held)
    assert lines[-1].endswith(f"validated {validated} checkpoints ({validated - len(SERIES)} complete, "
                              f"{len(SERIES)} incomplete), kept 0 unverifiable or unknown unread, left "
                              f"{len(megatron)} in progress, deleted 0")
    again = run_cli("watch", run, "--once", "--settle", "0", check=0)
    assert again.stdout.splitlines()[-1].endswith("validated 0 checkpoints (0 complete, 0 incomplete), kept 0 "
                                                 f"unverifiable or unknown unread, left {len(megatron)} in progress, "
                                                 "deleted 0")


def test_a_folder_named_unlike_its_series_is_no_member(tmp_path):
    """`checkpoint-1-weights/` (a weights export) and `checkpoint-3-copy/` (a whole copy, read as FSDP) beside
    checkpoint-N/: neither is step 1's or 3's save, and `--keep-last 1` deletes neither. The control: the copy
    named checkpoint-1 is a member, and deleted."""
    run = tmp_path / "out"
    source = FIXTURES / "hf_fsdp_sharded_dp2" / "checkpoint-3"
    for name in ("checkpoint-1", "checkpoint-2", "checkpoint-3", "checkpoint-3-copy"):
        shutil.copytree(source, run / name)
    weights = run / "checkpoint-1-weights"
    weights.mkdir()
    for name in ("model.safetensors", "config.json"):
        shutil.copy(FIXTURES / "hf_fsdp_full_dp2" / "checkpoint-3" / name, weights / name)
    lr.age(run)
    rows = _rows(run)
    assert rows["checkpoint-3-copy"].series == "checkpoint-3-copy" and rows["checkpoint-2"].series == ""
    assert rows["checkpoint-1-weights"].step is None
    plan = json.loads(run_cli("prune", run, "--keep-last", "1", "--json").stdout)
    actions = {d["name"]: d["action"] for d in plan["decisions"]}
    assert actions == {"checkpoint-1": "delete", "checkpoint-2": "delete", "checkpoint-3": "keep",
                       "checkpoint-3-copy": "keep", "checkpoint-1-weights": "keep"}
    before = lr.snapshot(weights)
    run_cli("prune", run, "--keep-last", "1", "--yes")
    assert lr.snapshot(weights) == before and (run / "checkpoint-3-copy").is_dir()
    assert not (run / "checkpoint-1").exists()


def test_a_run_prefix_in_a_bucket_is_listed_and_pruned_as_on_disk(s3, template):
    """The same run in the S3 server the tests start: the same rows, and `--keep-last 1 --yes` deletes the same."""
    import s3_server as servers
    prefix = "runs/registry"
    url = servers.upload(s3, str(template), prefix)

    def listed(where):
        rows = json.loads(run_cli("list", where, "--recent", "0", "--json", check=1).stdout)["checkpoints"]
        return [(r["name"], r["step"], r["status"], r["files"], r["bytes"], r["pinned"] != []) for r in rows]
    assert listed(url) == listed(template)
    run_cli("prune", url, "--keep-last", "1", "--recent", "0", "--yes")
    names = {name for name, *_ in listed(url)}
    gone = {f"{s}/{name.format(2)}" for s, (_, name, _) in SERIES.items() if not s.startswith("mcore")}
    assert names == {name for name, *_ in listed(template)} - gone
