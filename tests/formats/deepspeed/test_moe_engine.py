"""The unmodified DeepSpeed engine with AutoEP (and with deepspeed.moe) resumes reshard's conversions at another ep x dp
(issue #16): `engine.load_checkpoint` of the output, then its fp32 masters, both Adam moments and module weights
(gathered as tools/fixture_moe.py takes the truth) equal the fixture's truth bit for bit, and one more step runs
(tests/scripts/engine_moe_resume.py); so does the engine built with load_universal, from reshard's universal trees.
Two launches (2 and 4 ranks), several engines each. Negative controls: a changed
expert element in a converted file is caught; DeepSpeed's own load of the fixture at ep 1 gives wrong expert
masters (docs/deepspeed-moe.md §5) where reshard's output gives the truth. reshard.deepspeed_engine.load_checkpoint
loads the saves straight into the engine at another ep, bit-exact too."""
import shutil

import pytest
import torch

import reshard
from reshard.core.catalog import MASTER
from tests.helpers.cli import run_cli
from tests.helpers.damage import set_element
from tests.helpers.fixtures import FIXTURES, fixture_dir, truth_tensors
from tests.helpers.moe import PACKED
from tests.helpers.torchrun import run_torchrun
from tests.helpers.universal import ds_to_universal

pytestmark = pytest.mark.engine

# AutoEP under ZeRO-3 (issue #29), the experts partition-native in the ZeRO-3 files: ep 2 -> 1, ep 2 x expert-dp 1 ->
# ep 2 x expert-dp 2 and -> ep 4, ep 2 x expert-dp 2 -> ep 1 x dp 4; ZeRO-3 -> 1 and ZeRO-1/2 -> 3
Z3_CONVERSIONS = [(2, "autoep2_z3_fp32", "ep=1,dp=2"), (4, "autoep2_z3_fp32", "ep=2,dp=4"),
                  (4, "autoep2_z3_fp32_dp2", "ep=4,dp=4"), (4, "autoep2_z3_fp32_dp2", "ep=1,dp=4"),
                  (2, "autoep2_z3_fp32", "ep=2,dp=2,zero=1"), (2, "autoep2_z1_fp32", "ep=2,dp=2,zero=3"),
                  (4, "autoep2_z2_fp32_dp2", "ep=1,dp=4,zero=3"), (2, "autoep2_z2_bf16", "ep=1,dp=2,zero=3")]
# (world, fixture, --to): ep 2 -> ep 1 x dp 2; ep 2 x expert-dp 2 -> ep 2 x expert-dp 1; bf16; ep 2 -> ep 4 x dp 4;
# use_data_before_expert_parallelism at ep 4; ep 2 x expert-dp 2 -> ep 1 x dp 4; deepspeed.moe ep 2 -> 1 and 4;
# ZeRO-1 -> 2 (at ep 1 and ep 2) and 2 -> 1 (fp32; bf16, whose ZeRO-1 is BF16_Optimizer), the engine built at the
# target stage
CONVERSIONS = [(2, "autoep2_z1_fp32", "ep=1,dp=2"), (2, "autoep2_z2_fp32_dp2", "ep=2,dp=2"),
               (2, "autoep2_z2_bf16", "ep=1,dp=2"), (4, "autoep2_z1_fp32", "ep=4,dp=4"),
               (4, "autoep2_z2_fp32_dp2_datafirst", "ep=4,dp=4"), (4, "autoep2_z2_fp32_dp2", "ep=1,dp=4"),
               (2, "dsmoe_ep2_z2_fp32", "ep=1,dp=2"), (4, "dsmoe_ep2_z2_fp32", "ep=4,dp=4"),
               (2, "autoep2_z1_fp32", "ep=1,dp=2,zero=2"), (2, "autoep2_z1_fp32", "ep=2,dp=2,zero=2"),
               (4, "autoep2_z2_fp32_dp2", "ep=2,dp=4,zero=1"), (2, "autoep2_z2_bf16", "ep=2,dp=2,zero=1"),
               *Z3_CONVERSIONS]
CHANGED_ELEMENT = 3 * 16 * 32 + 100      # expert 3 of PACKED (4, 16, 32)
# Universal trees written by `convert --format universal` and loaded with load_universal: (world, fixture, --to, ep
# of the engine): ep 2 -> 1 (fp32, bf16); ep 2 x expert-dp 2 -> ep 2 x expert-dp 1; at 4 ranks ep 2 x expert-dp 2 ->
# ep 1, the data-first save and ep 2 -> 4 from trees written at ep 4. Each launch takes them first and in order of
# growing ep: DeepSpeed's universal loader cuts experts by the largest expert-parallel group any engine of the
# process has made (base_optimizer._get_universal_checkpoint_ep_info). (Nor may a launch hold a data-first engine at
# an ep below its world: an engine reuses the expert groups an earlier one made at its ep, keyed by ep alone,
# groups._create_expert_and_data_parallel.)
UNIVERSAL = [(2, "autoep2_z1_fp32", "", 1), (2, "autoep2_z2_bf16", "", 1), (2, "autoep2_z2_fp32_dp2", "dp=2", 2),
             (4, "autoep2_z2_fp32_dp2", "", 1), (4, "autoep2_z2_fp32_dp2_datafirst", "ep=4,dp=4", 4),
             (4, "autoep2_z1_fp32", "ep=4,dp=4", 4)]
