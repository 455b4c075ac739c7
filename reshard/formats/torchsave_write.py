"""Writing files that `torch.load` reads, without torch and without holding tensor bytes.

A file is described as an object tree whose tensors are `NewTensor` slots. `pickle_tree` turns
the tree into `data.pkl` bytes (protocol 2, as torch.save writes): slots become torch's
`_rebuild_tensor_v2` over a persistent storage id, the DeepSpeed stand-ins are written under
DeepSpeed's own global names, so DeepSpeed loads them as its own classes. A tensor the tree carries
from a source pickle (a `TensorRef` in client state: Lightning's `ModelCheckpoint.kth_value`) is
written as torch wrote it, over a storage of the new file holding a copy of the source storage; no
global of reshard's own is ever written (the file must load where reshard is not installed).
`TorchZip` (the container) then lays out the zip archive with 64-byte-aligned storage members that the caller
streams in.
"""
from __future__ import annotations

import collections
import copyreg
import enum
import hashlib
import io
import os
import pickle
import struct
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, BinaryIO, ClassVar

from reshard.core.dtypes import STORAGE_DTYPES
from reshard.core.storage_ref import StorageRef
from reshard.core.write_requests import NewTensor, Piece, RawPiece, TensorFile
from reshard.execution.checksums import crc32
from reshard.formats.deepspeed import standins
from reshard.formats.torchsave_read import DType, Size, TensorRef

STORAGE_CLASS = {dtype: name for name, dtype in STORAGE_DTYPES.items()}
ALIGNMENT = 64            # torch.save's storage alignment (mmap-able)
# zipfile takes the CRC-32 of every member written with its module's `crc32` (zlib's; not in its type stubs): 13% of a
# conversion's CPU on tmpfs. ISA-L's (reshard.execution.checksums) gives the same values about 10 times as fast; with it
# zipfile's output is unchanged, for reshard's archives and any other this process writes (tests/test_crc.py).
zipfile.crc32 = crc32     # type: ignore[attr-defined]
_FIXED_TIME = (1980, 1, 1, 0, 0, 0)   # reproducible archives


@dataclass(frozen=True)
class TorchFile(TensorFile):
    """A torch.save file: the pickled `tree` (with NewTensor slots) as data.pkl.

    Source tensors in the tree (TensorRefs of carried state) get their storages when the header is made
    (`carry`), before the planner lists the slots."""
    archive: str = "archive"                     # the zip's top folder (torch uses the file stem)
    carried: dict = field(default_factory=dict, repr=False)   # source StorageRef -> the slot copying it
    STEM, EXTENSION, SUFFIXES = "pytorch_model", "bin", (".bin", ".pt", ".pth")   # Hugging Face's names

    @classmethod
    def from_entries(cls, path, entries, aliases, metadata=None) -> TorchFile:
        """A state dict file: one tensor per entry (NewTensor with a `source`); a tied name is the
        same tensor as its source, as in torch."""
        file = cls(path, archive=os.path.splitext(os.path.basename(path))[0])
        tree = collections.OrderedDict()
        for e in entries:
            tree[e.key] = file.slot(e.dtype, e.shape, [Piece(e.numel, e.source, e.start, shard=e.shard)])
        for alias, source in aliases.items():
            if source in tree:
                tree[alias] = tree[source]
        file = file.with_tree(tree)
        return file

    def holds(self, name: str) -> bool:
        return name in self.tree

    def header(self) -> bytes:
        return pickle_tree(self.tree, self.carry)

    def carry(self, storage: StorageRef) -> NewTensor:
        """The slot of this file holding a source storage's bytes, whole (views of it keep their offsets and
        strides); one slot per storage, so tensors sharing a storage in the source share it here."""
        slot = self.carried.get(storage)
        if slot is None:
            pieces = [RawPiece(storage)] if storage.numel else []
            slot = self.carried[storage] = self.slot(storage.dtype, (storage.numel,), pieces)
        return slot

    def container(self) -> TorchZip:
        return TorchZip(self.archive)


@dataclass(frozen=True)
class GlobalName:
    """A global spelled by name; the pickler writes it without importing anything."""
    module: str
    name: str

    def __call__(self, *args):  # pickle insists a reduce function be callable; this one never runs
        raise TypeError(f"{self.module}.{self.name} is only a name to pickle")


