"""The hypothesis strategy of the ZeRO property tests: a random model (params of 1 to 3 dimensions, trainable,
frozen or a buffer, in one or two groups, with DeepSpeed's options) and the two topologies it is converted between."""
from __future__ import annotations

from hypothesis import strategies as st

from tests.helpers.property_oracle import Topology
from tests.helpers.property_sources import LP, Model, Param


@st.composite
def zero_models(draw):
    """(model, topology A, topology B): data parallelism and ZeRO stages alone."""
    params = []
    for i in range(draw(st.integers(1, 6))):
        shape = tuple(draw(st.lists(st.integers(1, 9), min_size=1, max_size=3)))
        kind = draw(st.sampled_from(["trainable", "trainable", "trainable", "frozen"])) if i else "trainable"
        params.append(Param(f"p{i}.w", shape, kind))
    if draw(st.booleans()):
        params.append(Param("buf", (3,), "buffer"))
    trainable = [p.name for p in params if p.kind == "trainable"]
    groups = draw(st.integers(1, 2))
    model = Model(tuple(params), tuple(tuple(trainable[g::groups]) for g in range(groups) if trainable[g::groups]),
                  lp=draw(st.sampled_from(LP)),
                  states=draw(st.sampled_from([("exp_avg", "exp_avg_sq"), ("momentum_buffer",)])),
                  options=draw(st.sampled_from([{}, {"round_robin_gradients": True}, {"parameter_alignment": True},
                                                {"sub_group_size": 40}])))
    a = Topology(dp=draw(st.integers(1, 5)), zero=draw(st.sampled_from([1, 2, 3])))
    b = Topology(dp=draw(st.integers(1, 6)), zero=draw(st.sampled_from([1, 2, 3])))
    return model, a, b