# reshard.deepspeed_engine.load_checkpoint of the fixture itself into the engine at another ep: (world, fixture, ep)
DIRECT = [(2, "autoep2_z1_fp32", 1), (2, "autoep2_z2_bf16", 1), (2, "dsmoe_ep2_z2_fp32", 1), (2, "autoep2_z3_fp32", 1),
          (4, "autoep2_z2_fp32_dp2_datafirst", 4), (4, "autoep2_z2_fp32_dp2", 1), (4, "dsmoe_ep2_z2_fp32", 4)]
# (world, fixture, --to): DeepSpeed's ds_to_universal tree of the fixture, converted back by reshard (read as
# tests/formats/deepspeed/test_moe_universal_read.py does: the experts' bf16 module weights are their masters cast)
FROM_UNIVERSAL = [(2, "autoep2_z1_fp32", "ep=1,dp=2"), (2, "autoep2_z2_bf16", "ep=1,dp=2"),
                  (2, "autoep2_z2_fp32_dp2", "ep=1,dp=2"), (4, "autoep2_z2_fp32_dp2", "ep=4,dp=4")]


def _spec(to):
    """The job keys `to` sets: ep, and zero where it changes the stage."""
    given = {k: int(v) for k, v in (item.split("=") for item in to.split(","))}
    return {k: given[k] for k in ("ep", "zero") if k in given}


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    out = tmp_path_factory.mktemp("moe_resume")
    jobs, universal = {2: [], 4: []}, {2: [], 4: []}
    for world, name, to, ep in UNIVERSAL:
        dst = out / f"{name}-universal-{to}"
        run_cli("convert", fixture_dir(name), dst, "--format", "universal", "--to", to, "--quiet", check=0)
        universal[world].append({"fixture": name, "checkpoint": str(dst), "ep": ep, "fixtures": str(FIXTURES),
                                 "to": f"universal {to}", "universal": True})
        if (world, name) == (2, "autoep2_z1_fp32"):    # negative control: one expert element of a master changed
            changed = out / "universal-changed"
            shutil.copytree(dst, changed)
            _change_universal_element(changed / "global_step3" / "zero" / PACKED / "fp32.pt")
            universal[world].append({**universal[world][-1], "checkpoint": str(changed), "to": "universal changed"})
    for world, name, to in CONVERSIONS:
        dst = out / f"{name}-{to}"
        run_cli("convert", fixture_dir(name), dst, "--to", to, "--quiet", check=0)
        jobs[world].append({"fixture": name, "checkpoint": str(dst), **_spec(to), "fixtures": str(FIXTURES),
                            "to": to})
    # negative control: the first conversion with one expert element of its fp32 master changed
    changed = out / "changed"
    shutil.copytree(jobs[2][0]["checkpoint"], changed)
    set_element(reshard.open_checkpoint(changed), PACKED, MASTER, CHANGED_ELEMENT, lambda x: x + 0.5)
    jobs[2].append({**jobs[2][0], "checkpoint": str(changed), "to": "changed"})
    # DeepSpeed's native load of the ep-2 fixture at ep 1
    jobs[2].append({"fixture": "autoep2_z1_fp32", "checkpoint": str(fixture_dir("autoep2_z1_fp32")), "ep": 1,
                    "fixtures": str(FIXTURES), "to": "native"})
    # ZeRO-3: DeepSpeed's own load of the ep-2 save at ep 1 (refused), and a changed expert element in our output
    jobs[2].append({"fixture": "autoep2_z3_fp32", "checkpoint": str(fixture_dir("autoep2_z3_fp32")), "ep": 1,
                    "fixtures": str(FIXTURES), "to": "native z3", "refused": True})
    z3 = next(job for job in jobs[2] if job["fixture"] == "autoep2_z3_fp32" and job["to"] == "ep=1,dp=2")
    changed_z3 = out / "changed-z3"
    shutil.copytree(z3["checkpoint"], changed_z3)
    set_element(reshard.open_checkpoint(changed_z3), PACKED, MASTER, CHANGED_ELEMENT, lambda x: x + 0.5)
    jobs[2].append({**z3, "checkpoint": str(changed_z3), "to": "changed z3"})
    for world, name, ep in DIRECT:         # no conversion step
        jobs[world].append({"fixture": name, "checkpoint": str(fixture_dir(name)), "ep": ep, "fixtures": str(FIXTURES),
                            "to": f"direct ep={ep}", "direct": True})
    jobs[2].append({**jobs[2][0], "checkpoint": str(changed), "to": "direct changed", "direct": True})
    trees = {}
    for world, name, to in FROM_UNIVERSAL:
        if name not in trees:
            trees[name] = ds_to_universal(name, out / f"{name}-ds-universal")
        dst = out / f"{name}-from-ds-universal-{to}"
        run_cli("convert", trees[name], dst, "--format", "deepspeed", "--to", to, "--quiet", check=0)
        jobs[world].append({"fixture": name, "checkpoint": str(dst), **_spec(to), "fixtures": str(FIXTURES),
                            "to": f"from ds-universal {to}"})
    results = {}
    for world, world_jobs in jobs.items():
        world_jobs = universal[world] + world_jobs
        for result in run_torchrun("engine_moe_resume.py", world, world_jobs, out, f"moe{world}"):
            results[(result["fixture"], result["to"])] = result
    return results