@dataclass(frozen=True)
class PickledAs:
    """How a format's stand-in is pickled back (its class's `pickled_as(self)` gives this): a call of the global it
    stands for with `args`, then `state` set on the result (BUILD) unless None: argparse.Namespace() and its
    attributes, an enum's class called with the member's value. With `new`, the global is a class made as pickle
    makes an instance of it (NEWOBJ: `cls.__new__(cls, *args)`, no __init__ run), as a dataclass or NamedTuple of
    the framework is written. A PickledAs in a tree is written as what it describes (a writer spelling a framework's
    object it has no stand-in of: verl's DTensors)."""
    glob: GlobalName
    args: tuple = ()
    state: object = None
    new: bool = False


_REBUILD = GlobalName("torch._utils", "_rebuild_tensor_v2")
_REBUILD_FROM_TYPE = GlobalName("torch._tensor", "_rebuild_from_type_v2")
_REBUILD_PARAMETER = GlobalName("torch._utils", "_rebuild_parameter")
_TENSOR = GlobalName("torch", "Tensor")
_SIZE = GlobalName("torch", "Size")


@dataclass(frozen=True)
class _StorageId:
    key: str
    dtype: str
    numel: int


# copyreg's reconstructor of an object made by cls.__new__, which pickle writes as NEWOBJ (typeshed omits it)
NEWOBJ = copyreg.__newobj__  # type: ignore[attr-defined]

if TYPE_CHECKING:
    class PurePickler(pickle._Pickler):
        """pickle._Pickler's internals the picklers here extend, which typeshed does not declare."""
        dispatch: ClassVar[dict[type, Callable[[Any, Any], None]]]  # type: ignore[assignment]
        memo: dict[int, tuple[int, object]]

        def write(self, data: bytes) -> None: ...
        def save(self, obj: object, save_persistent_id: bool = True) -> None: ...
        def save_global(self, obj: object, name: str | None = None) -> None: ...
        def save_reduce(self, func: object, args: tuple[Any, ...], state: object = None, listitems: object = None,
                        dictitems: object = None, state_setter: object = None, *, obj: object = None) -> None: ...
        def memoize(self, obj: object) -> None: ...
        def put(self, idx: int) -> bytes: ...
        def get(self, i: int) -> bytes: ...
else:
    PurePickler = pickle._Pickler


