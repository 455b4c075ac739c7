"""DCP's `.metadata` pickle: inert stand-ins for its dataclasses, a safe reader, a by-name writer.

torch.distributed.checkpoint pickles a `Metadata` object with plain `pickle.dump`, and its own
`FileSystemReader` loads it with plain `pickle.load`. We read it with an allow-list: the DCP
metadata dataclasses, torch dtypes, layout and memory-format encodings, `torch.Size`, paths and
builtins become the plain classes below; any other global is refused (nothing runs). The same
classes are pickled back under DCP's own global names, so torch loads our `.metadata` as its own
without reshard importing torch.distributed.checkpoint.
"""
from __future__ import annotations

import collections
import enum
import io
import pickle
from typing import Any, TypeGuard

from reshard.errors import CheckpointError
from reshard.formats.torchsave_read import ALLOWED as TORCH_ALLOWED, AllowListUnpickler, DType, Size
from reshard.formats.torchsave_write import NEWOBJ, GlobalName, TreePickler
from reshard.storage import files as fs

_MD = "torch.distributed.checkpoint.metadata"
_FS = "torch.distributed.checkpoint.filesystem"


class _Record:
    """A dataclass restored from NEWOBJ + BUILD (a dict state): only its attributes."""

    FIELDS: tuple = ()

    def __init__(self, *args, **kwargs):
        for name, value in zip(self.FIELDS, args, strict=False):    # a pickle may give fewer args than fields
            setattr(self, name, value)
        for name, value in kwargs.items():
            setattr(self, name, value)

    def __setstate__(self, state):
        if isinstance(state, tuple) and len(state) == 2 and state[0] is None:   # (None, slots)
            state = state[1]
        if not isinstance(state, dict):
            raise pickle.UnpicklingError(f"{type(self).__name__} with state {type(state).__name__}")
        self.__dict__.update(state)

    def __getstate__(self):
        return dict(self.__dict__)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.__dict__.items())})"

    def __eq__(self, other):
        return type(self) is type(other) and self.__dict__ == other.__dict__


class Metadata(_Record):
    FIELDS = ("state_dict_metadata", "planner_data", "storage_data", "storage_meta", "version")
    # (annotations only, no class attributes: a pickle sets what it has; read() checks the types)
    state_dict_metadata: dict[str, Any]
    planner_data: Any
    storage_data: dict[Any, Any]


class TensorStorageMetadata(_Record):
    FIELDS = ("properties", "size", "chunks")
    properties: TensorProperties
    size: Size
    chunks: list[ChunkStorageMetadata]


class BytesStorageMetadata(_Record):
    pass


class ChunkStorageMetadata(_Record):
    FIELDS = ("offsets", "sizes")


class StorageMeta(_Record):
    FIELDS = ("checkpoint_id", "save_id", "load_id", "modules")


class MetadataIndex(_Record):
    FIELDS = ("fqn", "offset", "index")
    fqn: str
    offset: Any

    def __hash__(self):        # DCP hashes (fqn, offset); the index is only a hint
        return hash((self.fqn, getattr(self, "offset", None)))

    def __eq__(self, other):
        return (type(other) is MetadataIndex and self.fqn == other.fqn
                and getattr(self, "offset", None) == getattr(other, "offset", None))


class StorageInfo(_Record):
    """DCP's `_StorageInfo`: where one item's bytes are (file relative to the checkpoint, range)."""
    FIELDS = ("relative_path", "offset", "length")

    def __getstate__(self):    # as DCP does: None fields are left out
        return {k: v for k, v in self.__dict__.items() if v is not None}


class MemFormat(enum.Enum):
    """DCP's `_MEM_FORMAT_ENCODING`."""
    TORCH_CONTIGUOUS_FORMAT = 0
    TORCH_CHANNELS_LAST = 1
    TORCH_PRESERVE_FORMAT = 2


class TensorProperties(_Record):
    """Pickled by DCP as a tuple (dtype, layout, requires_grad, memory format encoding, pin_memory)."""
    FIELDS = ("dtype", "layout", "requires_grad", "memory_format", "pin_memory")

    def __setstate__(self, state):
        if not (isinstance(state, tuple) and len(state) == 5):
            raise pickle.UnpicklingError("TensorProperties state is not a 5-tuple")
        self.dtype, self.layout, self.requires_grad, self.memory_format, self.pin_memory = state

    def __getstate__(self):
        return (self.dtype, self.layout, self.requires_grad, self.memory_format, self.pin_memory)


