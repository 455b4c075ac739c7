"""Safe, metadata-only reading of `torch.save` zip files.

A torch.save file is a zip archive (members stored, not compressed) holding `data.pkl`, the
pickled object tree, and one member per storage with its raw bytes. We unpickle `data.pkl` with
an allow-list: every global the pickle names is looked up in `ALLOWED`, never imported, so a
checkpoint cannot run code. Tensors come back as `TensorRef`s that say where their bytes are
(file, byte offset, dtype, shape, strides); the bytes themselves are not read.

torch itself is not imported here: opening a checkpoint to inspect it costs no torch start-up.
"""
from __future__ import annotations

import collections
import io
import math
import os
import pickle
import struct
import zipfile
import zlib
from dataclasses import dataclass, field

from reshard.core.dtypes import STORAGE_DTYPES
from reshard.core.storage_ref import StorageRef
from reshard.errors import CheckpointError, UnsafeCheckpointError
from reshard.formats import zip_directory
from reshard.storage import files as fs


@dataclass
class TensorRef:
    """A tensor as torch.save described it: a strided view into a storage."""
    storage: StorageRef
    storage_offset: int          # in elements
    shape: tuple
    stride: tuple
    requires_grad: bool = False
    attrs: dict = field(default_factory=dict)   # Python attributes pickled with it (ZeRO-3 ds_id)
    parameter: bool = False      # pickled as a torch.nn.Parameter (_rebuild_parameter): written back as one

    @property
    def dtype(self) -> str:
        return self.storage.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def is_contiguous(self) -> bool:
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.stride), strict=True):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True

    def __repr__(self) -> str:
        return (f"TensorRef({self.dtype}{list(self.shape)} @ "
                f"{os.path.basename(self.storage.file)}+{self.storage.offset})")


@dataclass(frozen=True)
class _StorageType:
    """What `torch.FloatStorage` & co. unpickle to: only the element type matters."""
    dtype: str


@dataclass(frozen=True)
class DType:
    """What `torch.float16` & co. unpickle to."""
    name: str

    def __repr__(self) -> str:
        return f"torch.{self.name}"


class _TensorClass:
    """Stand-in for `torch.Tensor` / `torch.nn.Parameter` passed to _rebuild_from_type_v2."""


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad=False,
                       backward_hooks=None, metadata=None):
    return TensorRef(storage, int(storage_offset), tuple(size), tuple(stride), bool(requires_grad))


def _rebuild_from_type_v2(func, new_type, args, state):
    ref = func(*args)
    if isinstance(ref, TensorRef) and isinstance(state, dict):
        ref.attrs.update(state)
    return ref


def _rebuild_parameter(data, requires_grad, backward_hooks, *state):
    if isinstance(data, TensorRef):
        data.requires_grad = bool(requires_grad)
    return data


def _rebuild_plain_parameter(data, requires_grad, backward_hooks):
    data = _rebuild_parameter(data, requires_grad, backward_hooks)
    if isinstance(data, TensorRef):
        data.parameter = True
    return data


def _codecs_encode(text, encoding="latin1"):
    # Protocol-2 pickles spell `bytes` objects as _codecs.encode(str, "latin1").
    if encoding not in ("latin1", "latin-1"):
        raise pickle.UnpicklingError(f"_codecs.encode with encoding {encoding!r}")
    return text.encode("latin1")


class Size(tuple):
    """What `torch.Size` unpickles to: a tuple that, like torch.Size, knows its element count."""

    def numel(self) -> int:
        return math.prod(self)


def _size(dims=()):
    return Size(dims)


# torch's own globals: what any torch.save file may name. A format whose pickles name more (DeepSpeed's classes,
# Megatron's args) reads with its own superset (formats/deepspeed/pickles.py, formats/megatron/pickles.py)
ALLOWED = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    ("torch._utils", "_rebuild_parameter"): _rebuild_plain_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type_v2,
    ("torch", "Tensor"): _TensorClass,
    ("torch.nn.parameter", "Parameter"): _TensorClass,
    ("torch", "Size"): _size,
    ("_codecs", "encode"): _codecs_encode,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "slice"): slice,
    ("builtins", "complex"): complex,
}
ALLOWED.update({("torch", cls): _StorageType(dt) for cls, dt in STORAGE_DTYPES.items()})
ALLOWED.update({("torch", dt): DType(dt) for dt in set(STORAGE_DTYPES.values())})
ALLOWED.update({("torch", alias): DType(dt) for alias, dt in
                {"float": "float32", "half": "float16", "double": "float64", "long": "int64",
                 "int": "int32", "short": "int16"}.items()})