class TreePickler(PurePickler):
    """Pure-Python pickler (metadata is small) whose globals are written by name, never imported."""
    dispatch = PurePickler.dispatch.copy()

    def __init__(self, file, protocol=2, carry=None):
        super().__init__(file, protocol=protocol)
        self._carry = carry         # source StorageRef -> NewTensor slot holding its bytes (TorchFile.carry)

    def persistent_id(self, obj):
        if isinstance(obj, _StorageId):
            return ("storage", GlobalName("torch", STORAGE_CLASS[obj.dtype]), obj.key, "cpu", obj.numel)
        return None

    def reducer_override(self, obj):
        if isinstance(obj, NewTensor):
            stride, step = [], 1
            for s in reversed(obj.shape):
                stride.append(step)
                step *= s
            args: tuple[object, ...] = (_StorageId(obj.key, obj.dtype, obj.numel), 0, tuple(obj.shape),
                                        tuple(reversed(stride)),
                    False, collections.OrderedDict())
            return (_REBUILD, args)
        if isinstance(obj, TensorRef):
            return self._source_tensor(obj)
        if isinstance(obj, Size):
            return (_SIZE, (tuple(obj),))
        if isinstance(obj, DType):
            return obj.name                      # -> save_global(obj, name)
        if isinstance(obj, enum.Enum) and type(obj) in standins.GLOBAL_NAMES:
            return (type(obj), (int(obj.value),))
        if type(obj) in standins.GLOBAL_NAMES:
            return (NEWOBJ, (type(obj),), dict(vars(obj)))
        pickled_as = getattr(type(obj), "pickled_as", None)
        if callable(pickled_as):     # a format's stand-in (PickledAs) for an object of the framework that saved it
            spelled = pickled_as(obj)
            return (spelled.glob, spelled.args) if spelled.state is None else \
                (spelled.glob, spelled.args, spelled.state)
        return NotImplemented

    def _source_tensor(self, ref: TensorRef):
        """A source tensor as torch pickles it: _rebuild_tensor_v2 over its storage (copied into this file),
        wrapped in _rebuild_from_type_v2 when it carried Python attributes, in _rebuild_parameter when it was a
        Parameter (as torch does)."""
        if self._carry is None:
            raise TypeError(f"{ref!r}: this file has no storages for a source tensor")
        if ref.parameter:
            return (_REBUILD_PARAMETER, (replace(ref, parameter=False), ref.requires_grad, collections.OrderedDict()))
        slot = self._carry(ref.storage)
        args: tuple = (_StorageId(slot.key, slot.dtype, slot.numel), ref.storage_offset, tuple(ref.shape),
                       tuple(ref.stride), ref.requires_grad, collections.OrderedDict())
        if ref.attrs:
            return (_REBUILD_FROM_TYPE, (_REBUILD, _TENSOR, args, dict(ref.attrs)))
        return (_REBUILD, args)

    def save_global(self, obj, name=None):
        if isinstance(obj, DType):
            glob = GlobalName("torch", obj.name)
        elif isinstance(obj, type) and obj in standins.GLOBAL_NAMES:
            glob = GlobalName(*standins.GLOBAL_NAMES[obj])
        elif (getattr(obj, "__module__", None) or "").split(".")[0] == "reshard":
            # a reader's object left in a tree: the consumer would need reshard to load the file
            raise TypeError(f"refusing to pickle reshard's own {obj.__module__}.{obj.__qualname__}")
        else:
            return super().save_global(obj, name)
        self._write_global(glob)
        self.memoize(obj)

    def _write_global(self, glob):
        self.write(pickle.GLOBAL + f"{glob.module}\n{glob.name}\n".encode())

    def _save_named_global(self, glob):
        self._write_global(glob)
        self.memoize(glob)

    dispatch[GlobalName] = _save_named_global

    def _save_pickled_as(self, obj: PickledAs) -> None:
        self.save(obj.glob)
        self.save(obj.args)
        self.write(pickle.NEWOBJ if obj.new else pickle.REDUCE)
        if obj.state is not None:
            self.save(obj.state)
            self.write(pickle.BUILD)

    dispatch[PickledAs] = _save_pickled_as


def pickle_tree(tree, carry=None) -> bytes:
    """`data.pkl` bytes for an object tree (dicts, lists, numbers, strings, NewTensor, stand-ins; TensorRefs
    given `carry`, which gives the slot that holds a source storage's bytes)."""
    buf = io.BytesIO()
    pickler = TreePickler(buf, protocol=2, carry=carry)
    # No memo: equal trees give equal bytes whatever objects they share (a tied tensor written
    # twice still names one storage, so it loads shared), and the output is reproducible.
    pickler.fast = True
    pickler.dump(tree)
    return buf.getvalue()


def load_tree(data_pkl: bytes, storage_of):
    """What `torch.load(weights_only=False)` of a file with this `data.pkl` gives, its storages taken by key
    from `storage_of` (key -> torch.UntypedStorage) instead of from the archive. For reshard's own data.pkl
    (pickle_tree) only: its globals are torch's and those the source checkpoint named, which the process
    loading it trusts as it trusts the checkpoint (DeepSpeed's loader unpickles the same names)."""
    import torch

    from reshard.core.dtypes import torch_dtype

    class Unpickler(pickle.Unpickler):
        def persistent_load(self, saved_id):
            _, storage_class, key, _location, _numel = saved_id
            # (by its name: torch warns on reading a legacy storage class's dtype)
            dtype = torch_dtype(STORAGE_DTYPES[storage_class.__name__])
            return torch.storage.TypedStorage(wrap_storage=storage_of(key), dtype=dtype, _internal=True)

    return Unpickler(io.BytesIO(data_pkl)).load()


