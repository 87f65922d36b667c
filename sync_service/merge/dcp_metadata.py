"""A torch.distributed.checkpoint ``.metadata`` file read without unpickling it.

DCP's ``FileSystemWriter.finish`` stores the checkpoint's ``Metadata`` in Python's pickle format (torch 2.13,
``torch/distributed/checkpoint/metadata.py`` and ``filesystem.py``). Loading that format runs whatever callables
the file names, so this module never loads it: ``pickletools.genops`` only lists the opcodes and a small stack machine
(``_OPS``) keeps only plain values — str, int, bool, None, tuples, lists, dicts — and what ``_GLOBALS`` lists:

- DCP's record classes: NEWOBJ (no arguments) makes an empty ``_Record`` that exactly one BUILD fills;
- ``torch.Size``, ``torch.serialization._get_layout`` (``torch.strided`` only), ``_MEM_FORMAT_ENCODING``,
  ``pathlib`` paths, ``collections.OrderedDict``: REDUCE applies this module's own converters to the arguments;
- ``torch.<dtype>``: the dtype object.

Any other GLOBAL, opcode or shape is refused (``MetadataError`` naming it). At STOP the records become torch's
own dataclasses through ``_SPECS`` — one row a record: its fields, the type each field must have, required or
not — and ``check_layout`` checks them against the directory: sizes and chunks (``offsets`` + ``sizes`` within
the tensor, one dim each, each element in one chunk), and every data file a plain name inside it, its byte
range within the file.

What torch 2.13 writes (``Metadata``): ``state_dict_metadata`` {fqn: ``TensorStorageMetadata(properties,
size, chunks)`` | ``BytesStorageMetadata()``}, ``planner_data`` {flat fqn: path tuple}, ``storage_data``
{``MetadataIndex(fqn, offset, index)``: ``_StorageInfo(relative_path, offset, length[, transform_descriptors])``},
``storage_meta`` ``StorageMeta(checkpoint_id, save_id, load_id, modules)``, ``version`` "1.0.0";
``TensorProperties`` pickles as the tuple (dtype, layout, requires_grad, memory-format code, pin_memory).
"""

from __future__ import annotations

import pathlib
import pickletools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.distributed.checkpoint import metadata as md
from torch.distributed.checkpoint.filesystem import _StorageInfo

__all__ = ["MetadataError", "check_layout", "parse_metadata"]

_UNSET = object()  # a record's state before its BUILD


class MetadataError(ValueError):
    """The bytes are not the DCP metadata ``dcp.save`` writes; the message names the opcode, global or field."""


@dataclass(slots=True, eq=False)  # eq=False: hashed by identity, so a record may key a dict (storage_data)
class _Record:
    kind: str
    state: object = _UNSET


@dataclass(frozen=True, slots=True)
class _Call:
    """A GLOBAL that REDUCE may apply: ``convert`` checks the arguments and builds the value itself."""

    name: str
    convert: Callable[..., object]


def _ints(name: str, dims: object) -> tuple[int, ...]:
    if not isinstance(dims, (tuple, list)) or not all(type(n) is int for n in dims):
        raise MetadataError(f"{name}({dims!r}): dims must be ints")
    return tuple(dims)


def _size(*args: object) -> torch.Size:
    return torch.Size(_ints("torch.Size", args[0] if len(args) == 1 else args))


def _layout(name: object) -> torch.layout:
    if name != "torch.strided":
        raise MetadataError(f"layout {name!r}: DCP metadata of dense tensors holds only 'torch.strided'")
    return torch.strided


def _memory_format(code: object) -> md._MEM_FORMAT_ENCODING:
    if type(code) is not int or code not in {e.value for e in md._MEM_FORMAT_ENCODING}:
        raise MetadataError(f"memory format code {code!r} is not one of torch's _MEM_FORMAT_ENCODING")
    return md._MEM_FORMAT_ENCODING(code)


def _path(kind: type[pathlib.PurePath]) -> Callable[..., pathlib.PurePath]:
    def convert(*parts: object) -> pathlib.PurePath:
        if not all(isinstance(p, str) for p in parts):
            raise MetadataError(f"{kind.__name__}{parts!r}: parts must be str")
        return kind(*parts)  # a pure path: a name, never touched on disk
    return convert