class Layout(str):
    """What `torch.serialization._get_layout("torch.strided")` unpickles to: the layout's name."""


def _get_layout(name):
    if not isinstance(name, str):
        raise pickle.UnpicklingError("_get_layout of a non-string")
    return Layout(name)


def _path(*parts):
    if not all(isinstance(p, str) for p in parts):
        raise pickle.UnpicklingError("a path built from non-strings")
    return "/".join(parts)


GLOBAL_NAMES = {
    Metadata: (_MD, "Metadata"),
    TensorStorageMetadata: (_MD, "TensorStorageMetadata"),
    BytesStorageMetadata: (_MD, "BytesStorageMetadata"),
    ChunkStorageMetadata: (_MD, "ChunkStorageMetadata"),
    TensorProperties: (_MD, "TensorProperties"),
    MetadataIndex: (_MD, "MetadataIndex"),
    StorageMeta: (_MD, "StorageMeta"),
    MemFormat: (_MD, "_MEM_FORMAT_ENCODING"),
    StorageInfo: (_FS, "_StorageInfo"),
}
ALLOWED: dict[tuple[str, str], object] = {name: cls for cls, name in GLOBAL_NAMES.items()}
ALLOWED.update({
    ("torch.serialization", "_get_layout"): _get_layout,
    ("pathlib", "PosixPath"): _path, ("pathlib._local", "PosixPath"): _path,
    ("pathlib", "PurePosixPath"): _path,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch", "Size"): TORCH_ALLOWED[("torch", "Size")],
    ("builtins", "set"): set, ("builtins", "frozenset"): frozenset,
})
ALLOWED.update({key: value for key, value in TORCH_ALLOWED.items() if isinstance(value, DType)})


class _Unpickler(AllowListUnpickler):
    def __init__(self, data: bytes, path: str, allowed: dict):
        super().__init__(data, path, allowed)

    def persistent_load(self, pid):
        raise CheckpointError(self._path, "a persistent id in DCP metadata")


def read(path: str, allowed: dict | None = None) -> Metadata:
    """The `.metadata` file at `path`, unpickled through the allow-list (`allowed`: a format's superset of ALLOWED,
    for a `.metadata` that pickles more than DCP's own classes)."""
    try:
        with fs.open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise CheckpointError(path, f"cannot read: {e.strerror}") from None
    if not data:
        raise CheckpointError(path, "file is empty (0 bytes)")
    try:
        md = _Unpickler(data, path, ALLOWED if allowed is None else allowed).load()
    except CheckpointError:
        raise
    except Exception as e:  # garbage or a damaged pickle: one line, never a traceback
        raise CheckpointError(path, f"not a DCP metadata pickle ({type(e).__name__}: {str(e)[:80]})") from None
    if not isinstance(md, Metadata):
        raise CheckpointError(path, f"not a DCP Metadata object (found {type(md).__name__})")
    problem = _malformed(md)
    if problem:
        raise CheckpointError(path, f"malformed DCP metadata: {problem}")
    return md


def _ints(value, length=None) -> TypeGuard[tuple[int, ...]]:
    return isinstance(value, tuple) and all(type(v) is int and v >= 0 for v in value) \
        and (length is None or len(value) == length)


def _malformed(md: Metadata) -> str | None:
    """What makes `md` unusable, checked once here so readers can trust its shape."""
    entries, storage = getattr(md, "state_dict_metadata", None), getattr(md, "storage_data", None)
    if not isinstance(entries, dict) or not isinstance(storage, dict):
        return "state_dict_metadata and storage_data must be dicts"
    if not isinstance(getattr(md, "planner_data", None), (dict, type(None))):
        return "planner_data is not a dict"
    for key, entry in entries.items():
        if not isinstance(key, str):
            return f"a key that is not a string: {key!r:.60}"
        if isinstance(entry, BytesStorageMetadata):
            continue
        if not isinstance(entry, TensorStorageMetadata):
            return f"{key}: unknown storage metadata {type(entry).__name__}"
        props, size, chunks = (getattr(entry, f, None) for f in ("properties", "size", "chunks"))
        if not isinstance(props, TensorProperties) or not isinstance(getattr(props, "dtype", None), DType):
            return f"{key}: no dtype in its tensor properties"
        if not _ints(size) or not isinstance(chunks, list):
            return f"{key}: a size or chunk list of the wrong type"
        for chunk in chunks:
            if not isinstance(chunk, ChunkStorageMetadata) or not _ints(getattr(chunk, "offsets", None), len(size)) \
                    or not _ints(getattr(chunk, "sizes", None), len(size)):
                return f"{key}: a chunk whose offsets and sizes do not match the tensor's {len(size)} dimensions"
    for index, info in storage.items():
        if not isinstance(index, MetadataIndex) or not isinstance(getattr(index, "fqn", None), str) \
                or not (getattr(index, "offset", None) is None or _ints(index.offset)):
            return f"a storage index of the wrong type: {index!r:.80}"
        if not isinstance(info, StorageInfo) or not isinstance(getattr(info, "relative_path", None), str) \
                or not _ints((getattr(info, "offset", None), getattr(info, "length", None))):
            return f"{index.fqn}: a storage location of the wrong type: {info!r:.80}"
    return None