@dataclass(frozen=True)
class TorchZip:
    """The torch.save zip container (reshard.core.container.Container). `archive`: the zip's top folder (torch.save
    names it after the file's stem; torch.load takes any)."""
    archive: str = "archive"
    name: ClassVar[str] = "torch"

    def file_size(self, data_pkl: bytes, storages) -> int:
        """Bytes of the archive on disk, as zipfile lays out the members __enter__ and __exit__ put: each
        one's local header (with its alignment padding and, for a large member, ZIP64 sizes), its data
        and data descriptor (the sink is not seekable), then the central directory and the end records."""
        members = [("data.pkl", len(data_pkl)), (".format_version", 1), (".storage_alignment", len(str(ALIGNMENT))),
                   ("byteorder", 6), *((f"data/{s.key}", s.nbytes) for s in storages), ("version", 2),
                   (".data/serialization_id", hashlib.sha1().digest_size * 2)]
        offset = directory = 0
        for name, nbytes in members:
            name_len = len(f"{self.archive}/{name}".encode())
            zip64 = _zip64(nbytes)
            header_end = offset + 30 + name_len + (20 if zip64 else 0)
            padding_field = 4 + (-(header_end + 4)) % ALIGNMENT
            # the central entry gets a ZIP64 field for sizes or an offset past the 32-bit limit
            large = 2 * (nbytes > zipfile.ZIP64_LIMIT) + (offset > zipfile.ZIP64_LIMIT)
            directory += 46 + name_len + padding_field + (4 + 8 * large if large else 0)
            offset = header_end + padding_field + nbytes + (24 if zip64 else 16)
        end = 22
        if len(members) > zipfile.ZIP_FILECOUNT_LIMIT or max(offset, directory) > zipfile.ZIP64_LIMIT:
            end += 56 + 20      # ZIP64 end of central directory record and its locator
        return offset + directory + end

    def writer(self, out: BinaryIO, data_pkl: bytes, storages) -> TorchZipWriter:
        return TorchZipWriter(out, data_pkl, self.archive)


class TorchZipWriter:
    """A torch.save zip archive written front to back into `out`: data.pkl, then each storage streamed in.

    Storage members are stored (uncompressed) with their data 64-byte aligned, as torch.save does,
    so `torch.load(mmap=True)` maps them in place. Use as a context manager; call `storage(key)`
    for each storage in the order given and write exactly its byte count into the returned stream.
    `out` is written front to back and never seeked (a stream that says it is not seekable gets each member's
    sizes in a data descriptor after it, which TorchZip.file_size counts).
    """

    def __init__(self, out: BinaryIO, data_pkl: bytes, archive: str = "archive"):
        self._sink = out
        self.archive = archive
        self.data_pkl = data_pkl
        self._zip: zipfile.ZipFile | None = None

    def __enter__(self):
        self._zip = zipfile.ZipFile(self._sink, "w", compression=zipfile.ZIP_STORED, allowZip64=True)
        self._put("data.pkl", self.data_pkl)
        self._put(".format_version", b"1")
        self._put(".storage_alignment", str(ALIGNMENT).encode())
        self._put("byteorder", b"little")
        return self

    def storage(self, key: str, nbytes: int):
        """A write stream for storage `key` (exactly `nbytes` must be written, then closed)."""
        return self._open().open(self._aligned_info(f"data/{key}", nbytes), "w", force_zip64=_zip64(nbytes))

    def __exit__(self, exc_type, *exc):
        if exc_type is None:
            self._put("version", b"3\n")
            digest = hashlib.sha1(self.data_pkl).hexdigest()
            self._put(".data/serialization_id", digest.encode())
        self._open().close()

    def _open(self) -> zipfile.ZipFile:
        if self._zip is None:
            raise RuntimeError("TorchZipWriter: write inside `with` (the archive opens in __enter__)")
        return self._zip

    def _put(self, name: str, data: bytes) -> None:
        with self._open().open(self._aligned_info(name, len(data)), "w") as f:
            f.write(data)

    def _aligned_info(self, name: str, nbytes: int) -> zipfile.ZipInfo:
        info = zipfile.ZipInfo(f"{self.archive}/{name}", date_time=_FIXED_TIME)
        info.compress_type = zipfile.ZIP_STORED
        info.file_size = nbytes
        zip64_extra = 20 if _zip64(nbytes) else 0
        header_end = self._sink.tell() + 30 + len(info.filename.encode()) + zip64_extra
        pad = (-(header_end + 4)) % ALIGNMENT
        info.extra = struct.pack("<HH", 0x4246, pad) + b"Z" * pad   # the padding field torch uses ("FB")
        return info


def _zip64(nbytes: int) -> bool:
    return nbytes * 1.05 > zipfile.ZIP64_LIMIT    # zipfile's own rule for a member of known size