@pytest.mark.parametrize("world,name,to", CONVERSIONS)
def test_the_engine_resumes_the_truth_at_another_ep(resumed, world, name, to):
    result = resumed[(name, to)]
    assert result["world"] == world and result["problems"] == []


def test_deepspeed_refuses_its_own_zero3_save_at_another_ep(resumed):
    """AutoEP under ZeRO-3: the engine at ep 1 compares the save's ds_zero_partition_groups with its own and refuses
    (stage3._rigid_load_state_dict); reshard's conversion of the same save resumes the truth (above)."""
    error = resumed[("autoep2_z3_fp32", "native z3")]["error"]
    assert error is not None and "same parameter placement topology" in error, error
    assert resumed[("autoep2_z3_fp32", "ep=1,dp=2")]["differ"] == []


def test_a_changed_expert_element_of_a_zero3_conversion_is_caught(resumed):
    """The ZeRO-3 engine restores its module weights from the fp32 masters: both show the one changed element."""
    assert resumed[("autoep2_z3_fp32", "changed z3")]["differ"] == [f"fp32/{PACKED}", f"module/{PACKED}"]


@pytest.mark.parametrize("world,name,to", FROM_UNIVERSAL)
def test_the_engine_resumes_ds_to_universals_tree_converted_back(resumed, world, name, to):
    result = resumed[(name, f"from ds-universal {to}")]
    assert result["world"] == world and result["problems"] == []


def test_a_changed_expert_element_is_caught(resumed):
    result = resumed[("autoep2_z1_fp32", "changed")]
    assert result["differ"] == [f"fp32/{PACKED}"]
    assert resumed[("autoep2_z1_fp32", "ep=1,dp=2")]["differ"] == []


def test_deepspeeds_native_load_at_another_ep_gives_wrong_expert_masters(resumed):
    """ep 2 -> ep 1 x dp 2 straight from the fixture: the engine loads without a word, the dense params and every
    module weight are right, and the experts' fp32 masters and moments are not (each rank took its file's
    6144-element expert vector as half of the 12288-element one); reshard's output of the same fixture resumes
    the truth (test above)."""
    result = resumed[("autoep2_z1_fp32", "native")]
    truth = truth_tensors("autoep2_z1_fp32")
    experts = {k for k in truth if ".mlp.experts.w" in k and not k.startswith("module/")}
    assert set(result["differ"]) <= experts            # nothing but expert optimizer state is wrong
    masters = {k for k in result["differ"] if k.startswith("fp32/")}
    assert len(masters) >= 4 and all(k.split("/", 1)[0] in ("fp32", "exp_avg", "exp_avg_sq")
                                     for k in result["differ"])
    assert resumed[("autoep2_z1_fp32", "direct ep=1")]["differ"] == []        # reshard's load of the same


@pytest.mark.parametrize("world,name,ep", DIRECT)
def test_reshard_loads_the_save_into_the_engine_at_another_ep(resumed, world, name, ep):
    """reshard.deepspeed_engine.load_checkpoint: the files the engine at its ep would have saved, planned and served
    from memory (the expert layer files too: DeepSpeed reads them through the engine's checkpoint engine)."""
    result = resumed[(name, f"direct ep={ep}")]
    assert result["world"] == world and result["problems"] == []


def test_reshards_direct_load_of_a_changed_expert_element_shows_it(resumed):
    assert resumed[("autoep2_z1_fp32", "direct changed")]["differ"] == [f"fp32/{PACKED}"]


def _change_universal_element(path):
    saved = torch.load(path, weights_only=False)      # our own output
    saved["param"].view(-1)[CHANGED_ELEMENT] += 0.5
    torch.save(saved, path)


@pytest.mark.parametrize("world,name,to,ep", UNIVERSAL)
def test_the_engine_resumes_our_universal_tree_at_another_ep(resumed, world, name, to, ep):
    result = resumed[(name, f"universal {to}")]
    assert result["world"] == world and result["ep"] == ep and result["problems"] == []


def test_a_changed_element_of_a_universal_tree_is_caught(resumed):
    """The universal loader sets the module weights from the fp32 masters (update_lp_params): both show it."""
    assert resumed[("autoep2_z1_fp32", "universal changed")]["differ"] == [f"fp32/{PACKED}", f"module/{PACKED}"]
