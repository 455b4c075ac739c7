"""Property tests: for random models, dtypes, ZeRO stages, dp degrees, paddings and DeepSpeed options, every
element of every target tensor comes from the right source element exactly once, and A -> B -> A is the identity.

Each example builds a source whose every element holds a distinct value (tests/helpers/property_sources.py), writes it
as real DeepSpeed files at layout A, converts A -> B -> A with the real planner, executor and reader, and
compares every tensor of every file written to the oracle's numpy partition of the full tensors
(tests/helpers/property_oracle.py: round-robin order, per-param alignment, 2*dp padding, ZeRO-3 parts and sub-groups),
the tensors reshard reads back to the truth bit for bit, and the two A's byte for byte.
Tensor and pipeline parallelism and the other formats: tests/formats/deepspeed/test_properties_parallel.py.

RESHARD_PROPERTY_EXAMPLES=N multiplies max_examples by N for a long run.
"""
import os

from hypothesis import HealthCheck, given, settings

import reshard
from tests.helpers.property_models import zero_models
from tests.helpers.property_oracle import assert_ok, check_deepspeed, tag_dir
from tests.helpers.property_sources import (
    MODULE,
    bits,
    convert,
    scratch,
    source_catalog,
    tree_bytes,
    truth,
)

SCALE = int(os.environ.get("RESHARD_PROPERTY_EXAMPLES", "1"))


def _check(catalog, path, model, values, topo):
    """The files against the oracle, and what reshard reads back from them against the truth."""
    assert_ok(check_deepspeed(tag_dir(path), model, values, topo))
    assert reshard.validate(catalog).ok
    for (name, state), want in values.items():
        if state == MODULE and topo.zero == 3 and model.param(name).kind == "trainable":
            continue    # ZeRO-3 keeps no 16-bit copy of trainable params
        assert (bits(reshard.full_tensor(catalog, name, state)).reshape(want.shape) == want).all(), (name, state)


@settings(max_examples=500 * SCALE, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(zero_models())
def test_conversions_move_every_element_to_its_place(case):
    model, a_topo, b_topo = case
    with scratch() as root:
        values = truth(model)
        a = convert(source_catalog(model, values, root), a_topo.spec(), os.path.join(root, "a"))
        _check(a, os.path.join(root, "a"), model, values, a_topo)
        b = convert(a, b_topo.spec(), os.path.join(root, "b"))
        _check(b, os.path.join(root, "b"), model, values, b_topo)
        convert(b, a_topo.spec(), os.path.join(root, "a2"), read=False)
        assert tree_bytes(os.path.join(root, "a")) == tree_bytes(os.path.join(root, "a2"))
