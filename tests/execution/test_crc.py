"""Bit rot is never passed on (issue 24 point 4): the CRC-32 every zip member carries is checked on what is read.

One flipped mantissa bit inside a tensor member of a copy of a real DeepSpeed fixture (found through the zip's
local headers): `validate --deep`, `convert`, `export`, `diff` and the load-time readers all fail naming the
file and the member, and nothing is written; the unflipped copy passes all of them (the negative control). A
real `dcp.save` is checked the same way: each of its `.distcp` items is a torch.save zip with CRCs of its own.
"""
from __future__ import annotations

import io
import os
import re
import shutil
import struct
import zipfile
import zlib

import pytest
import torch
from hypothesis import given, settings, strategies as st

import reshard
import reshard.cli
import reshard.dcp_reader
import reshard.reading.checksums
from reshard.commands.convert import make_plan
from reshard.core.dtypes import itemsize
from reshard.core.storage_ref import StorageRef
from reshard.errors import CheckpointError
from reshard.live.deepspeed_engine import ServedFiles
from reshard.reading.checksums import Tally, crc32_combine
from tests.helpers.engine_launches import shares
from tests.helpers.fixtures import copy_fixture, fixture_dir, tag_dir

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
NAME = "z2_fp32_dp2"
OPTIM = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
LOCAL = struct.Struct("<4s2B4HL2L2H")        # a zip local file header


def _members(path, base=0, length=None):
    """[(member name, first data byte in the file, bytes)] of the zip at [base, base + length) of `path`."""
    with open(path, "rb") as f:
        f.seek(base)
        blob = f.read(length) if length is not None else f.read()
    out = []
    with zipfile.ZipFile(io.BytesIO(blob)) as zf:
        for info in zf.infolist():
            fields = LOCAL.unpack_from(blob, info.header_offset)
            out.append((info.filename, base + info.header_offset + LOCAL.size + fields[-2] + fields[-1],
                        info.file_size))
    return out


def _flip(path, at: int, bit: int = 0) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ (1 << bit)]))


def _storage_of(src, state: str):
    """The member of rank 1's optimizer file holding a state (its name from reshard's catalog) and where its
    data lies (from the zip's own local headers)."""
    path = tag_dir(src) / OPTIM
    catalog = reshard.open_checkpoint(src)
    names = {frag.storage.member for t in catalog.tensors.values() if t.state == state for frag in t.fragments
             if frag.storage.file == str(path)}
    assert len(names) == 1, names
    return path, next(m for m in _members(path) if m[0] in names)