class AllowListUnpickler(pickle.Unpickler):
    """Unpickles only the globals in `allowed` ((module, name) -> object); any other is refused, never imported."""

    def __init__(self, data: bytes, path: str, allowed: dict):
        super().__init__(io.BytesIO(data))
        self._path = path
        self._allowed = allowed

    def find_class(self, module, name):
        try:
            return self._allowed[(module, name)]
        except KeyError:
            raise UnsafeCheckpointError(self._path, f"refusing to unpickle global {module}.{name} "
                                        "(not on reshard's allow-list; nothing was executed)") from None


class _SafeUnpickler(AllowListUnpickler):
    def __init__(self, data: bytes, path: str, storages: dict, allowed: dict | None = None):
        super().__init__(data, path, ALLOWED if allowed is None else allowed)
        self._storages = storages

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                and isinstance(pid[1], _StorageType)):
            raise CheckpointError(self._path, f"unexpected persistent id {pid!r:.80}")
        _, stype, key, _location, numel = pid
        raw = self._storages.get(str(key))
        if raw is None:
            raise CheckpointError(self._path, f"pickle names storage {key!r}, which is not in the archive")
        storage = StorageRef(raw.file, raw.offset, raw.nbytes, stype.dtype, raw.member, raw.crc)
        if storage.numel < numel:
            raise CheckpointError(self._path, f"storage {key} holds {storage.numel} elements, "
                                  f"the pickle expects {numel}")
        return storage


_LOCAL_HEADER = struct.Struct("<4s2B4HL2L2H")   # zip local file header, 30 bytes
_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C


def load(path: str, span: tuple | None = None, allowed: dict | None = None) -> object:
    """Unpickle a torch.save file safely; tensors become TensorRefs into `path`.

    `span` = (offset, length) reads a torch.save archive embedded in a larger file (a DCP
    `.distcp` chunk): the zip is parsed in place and storages are located by absolute offset.
    `allowed`: the allow-list to unpickle with, when a format's pickles name more than ALLOWED (a superset of
    it, built by that format from inert stand-ins); None: ALLOWED.
    """
    path = os.fspath(path)
    try:
        size = fs.getsize(path)
    except OSError as e:
        raise CheckpointError(path, f"cannot read: {e.strerror}") from None
    base = 0
    if span is not None:
        base, length = span
        if base < 0 or length <= 0 or base + length > size:
            raise CheckpointError(path, f"truncated: bytes [{base}, {base + length}) lie outside the file "
                                  f"of {size} bytes")
        size = length
    if size == 0:
        raise CheckpointError(path, "file is empty (0 bytes)")
    try:
        # no read-ahead past the few headers read here: the metadata of a checkpoint (inspect, validate, a plan) is
        # a few KiB per file, and the kernel would read up to read_ahead_kb (8 MiB) of each
        with fs.open(path, "rb", random_access=True) as raw:
            f = _Span(raw, base, size)
            infos = zip_directory.members(f.tail, size)
            if infos is None or any(i.compress_type != zipfile.ZIP_STORED for i in infos):
                infos = _zipfile_members(f, path, size)
            pkl = [i for i in infos if i.filename.endswith("data.pkl") and i.filename.count("/") == 1]
            if len(pkl) != 1:
                raise CheckpointError(path, "zip archive is not a torch.save file (no data.pkl)")
            prefix = pkl[0].filename[: -len("data.pkl")]
            storages = _locate_storages(f, path, size, prefix, infos, base)
            data = _checked_read(f, pkl[0], path, size)
    except CheckpointError:
        raise
    except Exception as e:  # zipfile fails in many ways on damaged archives; all mean the same here
        where = "" if span is None else f" at byte {base}"
        raise CheckpointError(path, f"damaged zip archive{where} ({type(e).__name__}: {e})") from None
    try:
        return _SafeUnpickler(data, path, storages, allowed).load()
    except CheckpointError:
        raise
    except Exception as e:  # a malformed pickle: report, never propagate a traceback
        raise CheckpointError(path, f"malformed pickle in data.pkl ({type(e).__name__}: {e})") from None


class _Span(io.RawIOBase):
    """Bytes [base, base + size) of an open file, seen as a whole file (for zipfile), its head and tail read once.

    A torch.save archive's local headers and `data.pkl` lie in its first few KiB, its directory in its last:
    reading them once each, up front, is two reads of the file per archive, where the many small seeks and reads
    cost most of the time (a DCP `.metadata` of a large Megatron save names ~18,000 such archives)."""

    _EDGE = 4096

    def __init__(self, raw, base: int, size: int):
        super().__init__()
        self._raw, self._base, self._size, self._pos = raw, base, size, 0
        raw.seek(base)
        self._edges = [(0, raw.read(min(size, self._EDGE)))]

    def tail(self, n: int) -> bytes:
        """The last `n` bytes, kept for later reads."""
        start = max(0, self._size - n)
        self._raw.seek(self._base + start)
        data = self._raw.read(self._size - start)
        self._edges.append((start, data))
        return data

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        self._pos = max(0, {0: 0, 1: self._pos, 2: self._size}[whence] + pos)
        return self._pos

    def read(self, n: int = -1) -> bytes:
        n = self._size - self._pos if n is None or n < 0 else min(n, max(0, self._size - self._pos))
        for start, data in self._edges:
            if start <= self._pos and self._pos + n <= start + len(data):
                self._pos += n
                return data[self._pos - n - start:self._pos - start]
        self._raw.seek(self._base + self._pos)
        data = self._raw.read(n)
        self._pos += len(data)
        return data

    def readinto(self, buffer) -> int:
        data = self.read(len(buffer))
        buffer[:len(data)] = data
        return len(data)