# exact builtin types, which neither reducer_override below nor TreePickler's reduces and persistent_id never names:
# pickle's own dispatch writes them
_BUILTINS = frozenset((str, int, float, bool, type(None), tuple, list, dict, bytes))
_RECORDS = frozenset(t for t in GLOBAL_NAMES if issubclass(t, _Record))     # (MemFormat, an enum, is reduced)


class MetadataPickler(TreePickler):
    """pickle_tree's pickler, plus the DCP classes written under DCP's names."""
    dispatch = TreePickler.dispatch.copy()

    def save(self, obj, save_persistent_id=True):
        """pickle._Pickler.save with a short path for the objects a large `.metadata` is made of (hundreds of
        thousands of builtins, records and sizes), writing the same bytes: the memo first; a builtin by pickle's own
        dispatch and a record by its reduction, as save does once persistent_id (None: no storages here) and
        reducer_override (NotImplemented for a builtin) have been asked; any other object reduced by
        reducer_override as save reduces it. At protocol 2 there are no frames to commit. Anything else: save."""
        x = self.memo.get(id(obj))
        if x is not None:
            self.write(self.get(x[0]))
            return
        t = type(obj)
        if t in _BUILTINS:
            self.dispatch[t](self, obj)
            return
        if t in _RECORDS:
            self.save_reduce(NEWOBJ, (t,), obj.__getstate__(), obj=obj)
            return
        if self.persistent_id(obj) is None:
            rv = self.reducer_override(obj)
            if type(rv) is tuple and 2 <= len(rv) <= 6:
                self.save_reduce(*rv, obj=obj)
                return
        super().save(obj, save_persistent_id)

    def memoize(self, obj):
        """pickle._Pickler.memoize less its assertion (save checks the memo first), as often as objects are saved."""
        if self.fast:
            return
        idx = len(self.memo)
        self.write(self.put(idx))
        self.memo[id(obj)] = idx, obj

    def reducer_override(self, obj):
        if isinstance(obj, Layout):
            return (GlobalName("torch.serialization", "_get_layout"), (str(obj),))
        if isinstance(obj, MemFormat):
            return (MemFormat, (obj.value,))
        if type(obj) in GLOBAL_NAMES:
            return (NEWOBJ, (type(obj),), obj.__getstate__())
        return super().reducer_override(obj)

    def save_global(self, obj, name=None):
        if isinstance(obj, type) and obj in GLOBAL_NAMES:
            self._write_global(GlobalName(*GLOBAL_NAMES[obj]))
            self.memoize(obj)
        else:
            super().save_global(obj, name)


def dumps(md: Metadata) -> bytes:
    """`.metadata` bytes for `md`, loadable by torch's own FileSystemReader."""
    buf = io.BytesIO()
    pickler = MetadataPickler(buf, protocol=2)     # memo on: each class name is spelled once
    # (protocol 2 writes no frames: the framer would only pass each write on; typeshed omits the attribute)
    pickler.write = buf.write  # type: ignore[method-assign,assignment]
    pickler.dump(md)
    return buf.getvalue()


def tensor_properties(dtype: str) -> TensorProperties:
    return TensorProperties(DType(dtype), Layout("torch.strided"), False, MemFormat(0), False)


__all__ = ["Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
           "TensorProperties", "MetadataIndex", "StorageMeta", "StorageInfo", "read", "dumps", "Size"]