def _ordered_dict(*args: object) -> dict:
    if args:
        raise MetadataError(f"OrderedDict{args!r}: only the empty OrderedDict that SETITEMS fills")
    return {}


_RECORDS = ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
            "TensorProperties", "MetadataIndex", "StorageMeta")
_DCP = "torch.distributed.checkpoint.metadata"
_GLOBALS: dict[tuple[str, str], object] = {
    **{(_DCP, kind): kind for kind in _RECORDS},
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): "_StorageInfo",
    ("torch", "Size"): _Call("torch.Size", _size),
    ("torch.serialization", "_get_layout"): _Call("torch.serialization._get_layout", _layout),
    (_DCP, "_MEM_FORMAT_ENCODING"): _Call("_MEM_FORMAT_ENCODING", _memory_format),
    ("pathlib", "PosixPath"): _Call("pathlib.PosixPath", _path(pathlib.PurePosixPath)),
    ("pathlib", "PurePosixPath"): _Call("pathlib.PurePosixPath", _path(pathlib.PurePosixPath)),
    ("pathlib", "WindowsPath"): _Call("pathlib.WindowsPath", _path(pathlib.PureWindowsPath)),
    ("pathlib", "PureWindowsPath"): _Call("pathlib.PureWindowsPath", _path(pathlib.PureWindowsPath)),
    ("collections", "OrderedDict"): _Call("collections.OrderedDict", _ordered_dict),
    **{("torch", name): value for name, value in vars(torch).items() if isinstance(value, torch.dtype)},
}


@dataclass(slots=True)
class _Machine:
    """The pickle virtual machine reduced to what DCP metadata needs: nothing it does calls the file's code."""

    stack: list = field(default_factory=list)
    marks: list[int] = field(default_factory=list)
    memo: dict[int, object] = field(default_factory=dict)

    def pop_mark(self) -> list:
        if not self.marks:
            raise MetadataError("an opcode needs a MARK that is not there")
        at = self.marks.pop()
        items, self.stack[at:] = self.stack[at:], []
        return items

    def target(self, kind: type, what: str):
        if not self.stack or not isinstance(self.stack[-1], kind):
            raise MetadataError(f"{what} on a {type(self.stack[-1]).__name__ if self.stack else 'empty stack'}")
        return self.stack[-1]


def _global(vm: _Machine, module: object, name: object) -> None:
    value = _GLOBALS.get((module, name)) if isinstance(module, str) and isinstance(name, str) else None
    if value is None:
        raise MetadataError(f"refused global {module}.{name}: not a DCP metadata record, torch.Size or dtype")
    vm.stack.append(value)


def _newobj(vm: _Machine) -> None:
    args, cls = vm.stack.pop(), vm.stack.pop()
    if not isinstance(cls, str) or args != ():
        raise MetadataError(f"NEWOBJ of {cls!r} with {args!r}: only DCP records, built empty then filled by BUILD")
    vm.stack.append(_Record(cls))


def _reduce(vm: _Machine) -> None:
    args, call = vm.stack.pop(), vm.stack.pop()
    if not isinstance(call, _Call) or not isinstance(args, tuple):
        raise MetadataError(f"refused to call {call!r}: only torch.Size, layouts, memory formats and paths")
    vm.stack.append(call.convert(*args))


def _build(vm: _Machine) -> None:
    state = vm.stack.pop()
    record = vm.stack[-1] if vm.stack else None
    if not isinstance(record, _Record) or record.state is not _UNSET:
        what = record.name if isinstance(record, _Call) else type(record).__name__
        raise MetadataError(f"refused to set the state of {what}: BUILD fills only a fresh DCP record, once")
    record.state = state


def _setitems(vm: _Machine, items: list) -> None:
    target = vm.target(dict, "SETITEM(S)")
    if len(items) % 2:
        raise MetadataError("SETITEMS with an odd number of items")
    for key, value in zip(items[::2], items[1::2]):
        if not isinstance(key, (str, int, _Record)):
            raise MetadataError(f"a dict key of type {type(key).__name__}")
        target[key] = value


def _append(vm: _Machine, items: list) -> None:
    vm.target(list, "APPEND(S)").extend(items)