def _zipfile_members(f, path: str, size: int) -> list:
    """The members of an archive zip_directory does not read (a comment, a compressed member): zipfile's reading,
    a compressed `data.pkl` (which torch.save never writes) read whole into a stored stand-in."""
    f.seek(0)
    head = f.read(64)
    if not zipfile.is_zipfile(f):
        raise CheckpointError(path, _not_zip_reason(head, size))
    f.seek(0)
    with zipfile.ZipFile(f) as zf:
        infos = zf.infolist()
        return [_Inflated(i.filename, zf.read(i)) if i.filename.endswith("data.pkl") and
                i.compress_type != zipfile.ZIP_STORED else i for i in infos]


@dataclass(frozen=True)
class _Inflated:
    """A compressed member, read (and CRC-checked) by zipfile."""
    filename: str
    data: bytes
    compress_type: int = zipfile.ZIP_STORED


def _checked_read(f, info, path: str, size: int) -> bytes:
    """A whole member, its CRC-32 checked and named in the message (zipfile's own check names neither the file
    nor the values; it still checks a compressed member, which torch.save never writes)."""
    if isinstance(info, _Inflated):
        return info.data
    f.seek(_data_offset(f, path, size, info, info.filename))
    data = f.read(info.file_size)
    read = zlib.crc32(data)
    if len(data) != info.file_size or read != info.CRC:
        raise CheckpointError(path, f"member {info.filename}: CRC-32 mismatch (stored 0x{info.CRC:08x}, read "
                                    f"0x{read:08x}): the file is corrupt")
    return data


def _data_offset(f, path: str, size: int, info, what: str) -> int:
    """Where a stored member's bytes start, from its local header (the central directory does not say)."""
    f.seek(info.header_offset)
    header = f.read(_LOCAL_HEADER.size)
    if len(header) < _LOCAL_HEADER.size or header[:4] != b"PK\x03\x04":
        raise CheckpointError(path, f"zip entry for {what} points outside the file or at garbage")
    fields = _LOCAL_HEADER.unpack(header)
    name_len, extra_len = fields[-2], fields[-1]
    offset = info.header_offset + _LOCAL_HEADER.size + name_len + extra_len
    if offset + info.file_size > size:
        raise CheckpointError(path, f"truncated: {what} ends at byte {offset + info.file_size} "
                              f"but the file has {size}")
    return offset


def _locate_storages(f, path, size, prefix, infos, base: int = 0) -> dict:
    """Map storage key -> byte range of the member's data in the file.

    The element type is only known once the pickle names the storage's class (persistent_load).
    """
    located = {}
    data_prefix = prefix + "data/"
    for info in infos:
        if not info.filename.startswith(data_prefix):
            continue
        key = info.filename[len(data_prefix):]
        if info.compress_type != zipfile.ZIP_STORED:
            raise CheckpointError(path, f"storage {key} is compressed; torch.save never does that")
        offset = _data_offset(f, path, size, info, f"storage {key}")
        member = info.filename if base == 0 else f"{info.filename} of the archive at byte {base}"
        located[key] = _RawBytes(path, base + offset, info.file_size, member, info.CRC)
    return located


@dataclass(frozen=True)
class _RawBytes:
    file: str
    offset: int
    nbytes: int
    member: str
    crc: int


def _not_zip_reason(head: bytes, size: int) -> str:
    if head[:2] == b"\x80\x02" and _looks_legacy(head):
        return ("legacy (non-zip) torch serialization is not supported; re-save with torch.save's default "
                "zip format (DeepSpeed: remove \"checkpoint_serialization\": false)")
    if head[:2] == b"PK":
        return f"truncated or damaged zip archive ({size} bytes, no central directory)"
    return "not a torch.save zip file"


def _looks_legacy(head: bytes) -> bool:
    # Legacy files start with the pickled magic number 0x1950a86a20f9469cfc6c (a LONG1).
    return _LEGACY_MAGIC.to_bytes(10, "little") in head
