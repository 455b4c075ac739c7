#!/usr/bin/env python
"""Hostile and broken checkpoints, made from the real fixtures, for tests/formats/test_hostile.py.

    python tools/make_hostile.py OUT CANARY

Each case is a copy of a real DeepSpeed save dir with one thing wrong: pickles that try to run
code (each would create CANARY), zip entries pointing outside the file, storages larger than the
file, truncations, empty and foreign files, missing ranks, files from another step, ranks
disagreeing on param_shapes, NaN values. `cases()` describes them: the save dir, the file at
fault, and which commands must reject it.
"""
import os
import pickle
import shutil
import struct
import subprocess
import sys
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(os.path.dirname(HERE), "fixtures")
ALL = ("inspect", "validate", "plan", "convert", "export")


class Payload:
    """Pickles as a call to `func(*args)`: what a malicious checkpoint would contain."""

    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __reduce__(self):
        return (self.func, self.args)


def _copy(name, out, case):
    dst = os.path.join(out, case)
    shutil.copytree(os.path.join(FIXTURES, name, "checkpoint"), dst)
    return dst, os.path.join(dst, "global_step3")


def _rewrite(path, edit):
    import torch
    sd = torch.load(path, weights_only=False)
    edit(sd)
    torch.save(sd, path)


def _central_entry(data: bytes, member_suffix: str) -> int:
    """Offset of the central-directory record of the first member ending with `member_suffix`."""
    pos = data.rfind(b"PK\x05\x06")
    start = struct.unpack_from("<I", data, pos + 16)[0]
    while data[start:start + 4] == b"PK\x01\x02":
        name_len, extra_len, comment_len = struct.unpack_from("<HHH", data, start + 28)
        name = data[start + 46:start + 46 + name_len].decode()
        if name.endswith(member_suffix):
            return start
        start += 46 + name_len + extra_len + comment_len
    raise ValueError(member_suffix)


def _patch_central(path, member_suffix, field_offset, value):
    data = bytearray(open(path, "rb").read())
    entry = _central_entry(bytes(data), member_suffix)
    for offset in ([field_offset] if isinstance(field_offset, int) else field_offset):
        struct.pack_into("<I", data, entry + offset, value)
    open(path, "wb").write(bytes(data))


def build(out, canary):
    """Make every case under `out`; returns {case: (save dir, file at fault, commands, needle)}."""
    os.makedirs(out, exist_ok=True)
    cases = {}
    optim = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    model = "mp_rank_00_model_states.pt"

    def case(name, fixture, victim, edit, commands=ALL, needle=""):
        save, tag = _copy(fixture, out, name)
        path = os.path.join(tag, victim)
        edit(path, tag)
        cases[name] = (save, path, commands, needle)

    touch = f"open({canary!r}, 'w').close()"
    case("global_os_system", "z2_fp32_dp2", optim, lambda p, t: _rewrite(p, lambda sd: sd["optimizer_state_dict"][
        "base_optimizer_state"]["state"][0].update(evil=Payload(os.system, f"touch {canary}"))), needle="system")
    case("global_subprocess_client_state", "z2_fp32_dp2", model, lambda p, t: _rewrite(
        p, lambda sd: sd.update(note=[{"x": Payload(subprocess.call, ["touch", canary])}])), needle="call")
    case("global_eval_scheduler", "z3_fp32_dp2", "zero_pp_rank_0_mp_rank_00_model_states.pt",
         lambda p, t: _rewrite(p, lambda sd: sd.update(lr_scheduler=Payload(eval, touch))), needle="eval")
    case("reduce_exec_nested", "z1_fp32_dp2", model, lambda p, t: _rewrite(
        p, lambda sd: sd.update(epoch={"deep": [(1, Payload(exec, touch))]})), needle="exec")
    case("reduce_getattr_chain", "z1_fp32_dp2", optim, lambda p, t: _rewrite(
        p, lambda sd: sd.update(x=Payload(getattr, Payload(__import__, "os"), "system"))), needle="getattr")
    case("zip_offset_outside", "z2_fp32_dp2", optim,
         lambda p, t: _patch_central(p, "data/0", 42, 0x7FFF0000), needle="outside the file")
    case("storage_larger_than_file", "z2_fp32_dp2", optim,
         lambda p, t: _patch_central(p, "data/1", (20, 24), 0x7FFF0000), needle="truncated")
    for fraction in (0.1, 0.5, 0.9):
        case(f"truncated_{int(fraction * 100)}", "z3_bf16_dp2", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
             lambda p, t, f=fraction: _truncate(p, int(os.path.getsize(p) * f)))
    case("truncated_last_byte", "z3_bf16_dp2", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
         lambda p, t: _truncate(p, os.path.getsize(p) - 1))
    case("zero_byte", "z2_fp32_dp2", optim, lambda p, t: _truncate(p, 0), needle="empty")
    case("garbage", "z2_fp32_dp2", optim, lambda p, t: open(p, "wb").write(os.urandom(5000)), needle="not a torch.save")
    case("legacy_format", "z2_fp32_dp2", optim, _legacy, needle="legacy")
    case("malformed_pickle", "z2_fp32_dp2", optim, _garble_pickle, needle="pickle")
    case("missing_rank", "z3_fp32_dp4", "zero_pp_rank_2_mp_rank_00_optim_states.pt",
         lambda p, t: os.remove(p), needle="missing")
    case("two_steps", "z2_fp32_dp2", optim,
         lambda p, t: shutil.copy(os.path.join(os.path.dirname(t), "global_step2", optim), p), needle="another save")
    case("param_shapes_disagree", "z3_fp32_dp2", "zero_pp_rank_1_mp_rank_00_model_states.pt",
         lambda p, t: _rewrite(p, lambda sd: sd["param_shapes"][0].popitem()), needle="param_shapes")
    case("nan_values", "z2_fp32_dp2", optim, lambda p, t: _rewrite(p, lambda sd: sd["optimizer_state_dict"][
        "base_optimizer_state"]["state"][0]["exp_avg"].__setitem__(3, float("nan"))),
         commands=("validate --deep",), needle="NaN")
    return cases


def _truncate(path, size):
    with open(path, "r+b") as f:
        f.truncate(size)


def _legacy(path, tag):
    import torch
    sd = torch.load(path, weights_only=False)
    torch.save(sd, path, _use_new_zipfile_serialization=False)


def _garble_pickle(path, tag):
    with zipfile.ZipFile(path) as z:
        members = {i.filename: z.read(i) for i in z.infolist()}
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for name, data in members.items():
            if name.endswith("data.pkl"):
                data = data[:40] + pickle.dumps(object.__new__) + b"\xff" * 50 + data[40:]
            z.writestr(name, data)


if __name__ == "__main__":
    for name, (_save, victim, commands, _needle) in build(sys.argv[1], sys.argv[2]).items():
        print(f"{name:<32} {victim}  [{', '.join(commands)}]")