def _get(vm: _Machine, index: int) -> None:
    if index not in vm.memo:
        raise MetadataError(f"memo entry {index} read before it is written")
    vm.stack.append(vm.memo[index])


def _put(vm: _Machine, index: int) -> None:
    vm.memo[index] = vm.target(object, "PUT")


def _tuple(n: int) -> Callable[[_Machine, object], None]:
    def op(vm: _Machine, _arg: object) -> None:
        if len(vm.stack) < n:
            raise MetadataError(f"TUPLE{n} on a stack of {len(vm.stack)}")
        items, vm.stack[len(vm.stack) - n:] = tuple(vm.stack[len(vm.stack) - n:]), []
        vm.stack.append(items)
    return op


def _push(value: object) -> Callable[[_Machine, object], None]:
    return lambda vm, _arg: vm.stack.append(value() if callable(value) else value)


_VALUE = lambda vm, arg: vm.stack.append(arg)  # noqa: E731 - the opcode's own decoded argument
_NOTHING = lambda vm, arg: None  # noqa: E731
_OPS: dict[str, Callable[[_Machine, object], None]] = {
    "PROTO": _NOTHING, "FRAME": _NOTHING, "STOP": _NOTHING,
    "MARK": lambda vm, arg: vm.marks.append(len(vm.stack)),
    **dict.fromkeys(("SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "BININT", "BININT1", "BININT2",
                     "LONG1"), _VALUE),
    "NONE": _push(None), "NEWTRUE": _push(True), "NEWFALSE": _push(False),
    "EMPTY_TUPLE": _push(()), "EMPTY_LIST": _push(list), "EMPTY_DICT": _push(dict),
    "TUPLE1": _tuple(1), "TUPLE2": _tuple(2), "TUPLE3": _tuple(3),
    "TUPLE": lambda vm, arg: vm.stack.append(tuple(vm.pop_mark())),
    "APPEND": lambda vm, arg: _append(vm, [vm.stack.pop()]),
    "APPENDS": lambda vm, arg: _append(vm, vm.pop_mark()),
    "SETITEM": lambda vm, arg: _setitems(vm, [vm.stack.pop(-2), vm.stack.pop()]),
    "SETITEMS": lambda vm, arg: _setitems(vm, vm.pop_mark()),
    "MEMOIZE": lambda vm, arg: _put(vm, len(vm.memo)), "BINPUT": _put, "LONG_BINPUT": _put,
    "BINGET": _get, "LONG_BINGET": _get,
    "GLOBAL": lambda vm, arg: _global(vm, *arg.split(" ", 1)),
    "STACK_GLOBAL": lambda vm, arg: _global(vm, vm.stack.pop(-2), vm.stack.pop()),
    "NEWOBJ": lambda vm, arg: _newobj(vm), "REDUCE": lambda vm, arg: _reduce(vm), "BUILD": lambda vm, arg: _build(vm),
}


def _walk(data: bytes) -> object:
    """The value the pickle ``data`` describes, with DCP records left as ``_Record``s."""
    vm = _Machine()
    try:
        for op, arg, pos in pickletools.genops(data):
            if op.name not in _OPS:
                raise MetadataError(f"opcode {op.name} (byte {pos}) is not one DCP metadata uses")
            _OPS[op.name](vm, arg)
    except (IndexError, KeyError, TypeError) as exc:  # a stack or memo the opcodes do not fit
        raise MetadataError(f"malformed pickle ({type(exc).__name__}: {exc})") from None
    except ValueError as exc:  # genops: a truncated or unknown opcode
        raise exc if isinstance(exc, MetadataError) else MetadataError(f"malformed pickle ({exc})") from None
    if len(vm.stack) != 1 or vm.marks:
        raise MetadataError(f"the pickle leaves {len(vm.stack)} values and {len(vm.marks)} marks, not one value")
    return vm.stack[0]


_Convert = Callable[[object, "_Builder"], object]  # a field's value as walked → the value torch's record holds


def _typed(*types: type) -> _Convert:
    def convert(value: object, _b: _Builder) -> object:
        if not isinstance(value, types) or (type(value) is bool and bool not in types):
            raise MetadataError(f"a {type(value).__name__}, not {' or '.join(t.__name__ for t in types)}")
        return value
    return convert


