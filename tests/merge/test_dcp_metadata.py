"""torch.distributed.checkpoint ``.metadata`` read without an unpickler (``sync_service/merge/dcp_metadata.py``):
what ``dcp.save`` writes comes out equal to torch's own records; anything else is refused naming what it is,
its payload never runs, no class is changed and no file outside the checkpoint is read."""

from __future__ import annotations

import os
import pathlib
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

from sync_service.merge.dcp import read_dcp_state
from sync_service.merge.dcp_metadata import parse_metadata
from sync_service.merge.errors import MergeError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

_DCP = b"torch.distributed.checkpoint.metadata\n"


def _save(state: dict, path: Path) -> Path:
    dcp.save(state, checkpoint_id=str(path), no_dist=True)
    return path


def test_what_dcp_save_writes_reads_as_torch_reads_it(tmp_path):
    """Nested state (planner_data paths with str and int parts), fp32 / bf16 / int64 / empty tensors and
    non-tensor (bytes) entries, pickled by every binary protocol: the records equal ``pickle.loads`` of the
    test's own file, field for field."""
    state = {"model": {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3, dtype=torch.bfloat16),
                       "layers": [torch.arange(4), torch.empty(0, 5)]}, "step": 3, "name": "run"}
    data = (_save(state, tmp_path / "ckpt") / ".metadata").read_bytes()
    want = pickle.loads(data)  # the test's own file
    assert want.planner_data["model.layers.1"] == ("model", "layers", 1)
    for protocol in (None, 2, 3, 4, 5):
        got = parse_metadata(data if protocol is None else pickle.dumps(want, protocol=protocol))
        assert got == want, protocol
        assert {k: type(v) for k, v in got.storage_data.items()} == {k: type(v) for k, v in want.storage_data.items()}


class _RunsCode:
    """A pickle whose loading would run a shell command (what a hostile ``.metadata`` could hold)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class _ChunkByCall:
    """A chunk pickled as a call of its class (GLOBAL + REDUCE) instead of NEWOBJ + BUILD."""

    def __reduce__(self):
        return (ChunkStorageMetadata, (torch.Size([0, 0]), torch.Size([2, 3])))


def _class_build(module: str, name: str, attr: str) -> bytes:
    """A pickle that sets ``attr`` on the class ``module.name`` itself (BUILD with slot state on a GLOBAL)."""
    p = pickle
    return (p.PROTO + b"\x02" + p.GLOBAL + f"{module}\n{name}\n".encode() + p.NONE + p.EMPTY_DICT
            + p.SHORT_BINUNICODE + bytes([len(attr)]) + attr.encode() + p.NONE + p.SETITEM + p.TUPLE2 + p.BUILD + p.STOP)


def _edited(path: Path, edit) -> bytes:
    meta = pickle.loads((path / ".metadata").read_bytes())  # the test's own file
    edit(meta)
    return pickle.dumps(meta)


def _set(attr: str, value):
    def edit(meta) -> None:
        for info in meta.storage_data.values():
            setattr(info, attr, value(info))
    return edit


def _entry(edit):
    return lambda meta: edit(meta.state_dict_metadata["model.w"])


_BUILD_TWICE = (pickle.PROTO + b"\x02" + pickle.GLOBAL + _DCP + b"BytesStorageMetadata\n" + pickle.EMPTY_TUPLE
                + pickle.NEWOBJ + pickle.EMPTY_DICT + pickle.BUILD + pickle.EMPTY_DICT + pickle.BUILD + pickle.STOP)


def _cases(good: Path, marker: Path) -> dict[str, tuple[bytes, str]]:
    return {
        "payload": (pickle.dumps(_RunsCode(marker)), "refused global posix.system"),
        "classbuild": (_class_build("pathlib", "PosixPath", "pwned_by_pickle"), "refused to set the state"),
        "build_twice": (_BUILD_TWICE, "BUILD fills only a fresh DCP record, once"),
        "by_call": (_edited(good, _entry(lambda e: setattr(e, "chunks", [_ChunkByCall()]))), "refused to call"),
        "text_protocol": (pickle.dumps({"a": 1}, protocol=0), "is not one DCP metadata uses"),
        "extra_field": (_edited(good, _entry(lambda e: setattr(e, "hook", "x"))), "unknown fields ['hook']"),
        "outside": (_edited(good, _set("relative_path", lambda i: "../secret/" + i.relative_path)),
                    "is not a file name inside"),
        "past_end": (_edited(good, _set("length", lambda i: i.length + 1)), "lie past the end of __0_0.distcp"),
        "negative": (_edited(good, _entry(lambda e: setattr(e, "size", torch.Size([-1, 3])))),
                     "has size torch.Size([-1, 3])"),
        "chunk_outside": (_edited(good, _entry(lambda e: setattr(e.chunks[0], "offsets", torch.Size([1, 0])))),
                          "chunk at offsets [1, 0] of sizes [2, 3] is not inside its size [2, 3]"),
        "no_chunks": (_edited(good, _entry(lambda e: setattr(e, "chunks", []))),
                      "chunks cover 0 of its 6 elements"),
        "half_chunk": (_edited(good, _entry(lambda e: setattr(e.chunks[0], "sizes", torch.Size([1, 3])))),
                       "chunks cover 3 of its 6 elements"),
        "overlap": (_edited(good, _entry(lambda e: setattr(e, "chunks", [
            ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([1, 3])),
            ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([1, 3]))]))),
            "chunks leave elements unread"),
    }


def test_anything_else_is_refused_naming_it(tmp_path):
    """A payload (``os.system``), state set on a class, a record filled twice or built by a call, a protocol-0
    pickle, an unknown field, a data file outside the directory or a byte range past its end, a negative size, a
    chunk outside its tensor, chunks that miss or overlap elements (DCP would leave those unread): each a ``MergeError`` naming the ``.metadata`` file, the fix and the cause; the
    payload never ran, no class changed, the other checkpoint's tensors were never read."""
    good, secret, marker = tmp_path / "good", tmp_path / "secret", tmp_path / "ran"
    _save({"model.w": torch.arange(6.0).reshape(2, 3)}, good)
    _save({"model.w": torch.full((2, 3), 42.0)}, secret)
    assert torch.equal(read_dcp_state(good)["model.w"], torch.arange(6.0).reshape(2, 3))
    for name, (data, why) in _cases(good, marker).items():
        d = tmp_path / name
        shutil.copytree(good, d)
        (d / ".metadata").write_bytes(data)
        with pytest.raises(MergeError, match="not a torch.distributed.checkpoint metadata file") as info:
            read_dcp_state(d)
        message = str(info.value)
        assert why in message and str(d / ".metadata") in message and "torch.distributed.checkpoint.save" in message, \
            (name, message)
    assert not marker.exists()
    assert not hasattr(pathlib.PosixPath, "pwned_by_pickle")


def test_corrupt_data_file_is_a_merge_error(tmp_path):
    """A data file whose bytes were damaged in place (length and metadata intact): DCP raises its
    ``CheckpointException`` (a ``BaseException``); read_dcp_state turns it into a MergeError naming the directory."""
    good = _save({"model.w": torch.arange(6.0).reshape(2, 3)}, tmp_path / "ckpt")
    data = good / "__0_0.distcp"
    data.write_bytes(bytes(data.stat().st_size))  # zeros: no torch.save archive left in it
    with pytest.raises(MergeError, match="torch.distributed.checkpoint cannot read it") as info:
        read_dcp_state(good)
    assert str(good) in str(info.value)
