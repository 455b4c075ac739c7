"""`reshard thin` in an S3 bucket (issue 39, 3), in the SeaweedFS server the tests start: the same weights-only form
as on disk, put in place without a rename (reshard.lifecycle.thin_objects), and a SIGKILL at each step of it leaves the
full checkpoint or the thinned one whole, `list` calling the checkpoint complete only as the one or the other; the next
`prune --yes` finishes the swap. Controls: the full checkpoint beside it keeps its objects; a thinned object
altered in one element is caught by `validate --deep`.
"""
import json
import os
import subprocess
import sys

import pytest

import reshard
from reshard.core.catalog import TensorKey
from reshard.lifecycle import thin_objects
from tests.helpers.cli import run_cli
from tests.helpers.lifecycle_runs import ds_run
from tests.helpers.repo import REPO

FULL = ["bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
        "mp_rank_00_model_states.pt"]
THINNED = ["mp_rank_00_model_states.pt", "reshard-thinned.json"]


def rows(url) -> dict:
    listed = json.loads(run_cli("list", url, "--recent", "0", "--json").stdout)["checkpoints"]
    return {r["name"]: r for r in listed}


def names(server, prefix) -> list:
    import s3_server as servers
    return sorted(k[len(prefix) + 1:] for k in servers.keys(server, prefix + "/"))


def hidden(server, prefix) -> list:
    import s3_server as servers
    return [k for k in servers.keys(server, prefix + "/") if "/." in k]


def uploaded(server, tmp_path, prefix, fixture="z1_bf16_dp2"):
    import s3_server as servers
    save = ds_run(tmp_path, fixture)
    return save, servers.upload(server, str(save), prefix)


def test_thin_in_a_bucket_as_on_disk(s3, tmp_path):
    save, url = uploaded(s3, tmp_path, "thin/run")
    target = f"{url}/global_step2"
    assert "dry run" in run_cli("thin", target, "--recent", "0", check=0).stdout
    assert names(s3, "thin/run/global_step2") == FULL
    refused = run_cli("thin", target, "--yes", check=1).stderr      # uploaded a moment ago: a save in progress
    assert "in progress" in refused and len(refused.splitlines()) == 1
    result = json.loads(run_cli("thin", target, "--yes", "--recent", "0", "--json", check=0).stdout)
    assert result["executed"] and result["bytes_after"] < result["bytes_before"]
    assert names(s3, "thin/run/global_step2") == THINNED and hidden(s3, "thin/run") == []
    assert names(s3, "thin/run/global_step1") == FULL        # control: its neighbour untouched
    listed = rows(url)
    assert listed["global_step2"]["status"] == "complete" and listed["global_step2"]["bytes"] == result["bytes_after"]
    assert "weights-only (thinned from a full deepspeed checkpoint on " in run_cli("inspect", target).stdout
    run_cli("validate", target, "--deep", check=0)
    run_cli("export", save / "global_step2", tmp_path / "full.safetensors", check=0)
    run_cli("export", target, tmp_path / "thin.safetensors", check=0)
    assert (tmp_path / "full.safetensors").read_bytes() == (tmp_path / "thin.safetensors").read_bytes()
    # control: one element of the thinned module object changed (its zip CRC left stale) is caught
    import boto3
    env = s3.env()
    client = boto3.client("s3", endpoint_url=s3.endpoint, aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                          aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"], region_name=env["AWS_DEFAULT_REGION"])
    fragment = reshard.open_checkpoint(target).tensors[TensorKey("l1.weight", "module")].fragments[0]
    key = "thin/run/global_step2/mp_rank_00_model_states.pt"
    data = bytearray(client.get_object(Bucket=s3.bucket, Key=key)["Body"].read())
    at = fragment.storage.offset + fragment.elem_offset * 2
    data[at:at + 2] = bytes(b ^ 0x40 for b in data[at:at + 2])
    client.put_object(Bucket=s3.bucket, Key=key, Body=bytes(data))
    assert "CRC" in run_cli("validate", target, "--deep", check=1).stdout


def test_thin_zero3_in_a_bucket(s3, tmp_path):
    """A ZeRO-3 tag folder: its optimizer objects replaced by the ones written without the moments (same names),
    its model objects kept; export bit for bit, validate --deep; control: its neighbour keeps its moments."""
    save, url = uploaded(s3, tmp_path, "thin3/run", "z3_bf16_dp2")
    full = names(s3, "thin3/run/global_step2")
    result = json.loads(run_cli("thin", f"{url}/global_step2", "--yes", "--recent", "0", "--json", check=0).stdout)
    assert result["executed"] and result["bytes_after"] < result["bytes_before"]
    assert names(s3, "thin3/run/global_step2") == sorted([*full, "reshard-thinned.json"])
    assert hidden(s3, "thin3/run") == []
    listed = rows(url)
    assert listed["global_step2"]["bytes_by_kind"]["optimizer"] == 0 < listed["global_step1"]["bytes_by_kind"][
        "optimizer"]
    run_cli("validate", f"{url}/global_step2", "--deep", check=0)
    run_cli("export", save / "global_step2", tmp_path / "full.safetensors", check=0)
    run_cli("export", f"{url}/global_step2", tmp_path / "thin.safetensors", check=0)
    assert (tmp_path / "full.safetensors").read_bytes() == (tmp_path / "thin.safetensors").read_bytes()


@pytest.mark.parametrize("step", thin_objects.STEPS)
def test_a_kill_at_each_step_leaves_one_form_whole(s3, tmp_path, step):
    prefix = f"kill-{step}/run"
    _, url = uploaded(s3, tmp_path, prefix)
    proc = subprocess.run([sys.executable, "-m", "reshard", "thin", f"{url}/global_step2", "--yes", "--recent", "0"],
                          capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO), thin_objects.FAULT_AT: step})
    assert proc.returncode == -9, proc.stderr
    listed = rows(url)
    assert sorted(listed) == ["global_step1", "global_step2", "global_step3"]      # the hidden prefix is no row
    here = names(s3, f"{prefix}/global_step2")
    staged = f"{url}/.global_step2.reshard-thin"
    expected = {"written": FULL, "proven": FULL, "journal": FULL, "emptying": FULL[1:], "emptied": FULL[2:],
                "placed": THINNED, "removed": THINNED}[step]
    assert here == expected, here
    if listed["global_step2"]["status"] == "complete":
        assert here in (FULL, THINNED) and reshard.validate(f"{url}/global_step2", deep=True).ok
    else:       # mid-swap: X is neither form (list says so), and the thinned one is whole beside it
        assert here not in (FULL, THINNED) and reshard.validate(staged, deep=True).ok, (here, listed)
        assert listed["global_step2"]["status"] == "incomplete"
    run_cli("prune", url, "--keep-last", "3", "--recent", "0", "--yes", check=0)
    if step in ("written", "proven"):       # before the journal: rolled back, and the next thin starts over
        assert names(s3, f"{prefix}/global_step2") == FULL and hidden(s3, prefix) == []
        run_cli("thin", f"{url}/global_step2", "--yes", "--recent", "0", check=0)
    assert names(s3, f"{prefix}/global_step2") == THINNED and hidden(s3, prefix) == []
    assert rows(url)["global_step2"]["status"] == "complete"
    assert reshard.validate(f"{url}/global_step2", deep=True).ok