def _optional(convert: _Convert) -> _Convert:
    return lambda value, b: None if value is None else convert(value, b)


def _seq_of(convert: _Convert, kinds: tuple[type, ...] = (list,)) -> _Convert:
    return lambda value, b: type(value)(convert(v, b) for v in _typed(*kinds)(value, b))


def _dict_of(key: _Convert, value: _Convert) -> _Convert:
    return lambda d, b: {key(k, b): value(v, b) for k, v in _typed(dict)(d, b).items()}


def _record(*kinds: str) -> _Convert:
    return lambda value, b: b.record(value, kinds)


def _count(value: object, b: _Builder) -> int:
    if _typed(int)(value, b) < 0:
        raise MetadataError(f"{value} < 0")
    return value


_STR, _SIZE, IGNORED = _typed(str), _typed(torch.Size), object()  # IGNORED: a field walked, left out of its record
_SPECS: dict[str, tuple[type, dict[str, tuple[_Convert, bool]]]] = {  # kind → (torch's class, field → (convert, required))
    "Metadata": (md.Metadata, {
        "state_dict_metadata": (_dict_of(_STR, _record("TensorStorageMetadata", "BytesStorageMetadata")), True),
        "planner_data": (_optional(_dict_of(_STR, _seq_of(_typed(str, int), (tuple, list)))), False),
        "storage_data": (_dict_of(_record("MetadataIndex"), _record("_StorageInfo")), True),
        "storage_meta": (_optional(_record("StorageMeta")), False),
        "version": (_optional(_STR), False)}),
    "TensorStorageMetadata": (md.TensorStorageMetadata, {
        "properties": (_record("TensorProperties"), True), "size": (_SIZE, True),
        "chunks": (_seq_of(_record("ChunkStorageMetadata")), True)}),
    "BytesStorageMetadata": (md.BytesStorageMetadata, {}),
    "ChunkStorageMetadata": (md.ChunkStorageMetadata, {"offsets": (_SIZE, True), "sizes": (_SIZE, True)}),
    "MetadataIndex": (md.MetadataIndex, {
        "fqn": (_STR, True), "offset": (_optional(_SIZE), False), "index": (_optional(_typed(int)), False)}),
    "StorageMeta": (md.StorageMeta, {
        "checkpoint_id": (_optional(_typed(str, pathlib.PurePath)), False), "save_id": (_optional(_STR), False),
        "load_id": (_optional(_STR), False), "modules": (_seq_of(_STR), False)}),
    "_StorageInfo": (_StorageInfo, {
        "relative_path": (_STR, True), "offset": (_count, True), "length": (_count, True),
        "transform_descriptors": (_optional(_seq_of(_STR, (list, tuple))), False)}),
}
_MEMORY_FORMATS = {md._MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT: torch.contiguous_format,
                   md._MEM_FORMAT_ENCODING.TORCH_CHANNELS_LAST: torch.channels_last,
                   md._MEM_FORMAT_ENCODING.TORCH_PRESERVE_FORMAT: torch.preserve_format}


def _properties(state: object) -> md.TensorProperties:
    """``TensorProperties`` from the tuple its ``__getstate__`` pickles: (dtype, layout, requires_grad,
    memory-format code, pin_memory)."""
    if not isinstance(state, tuple) or len(state) != 5:
        raise MetadataError(f"TensorProperties state {state!r} is not (dtype, layout, requires_grad, format, pin)")
    dtype, layout, requires_grad, encoding, pin_memory = state
    if not isinstance(dtype, torch.dtype) or layout is not torch.strided or encoding not in _MEMORY_FORMATS \
            or not isinstance(requires_grad, bool) or not isinstance(pin_memory, bool):
        raise MetadataError(f"TensorProperties {state!r}: want a torch dtype, torch.strided, two bools, a format")
    return md.TensorProperties(dtype=dtype, layout=layout, requires_grad=requires_grad,
                               memory_format=_MEMORY_FORMATS[encoding], pin_memory=pin_memory)


