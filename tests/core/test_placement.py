"""Placements: flat ranges of shards as boxes, and the lookups that meet them, checked against numpy indexing."""
import itertools
import math

import numpy as np
from hypothesis import given, settings, strategies as st

from reshard.core.catalog import Fragment, TensorDraft
from reshard.core.locate import Locator
from reshard.core.placement import Block, Shard, flat_boxes, full_index, regions, through, tiles
from reshard.core.storage_ref import StorageRef

shapes = st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple)


@settings(max_examples=300, deadline=None)
@given(shapes.flatmap(lambda s: st.tuples(st.just(s), st.integers(0, math.prod(s)), st.integers(0, math.prod(s)))))
def test_flat_boxes_are_the_range_in_order(case):
    shape, a, b = case
    a, b = min(a, b), max(a, b)
    seen, position = np.zeros(shape, int), a
    boxes = flat_boxes(shape, a, b)
    for at, size in boxes:
        assert int(np.ravel_multi_index(at, shape)) == position if shape else position == 0
        seen[tuple(slice(i, i + n) for i, n in zip(at, size, strict=True))] += 1
        position += math.prod(size)
    expected = np.zeros(math.prod(shape), int)
    expected[a:b] = 1
    assert position == b and np.array_equal(seen.reshape(-1), expected)
    assert len(boxes) <= max(1, 2 * len(shape) - 1)


@st.composite
def cut_tensors(draw):
    """A 2-d tensor cut into shards along one dim (TP), each shard's flat order cut into ranges (ZeRO)."""
    rows, cols = draw(st.integers(1, 7)), draw(st.integers(1, 7))
    dim = draw(st.integers(0, 1))
    n = (rows, cols)[dim]
    cuts = sorted(set(draw(st.lists(st.integers(1, n - 1), max_size=2)))) if n > 1 else []
    edges = [0, *cuts, n]
    shards = []
    for lo, hi in itertools.pairwise(edges):
        shape = (hi - lo, cols) if dim == 0 else (rows, hi - lo)
        at = (lo, 0) if dim == 0 else (0, lo)
        shards.append((at, shape))
    return (rows, cols), shards, draw(st.integers(1, 9))


@settings(max_examples=300, deadline=None)
@given(cut_tensors(), st.integers(0, 49), st.integers(0, 49))
def test_locator_finds_every_element_where_numpy_does(case, a, b):
    full_shape, shards, part = case
    truth = np.arange(math.prod(full_shape)).reshape(full_shape)
    storage = []                       # one flat buffer holding every shard, as ranges of `part` elements
    tensor = TensorDraft("w", "fp32", full_shape, "int64")
    for at, shape in shards:
        values = truth[at[0]:at[0] + shape[0], at[1]:at[1] + shape[1]].reshape(-1)
        shard = Shard.box(at, shape)
        for lo in range(0, values.size, part):
            hi = min(values.size, lo + part)
            tensor.fragments.append(Fragment(lo, hi, StorageRef("buf", 0, 0, "int64"), len(storage), None, shard))
            storage += values[lo:hi].tolist()
    assert tiles(full_shape, [(r.at, r.shape) for f in tensor.fragments for r in regions(f.shard, f.start, f.stop)])
    # ask for a flat range of the whole tensor and of another cut (the transposed direction's halves)
    buffer = np.array(storage)
    n = truth.size
    a, b = sorted((a % (n + 1), b % (n + 1)))
    wanted = np.zeros(b - a, int) - 1
    for hit in Locator(tensor.freeze()).boxes(None, a, b):
        first = int(np.ravel_multi_index(hit.local, full_shape)) - a
        span = sum((k - 1) * s for k, s in zip(hit.shape, hit.strides, strict=True)) + 1
        got = np.lib.stride_tricks.as_strided(buffer[hit.elem:hit.elem + span], hit.shape,
                                              tuple(s * 8 for s in hit.strides))
        np.lib.stride_tricks.as_strided(wanted[first:], hit.shape, (full_shape[1] * 8, 8))[...] = got
    assert np.array_equal(wanted, truth.reshape(-1)[a:b])


def test_full_index_maps_a_shard_element_to_the_tensor():
    shard = Shard((2, 3), (Block((4, 2), (0, 0), (2, 3)),))
    assert full_index(shard, (8, 8), 4) == 5 * 8 + 3
    assert full_index(Shard((2, 3), ()), (8, 8), 4) is None
    assert Shard.box((0, 0), (3, 4)) == Shard.whole((3, 4))


def test_a_shard_seen_through_a_view_places_the_rows_the_view_takes():
    """T (12 rows of 3) holds U's 6 rows as two groups of 3 rows at T's rows 1-3 and 7-9 (a fused q/k/v's q): each
    chunk of T's rows, seen through that view, places exactly the elements numpy's indexing says, and no others."""
    t_shape, u_shape = (12, 3), (6, 3)
    view = (Block((0, 0), (1, 0), (3, 3)), Block((3, 0), (7, 0), (3, 3)))
    t_of_u = np.concatenate([np.arange(12 * 3).reshape(t_shape)[1:4], np.arange(12 * 3).reshape(t_shape)[7:10]])
    for a, b in itertools.combinations(range(13), 2):
        shard = through(Shard.box((a, 0), (b - a, 3)), view)
        assert shard.shape == (b - a, 3)
        for i in range(shard.numel):
            t_index = a * 3 + i
            hit = np.flatnonzero(t_of_u.reshape(-1) == t_index)
            assert full_index(shard, u_shape, i) == (int(hit[0]) if hit.size else None), (a, b, i)
