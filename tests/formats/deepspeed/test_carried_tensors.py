"""Tensors inside the state a DeepSpeed writer carries over from the source (client state: Lightning's
ModelCheckpoint keeps `kth_value = tensor(inf)` there) are written as torch wrote them, their bytes copied into the
new file: the output loads with plain torch where reshard is not installed and names no global the source did not.
(tests/formats/framework/test_lightning_deepspeed.py proves the same on a real Lightning run, resumed by Lightning.)"""
import shutil

import pytest
import torch

from tests.helpers.cli import run_cli
from tests.helpers.fixtures import fixture_dir, tag_dir
from tests.helpers.pickles import load_without_reshard, pickle_globals

SOURCE = "z2_fp32_dp2"


def client_tensors() -> dict:
    base = torch.arange(10, dtype=torch.float32)
    with_attr = torch.ones(2, dtype=torch.float64)
    with_attr.note = "kept"          # torch pickles such a tensor through _rebuild_from_type_v2
    return {"kth_value": torch.tensor(float("inf")),
            "scores": {"a.ckpt": torch.tensor(8.5), "b.ckpt": torch.tensor(-0.0)},
            "base": base, "view": base[1::3],             # one storage: the view keeps its offset and strides
            "ints": torch.arange(5), "flags": torch.tensor([True, False, True]),
            "half": torch.full((2, 3), 1.5, dtype=torch.bfloat16).t(), "empty": torch.zeros(0),
            "grad": torch.ones(3).requires_grad_(), "with_attr": with_attr, "plain": [1, "two", None],
            "param": torch.nn.Parameter(torch.full((2,), 3.0)), "frozen": torch.nn.Parameter(torch.ones(1), False)}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """The fixture's save dir with tensors added to its client state (torch.load and torch.save, as a caller of
    engine.save_checkpoint(client_state=...) would have them pickled)."""
    save_dir = tmp_path_factory.mktemp("carried") / "checkpoint"
    shutil.copytree(fixture_dir(SOURCE), save_dir)
    states = tag_dir(save_dir) / "mp_rank_00_model_states.pt"
    tree = torch.load(states, weights_only=False)
    tree["client"] = client_tensors()
    torch.save(tree, states)
    return save_dir


SPECS = [("--to", "dp=3"), ("--to", "dp=1"), ("--to", "dp=2,zero=3"), ("--format", "universal")]


@pytest.fixture(scope="module")
def converted(source, tmp_path_factory):
    """({spec: its output}, what torch alone loads of the client state of the source and of every output's
    model states files): one loader process for them all, torch imported there once."""
    root = tmp_path_factory.mktemp("converted")
    outs = {spec: root / f"out{i}" for i, spec in enumerate(SPECS)}
    for spec, out in outs.items():
        run_cli("convert", source, out, *spec, check=0)
    files = [tag_dir(source) / "mp_rank_00_model_states.pt", *(t for out in outs.values()
                                                               for t in out.rglob("*model_states.pt"))]
    return outs, load_without_reshard({f: ["client"] for f in files}, cwd=root)


@pytest.mark.parametrize("spec", SPECS)
def test_carried_tensors_load_without_reshard(source, converted, spec):
    outs, loaded = converted
    out = outs[spec]
    targets = sorted(out.rglob("*model_states.pt"))     # ZeRO-3: every rank's file carries the client state
    src = tag_dir(source) / "mp_rank_00_model_states.pt"
    want = loaded[str(src)]
    assert len(want) == 16 and targets
    for target in targets:
        assert loaded[str(target)] == want, target
    # every output pickle names only what the source's pickles name (torch's rebuild functions and storages,
    # DeepSpeed's classes): no reshard.* global
    source_globals = set().union(*(pickle_globals(p) for p in tag_dir(source).glob("*.pt")))
    for path in out.rglob("*.pt"):
        names = pickle_globals(path)
        assert names <= source_globals, (path, names - source_globals)


@pytest.fixture(scope="module")
def tensor_lr(tmp_path_factory):
    """The fixture with its param group's lr a tensor (torch.optim takes one) in every rank's optimizer file."""
    save_dir = tmp_path_factory.mktemp("tensor_lr") / "checkpoint"
    shutil.copytree(fixture_dir(SOURCE), save_dir)
    for path in tag_dir(save_dir).glob("*optim_states.pt"):
        tree = torch.load(path, weights_only=False)
        for group in tree["optimizer_state_dict"]["base_optimizer_state"]["param_groups"]:
            group["lr"] = torch.tensor(group["lr"], dtype=torch.float64)
        torch.save(tree, path)
    return save_dir


def test_tensor_hyper_parameter_carried_or_refused(tensor_lr, tmp_path):
    out = tmp_path / "out"
    run_cli("convert", tensor_lr, out, "--to", "dp=3", check=0)
    files = {p: ["optimizer_state_dict"] for p in [next(tag_dir(tensor_lr).glob("*optim_states.pt")),
                                                     *tag_dir(out).glob("*optim_states.pt")]}
    loaded = load_without_reshard(files, cwd=tmp_path)
    lrs = [[v for p, v in leaves if p[-1] == "lr"] for leaves in loaded.values()]
    assert len(lrs) == 4 and all(x == lrs[0] for x in lrs) and lrs[0][0]["dtype"] == "torch.float64"
    # DCP has no place for it yet: one line naming the key, nothing written
    proc = run_cli("convert", tensor_lr, tmp_path / "dcp", "--format", "dcp", check=1)
    assert proc.stderr.count("\n") == 1 and "optim.param_groups.0.lr is a tensor" in proc.stderr
    assert not (tmp_path / "dcp").exists()