def _corrupt(tmp_path, state: str):
    """A copy of the fixture with one mantissa bit flipped in the middle of the member holding rank 1's `state`
    (a flat fp32 partition): (save dir, the file, the member's name)."""
    src = copy_fixture(NAME, tmp_path)
    path, (member, start, nbytes) = _storage_of(src, state)
    _flip(path, start + (nbytes // 8) * 4)       # the low byte of an fp32 element: mantissa bits
    return src, path, member


@pytest.fixture
def corrupt(tmp_path):
    """The master weights' member corrupt: every command reads it."""
    return _corrupt(tmp_path, "fp32")


def _cli(*args) -> int:
    return reshard.cli.main([*map(str, args), "--quiet"])


def _mismatch(path, member) -> str:
    return f"{path}: member {member}: CRC-32 mismatch (stored 0x"


def test_validate_deep_names_the_file_and_member(corrupt, capsys):
    src, path, member = corrupt
    assert _cli("validate", src) == 0, "without --deep no tensor byte is read"
    capsys.readouterr()
    assert _cli("validate", src, "--deep") == 1
    out = capsys.readouterr().out
    assert _mismatch(path, member) in out and "): the file is corrupt" in out, out


def test_convert_fails_and_writes_nothing(corrupt, tmp_path, capsys):
    src, path, member = corrupt
    for workers in ("1", "2"):
        dst = tmp_path / f"out{workers}"
        assert _cli("convert", src, dst, "--to", "dp=3", "--workers", workers) == 1
        err = capsys.readouterr().err.strip()
        assert err.startswith("reshard: " + _mismatch(path, member)) and "\n" not in err, err
        assert [p.name for p in tmp_path.iterdir()] == [NAME], "nothing beside the source: no DST, no staging"


def test_export_fails_and_writes_nothing(corrupt, tmp_path, capsys):
    src, path, member = corrupt
    out = tmp_path / "model.safetensors"
    assert _cli("export", src, out) == 1
    assert _mismatch(path, member) in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == [NAME], "nothing beside the source: no file, manifest, staging"


def test_bytes_of_a_member_no_tensor_holds_are_verified_too(tmp_path, capsys):
    """ZeRO pads each rank's flat partition; the padding is no tensor's, and no conversion copies it. A flipped bit
    there is still found: a member a command reads any of is verified whole (the rest read for the check)."""
    src = copy_fixture(NAME, tmp_path)
    path = tag_dir(src) / OPTIM
    catalog = reshard.open_checkpoint(src)
    held = {}
    for tensor in catalog.tensors.values():
        size = itemsize(tensor.stored_dtype)
        for frag in tensor.fragments:
            first = frag.storage.offset + frag.elem_offset * size
            held.setdefault(frag.storage, []).append((first, first + frag.numel * size))
    storage, padding = next((s, s.offset + s.nbytes - 1) for s, ranges in held.items() if s.file == str(path)
                            and all(not lo <= s.offset + s.nbytes - 1 < hi for lo, hi in ranges))
    _flip(path, padding)
    assert _cli("convert", src, tmp_path / "out", "--to", "dp=3") == 1
    assert _mismatch(path, storage.member) in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_a_member_a_command_does_not_read_is_not_verified(tmp_path, capsys):
    """The rule: a member is verified whole when a command reads any of it. Exporting the master weights reads
    no Adam moment, so a corrupt exp_avg passes into nothing and the export succeeds; --with-optimizer reads it
    and fails; validate --deep reads every member."""
    src, path, member = _corrupt(tmp_path, "exp_avg")
    assert _cli("export", src, tmp_path / "weights.safetensors") == 0
    assert _cli("export", src, tmp_path / "all", "--with-optimizer") == 1
    assert _mismatch(path, member) in capsys.readouterr().err and not (tmp_path / "all").exists()
    assert _cli("validate", src, "--deep") == 1
    assert _mismatch(path, member) in capsys.readouterr().out


def test_diff_is_an_error_not_a_difference(corrupt, capsys):
    """diff's trouble exit (2: 0 equal, 1 different), whichever side is corrupt."""
    src, path, member = corrupt
    for a, b in ((src, fixture_dir(NAME)), (fixture_dir(NAME), src)):
        assert _cli("diff", a, b) == 2
        captured = capsys.readouterr()
        assert _mismatch(path, member) in captured.err and "DIFFERENT" not in captured.out, captured


def test_the_unflipped_copy_passes_everything(tmp_path, capsys):
    """The negative control of the tests above, on the same kind of copy."""
    src = copy_fixture(NAME, tmp_path)
    assert _cli("validate", src, "--deep") == 0
    assert re.search(r"bytes checked for NaN/Inf, [1-9]\d* zip members against their CRC-32$", capsys.readouterr().out)
    assert _cli("convert", src, tmp_path / "out", "--to", "dp=3") == 0
    assert _cli("convert", src, tmp_path / "out2", "--to", "dp=3", "--workers", "2") == 0
    assert _cli("export", src, tmp_path / "model.safetensors") == 0
    assert _cli("diff", src, fixture_dir(NAME)) == 0
    _served(src)        # raises nothing
    _dcp_load(src)


def test_a_flip_outside_every_members_data_is_not_a_crc_error(tmp_path):
    """The truth about the zip's framing: a member's CRC-32 covers its data only. A flipped bit in the padding
    of a local header's extra field (torch.save aligns storages with it) is in no member's data: nothing
    reports it, and nothing copies it either (convert writes headers of its own; the output's bytes are the
    clean copy's)."""
    src = copy_fixture(NAME, tmp_path)
    path, (member, start, _) = _storage_of(src, "fp32")
    with open(path, "rb") as f:
        f.seek(start - 1)
        assert f.read(1) == b"Z"         # torch.save's alignment padding, just before the data
    _flip(path, start - 1)
    assert _cli("validate", src, "--deep") == 0
    assert _cli("convert", src, tmp_path / "out", "--to", "dp=3") == 0
    assert _cli("convert", fixture_dir(NAME), tmp_path / "clean", "--to", "dp=3") == 0
    for name in os.listdir(tmp_path / "clean" / "global_step3"):
        assert (tmp_path / "out" / "global_step3" / name).read_bytes() == \
            (tmp_path / "clean" / "global_step3" / name).read_bytes(), name


def test_a_flip_in_the_pickle_fails_every_command(tmp_path, capsys):
    """data.pkl, the metadata reshard parses, is a whole member read: its CRC-32 is checked before unpickling."""
    src = copy_fixture(NAME, tmp_path)
    path = tag_dir(src) / OPTIM
    member, start, nbytes = next(m for m in _members(path) if m[0].endswith("data.pkl"))
    _flip(path, start + nbytes // 2, 3)
    for command in (["inspect", src], ["validate", src], ["convert", src, tmp_path / "out", "--to", "dp=3"]):
        assert _cli(*command) == 1
        captured = capsys.readouterr()
        assert _mismatch(path, member) in captured.out + captured.err, command
    assert not (tmp_path / "out").exists()


def _served(src):
    """Every file reshard.deepspeed_engine.load_checkpoint would serve DeepSpeed at dp=3, built as DeepSpeed asks for
    it; the mismatches its ranks would raise after the load."""
    plan = make_plan(reshard.open_checkpoint(src), "dp=3")
    served = ServedFiles(None, "/served", plan)
    try:
        for f in plan.files:
            served.load(os.path.join("/served", f.path))
        problem = next(reshard.reading.checksums.problems_of([served.read()]), None)
    finally:
        served.close()
    if problem is not None:
        raise problem


def test_the_live_loader_raises(corrupt):
    src, path, member = corrupt
    with pytest.raises(CheckpointError, match="CRC-32 mismatch") as caught:
        _served(src)
    assert str(caught.value).startswith(_mismatch(path, member))


def _dcp_load(src):
    reader = reshard.dcp_reader.Reader(src)
    metadata = reader.read_metadata()
    flat = {key: torch.zeros(tuple(m.size), dtype=m.properties.dtype)
            for key, m in metadata.state_dict_metadata.items() if hasattr(m, "size")}
    import torch.distributed.checkpoint as dcp
    dcp.load(flat, storage_reader=reader)


def _dcp_load_error(src) -> str:
    """What dcp.load raises (a CheckpointException carrying each rank's exception), as text."""
    from torch.distributed.checkpoint.api import CheckpointException  # (a BaseException)
    with pytest.raises(CheckpointException) as caught:
        _dcp_load(src)
    failures = getattr(caught.value, "failures", {})
    return "\n".join([str(caught.value)] + [str(getattr(f, "exception", f)) for f in failures.values()])


def test_the_dcp_reader_raises(corrupt):
    src, path, member = corrupt
    assert _mismatch(path, member) in _dcp_load_error(src)


# a real dcp.save: every item of a .distcp file is a torch.save zip, with its members' CRC-32s


@pytest.fixture(scope="module")
def dcp_saved(tmp_path_factory):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from fixture_model import build_model, make_batch, param_groups

    model = build_model()
    optim = torch.optim.AdamW(param_groups(model)[0], lr=0.01)
    model(make_batch(0, 0)).backward()
    optim.step()
    msd, osd = get_state_dict(model, optim)
    out = tmp_path_factory.mktemp("dcp") / "saved"
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(out), no_dist=True)
    return out


def _dcp_chunk(root):
    """(file, the name reshard gives the member, its first data byte, bytes) of the biggest tensor chunk."""
    from torch.distributed.checkpoint import FileSystemReader
    best = None
    for info in FileSystemReader(str(root)).read_metadata().storage_data.values():
        path = os.path.join(root, info.relative_path)
        for name, start, nbytes in _members(path, info.offset, info.length):
            if name.endswith("/data/0") and (best is None or nbytes > best[3]):
                best = (path, f"{name} of the archive at byte {info.offset}", start, nbytes)
    return best


def test_a_real_dcp_save_with_a_flipped_bit(dcp_saved, tmp_path, capsys):
    src = tmp_path / "saved"
    shutil.copytree(dcp_saved, src)
    assert _cli("validate", src, "--deep") == 0     # the negative control
    _dcp_load(src)
    assert _cli("convert", src, tmp_path / "clean", "--to", "dp=2") == 0
    path, member, start, nbytes = _dcp_chunk(src)
    _flip(path, start + (nbytes // 8) * 4)
    capsys.readouterr()
    assert _cli("validate", src, "--deep") == 1
    assert _mismatch(path, member) in capsys.readouterr().out
    for out, to in (("dcp", ["--to", "dp=2"]), ("ds", ["--to", "dp=2,zero=2", "--format", "deepspeed"])):
        assert _cli("convert", src, tmp_path / out, *to) == 1
        assert _mismatch(path, member) in capsys.readouterr().err
        assert not (tmp_path / out).exists()
    assert _mismatch(path, member) in _dcp_load_error(src)


def test_safetensors_is_said_to_carry_no_checksum(tmp_path, capsys):
    out = tmp_path / "model.safetensors"
    assert _cli("export", fixture_dir(NAME), out) == 0
    assert _cli("validate", out, "--deep") == 0
    assert "1 file (model.safetensors) carry no checksum" in capsys.readouterr().out


# the parts


@given(st.binary(max_size=300), st.binary(max_size=300))
def test_crc32_combine_is_the_crc_of_the_concatenation(a, b):
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_blocks_read_in_any_order_with_gaps_and_overlaps_verify_a_member_whole(tmp_path_factory, data):
    """Blocks noted out of order, overlapping, some only touched, leaving gaps: the member verifies exactly when
    its bytes on disk are those whose CRC-32 the archive stores, wherever a flipped bit lies."""
    path = tmp_path_factory.mktemp("tally") / "file"
    blob = bytearray(data.draw(st.binary(min_size=40, max_size=400)))
    path.write_bytes(bytes(blob))
    first = data.draw(st.integers(0, 10))
    last = data.draw(st.integers(first + 1, len(blob)))
    member = StorageRef(str(path), first, last - first, "uint8", "archive/data/0", zlib.crc32(blob[first:last]))
    flip = data.draw(st.none() | st.integers(first, last - 1))
    if flip is not None:
        blob[flip] ^= 1 << data.draw(st.integers(0, 7))
        path.write_bytes(bytes(blob))
    tally = Tally([member])
    for _ in range(data.draw(st.integers(0, 8))):
        lo = data.draw(st.integers(first, last - 1))
        hi = data.draw(st.integers(lo + 1, last))
        if data.draw(st.booleans()):
            tally.note_at(str(path), lo, bytes(blob[lo:hi]))
        else:
            tally.touch_at(str(path), lo, hi - lo)
    tally.expect([member])
    problems = list(tally.problems())
    assert len(problems) == (flip is not None)
    if problems:
        assert f"member archive/data/0: CRC-32 mismatch (stored 0x{member.crc:08x}" in str(problems[0])


@shares("engine_resume.py")
def live_load_jobs(out):
    """The corrupt copy (its file and member in the job) and the clean fixture, loaded at 2 ranks."""
    src, path, member = _corrupt(out, "fp32")
    fixtures = str(fixture_dir(NAME).parent.parent)
    return [(2, None, {"fixture": NAME, "checkpoint": str(src), "stage": 2, "fixtures": fixtures, "direct": True,
                       "file": str(path), "member": member}),
            (2, None, {"fixture": NAME, "checkpoint": str(fixture_dir(NAME)), "stage": 2, "fixtures": fixtures,
                       "direct": True})]


@pytest.mark.engine
def test_the_live_engine_load_raises_on_every_rank(engine_launches):
    """reshard.deepspeed_engine.load_checkpoint under torchrun (2 ranks, the fixture's own model and config): the
    corrupt copy raises the same one line on every rank, after DeepSpeed's load and before training goes on; the
    clean fixture in the same launch loads (the negative control)."""
    bad, good = engine_launches.results(live_load_jobs)
    assert os.path.dirname(os.path.dirname(bad["file"])) == bad["checkpoint"] != good["checkpoint"]
    assert bad.get("error", "").startswith(_mismatch(bad["file"], bad["member"])), bad
    assert good["problems"] == [] and "error" not in good, good


@pytest.mark.parametrize("crc", [reshard.reading.checksums.crc32, zlib.crc32], ids=["installed", "zlib"])
def test_a_member_its_blocks_tile_is_verified_without_reading_it_again(tmp_path, monkeypatch, crc):
    """Blocks read twice with other boundaries (overlapping in part), noted out of order: the blocks that tile the
    member are chained, and no byte is read from disk again (the file is gone before the check). The control: a
    member one byte of which no block covers is read for the check. With the CRC-32 reshard found installed
    (ISA-L's, where python-isal is) and with zlib's, its fallback."""
    monkeypatch.setattr(reshard.reading.checksums, "crc32", crc)
    blob = os.urandom(1000)
    path = tmp_path / "file"
    path.write_bytes(blob)
    member = StorageRef(str(path), 0, 1000, "uint8", "archive/data/0", zlib.crc32(blob))
    blocks = [(lo, min(1000, lo + 100)) for lo in range(0, 1000, 100)] + \
             [(lo, min(1000, lo + 100)) for lo in range(50, 1000, 100)] + [(0, 50)]
    whole, gap = Tally([member]), Tally([member])
    for lo, hi in sorted(blocks, key=lambda b: -b[1]):       # last first
        if (lo, hi) not in ((0, 100), (0, 50)):
            gap.note_at(str(path), lo, blob[lo:hi])
        whole.note_at(str(path), lo, blob[lo:hi])
    gap.touch_at(str(path), 0, 1)       # bytes [0, 50): used (byte 0 touched), hashed in no block
    path.unlink()
    whole.verify()
    with pytest.raises(CheckpointError, match="cannot read"):
        gap.verify()


def test_every_member_written_carries_zlibs_crc(tmp_path):
    """zipfile takes the CRC-32 of each member reshard writes with ISA-L's function (reshard.formats.torchsave_write):
    every member of a converted checkpoint's archives stores zlib's own CRC-32 of its bytes, read back by offset
    (not through zipfile); the control: a byte of a member changed, zlib's CRC of it differs from the stored one."""
    out = tmp_path / "out"
    reshard.convert(fixture_dir("z2_fp32_dp2"), out, "dp=3")
    archives = sorted(out.rglob("*.pt"))
    members = []
    for path in archives:
        raw = path.read_bytes()
        with zipfile.ZipFile(path) as archive:
            for info in archive.infolist():
                name_len, extra_len = struct.unpack_from("<HH", raw, info.header_offset + 26)
                start = info.header_offset + 30 + name_len + extra_len
                members.append((raw[start:start + info.file_size], info.CRC))
    assert len(archives) == 4 and len(members) > 6 * len(archives)
    assert all(zlib.crc32(data) == stored for data, stored in members)
    data, stored = max(members, key=lambda member: len(member[0]))
    assert zlib.crc32(bytes([data[0] ^ 1]) + data[1:]) != stored