@dataclass(slots=True)
class _Builder:
    """Turns walked ``_Record``s into torch's DCP dataclasses, each once (a record met again is the same
    object; a record that contains itself is refused)."""

    done: dict[int, object] = field(default_factory=dict)
    open: set[int] = field(default_factory=set)

    def record(self, value: object, kinds: tuple[str, ...]) -> object:
        if not isinstance(value, _Record) or value.kind not in kinds:
            raise MetadataError(f"a {getattr(value, 'kind', type(value).__name__)} where {'/'.join(kinds)} belongs")
        if id(value) not in self.done:
            if id(value) in self.open:
                raise MetadataError(f"a {value.kind} that contains itself")
            self.open.add(id(value))
            self.done[id(value)] = self._make(value)
            self.open.discard(id(value))
        return self.done[id(value)]

    def _make(self, rec: _Record) -> object:
        if rec.kind == "TensorProperties":
            return _properties(rec.state)
        cls, spec = _SPECS[rec.kind]
        state = {} if rec.state is _UNSET else rec.state
        if not isinstance(state, dict):
            raise MetadataError(f"{rec.kind} state is a {type(state).__name__}, not a dict of fields")
        missing = sorted(k for k, (_, required) in spec.items() if required and k not in state)
        unknown = sorted(map(str, set(state) - set(spec)))
        if missing or unknown:
            raise MetadataError(f"{rec.kind}: missing fields {missing}, unknown fields {unknown}")
        kwargs = {}
        for name, value in state.items():
            try:
                kwargs[name] = spec[name][0](value, self)
            except MetadataError as exc:
                raise MetadataError(f"{rec.kind}.{name}: {exc}") from None
        return cls(**{k: v for k, v in kwargs.items() if v is not IGNORED})


def parse_metadata(data: bytes) -> md.Metadata:
    """The DCP ``Metadata`` the ``.metadata`` bytes ``data`` describe, built from the opcodes (never unpickled).

    Raises:
        MetadataError: an opcode, GLOBAL, call or field ``dcp.save`` does not write (the message names it).
    """
    return _Builder().record(_walk(data), ("Metadata",))


def _check_cover(key: str, size: torch.Size, chunks: list[md.ChunkStorageMetadata]) -> None:
    """Chunks inside ``size`` holding each element once (DCP leaves one no chunk holds as it was allocated)."""
    for c in chunks:
        if not (len(c.offsets) == len(c.sizes) == len(size)) or not all(
                0 <= o and 0 <= n and o + n <= d for o, n, d in zip(c.offsets, c.sizes, size)):
            raise MetadataError(f"entry {key!r}: chunk at offsets {list(c.offsets)} of sizes {list(c.sizes)} "
                                f"is not inside its size {list(size)}")
    if (volume := sum(c.sizes.numel() for c in chunks)) != size.numel():
        raise MetadataError(f"entry {key!r}: its chunks cover {volume} of its {size.numel()} elements")
    if len(chunks) < 2:
        return
    cover = torch.zeros(tuple(size), dtype=torch.bool)  # RuntimeError where no memory holds it
    for c in chunks:
        cover[tuple(slice(o, o + n) for o, n in zip(c.offsets, c.sizes))] = True
    if not bool(cover.all()):
        raise MetadataError(f"entry {key!r}: its chunks leave elements unread (two chunks overlap)")


def check_layout(directory: Path, metadata: md.Metadata) -> None:
    """Raises MetadataError unless every tensor entry of ``metadata`` has non-negative dims and chunks inside
    them that hold each element once, and every data file is a plain file name inside ``directory`` whose byte
    range lies within it. A size no memory holds as a bool mask raises RuntimeError."""
    for key, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, md.TensorStorageMetadata):
            if any(n < 0 for n in entry.size):
                raise MetadataError(f"entry {key!r} has size {entry.size!r}, dtype {entry.properties.dtype}")
            _check_cover(key, entry.size, entry.chunks)
    sizes: dict[str, int] = {}
    for index, info in metadata.storage_data.items():
        name = info.relative_path
        if Path(name).name != name or name in ("", ".", "..") or not (directory / name).is_file():
            raise MetadataError(f"data file {name!r} of {index.fqn!r} is not a file name inside {directory}")
        size = sizes.setdefault(name, (directory / name).stat().st_size)
        if info.offset + info.length > size:
            raise MetadataError(f"{index.fqn!r}: bytes [{info.offset}, {info.offset + info.length}) lie past "
                                f"the end of {name} ({size} bytes)")
