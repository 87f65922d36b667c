"""Base weights in hf-fused naming: a lazy safetensors checkpoint or in-memory tensors.

A ``BaseProvider`` lists the base tensors (``metas()``, in layer order, whole tensors, global
shapes) and reads any box of one (``read(name, box)``). Sharded trainers implement their own
provider over a local shard (global boxes → local offsets); keep the protocol this small.
"""

from __future__ import annotations

import dataclasses
import json
import mmap
import re
import struct
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch
from safetensors import safe_open

from protocols.params import Box, ParamMeta, box_shape, full_box
from sync_service.dtypes import SAFETENSORS_DTYPES, torch_dtype, wire_dtype
from sync_service.merge.errors import MergeError
from sync_service.merge.inputs import read_json_object, read_safetensors
from sync_service.merge.derive import kept_in_fp32, layout_for, memory_shapes
from sync_service.merge.layouts import FamilyLayout
from sync_service.merge.targets import Piece, experts_match, target_pieces

def layer_order_key(name: str) -> tuple[int, int, str]:
    """Sort key: embeddings, then decoder layers by index, then the rest (final norm, lm_head)."""
    m = re.search(r"\.layers\.(\d+)\.", name)
    if m:
        return (1, int(m.group(1)), "")
    return (0 if "embed" in name else 2, 0, "")


class MappedSafetensors:
    """One safetensors file mapped copy-on-write; tensors come back as zero-copy views of the page cache.

    Format (huggingface/safetensors README): 8-byte little-endian header length N, N bytes of JSON
    (``{key: {"dtype", "shape", "data_offsets": [begin, end]}}``, offsets relative to the data), data.
    Pages are read on first touch only, so a box costs the bytes it covers. The mapping is private:
    a caller writing into a view never changes the file (the protocol says callers do not write).
    """

    def __init__(self, path: str):
        with open(path, "rb") as fh:
            self._map = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
        (header_len,) = struct.unpack_from("<Q", self._map, 0)
        self._header: dict = json.loads(self._map[8:8 + header_len])
        self._data_start = 8 + header_len
        self._raw = torch.frombuffer(self._map, dtype=torch.uint8)
        self._views: dict[str, torch.Tensor | None] = {}

    def tensor(self, key: str) -> torch.Tensor | None:
        """The whole tensor ``key`` as a view, or ``None`` if its bytes are not aligned to its dtype."""
        if key not in self._views:
            info = self._header[key]
            dtype = torch_dtype(SAFETENSORS_DTYPES[info["dtype"]])
            begin, end = (self._data_start + o for o in info["data_offsets"])
            aligned = begin % dtype.itemsize == 0
            self._views[key] = self._raw[begin:end].view(dtype).view(info["shape"]) if aligned else None
        return self._views[key]


@runtime_checkable
class BaseProvider(Protocol):
    """Base tensors in hf-fused naming. Optional attribute ``tied_aliases: dict[str, str]`` maps a
    tied alias that is not listed (``lm_head.weight``) to the listed tensor it shares."""

    def metas(self) -> list[ParamMeta]:
        """Whole tensors (``box=None``), global shapes, wire dtype names, in layer order."""
        ...

    def read(self, name: str, box: Box) -> torch.Tensor:
        """Base values of ``box`` of ``name``, shape ``box_shape(box)``; the caller never modifies it
        (it may be a view of the base). Raises ``KeyError`` for an unknown name."""
        ...


class TensorDictBase:
    """In-memory base tensors in hf-fused names (e.g. a transformers model's ``state_dict()``).

    Tensors sharing storage (tied embeddings) are listed once, under the first name; later names
    go to ``tied_aliases``. ``read`` returns views: zero copies.
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        self._tensors: dict[str, torch.Tensor] = {}
        self.tied_aliases: dict[str, str] = {}
        seen: dict[tuple[int, tuple[int, ...], tuple[int, ...]], str] = {}
        for name, t in tensors.items():
            key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()))
            if t.numel() and key in seen:
                self.tied_aliases[name] = seen[key]
                continue
            seen[key] = name
            self._tensors[name] = t.detach()
        order = sorted(self._tensors, key=lambda n: (layer_order_key(n)[:2]))
        self._metas = [ParamMeta(n, wire_dtype(self._tensors[n].dtype), tuple(self._tensors[n].shape)) for n in order]

    def metas(self) -> list[ParamMeta]:
        return list(self._metas)

    @property
    def device(self) -> torch.device:
        """The first tensor's device (``cpu`` when empty): where a merge over this base runs."""
        first = next(iter(self._tensors.values()), None)
        return torch.device("cpu") if first is None else first.device

    def read(self, name: str, box: Box) -> torch.Tensor:
        t = self._tensors[name]
        return t[tuple(slice(a, b) for a, b in box)]


class SafetensorsBase:
    """A safetensors checkpoint directory read lazily (``safe_open``), in hf-fused naming.

    Maps any on-disk naming the family table knows: per-expert keys (``…experts.N.gate_proj.weight``,
    Mixtral ``block_sparse_moe.experts.N.w1``) are assembled into fused tensors, fused keys are
    taken as they are, a VL prefix (``model.language_model.``) is kept. Reads only the bytes of the
    requested box. Memory: one open handle per file. ``as_loaded``: dtypes as transformers'
    ``from_pretrained`` holds them (a bf16 checkpoint's ``e_score_correction_bias`` in float32, from the
    model's own keep-in-fp32 plan), as a trainer or engine that loaded the checkpoint holds them.

    Raises:
        MergeError: no ``config.json`` / safetensors, a corrupt one, unsupported family, missing or mis-shaped experts.
    """

    def __init__(self, checkpoint_dir: str | Path, layout: FamilyLayout | None = None, *, as_loaded: bool = False):
        self.dir = Path(checkpoint_dir)
        config_path = self.dir / "config.json"
        if not config_path.is_file():
            raise MergeError(f"{self.dir}: no config.json; pass a directory written by save_pretrained")
        self.config: dict = read_json_object(config_path)
        self.layout = layout or layout_for(self.config)
        self._handles: dict[str, object] = {}
        self._mapped: dict[str, MappedSafetensors] = {}
        disk = self._disk_index()
        self._plans: dict[str, list[tuple[Piece, str]]] = {}
        self._metas = self._assemble(disk)
        self._upcast = self._loaded_fp32() if as_loaded else frozenset()
        self._metas = [ParamMeta(m.name, "float32", m.shape) if m.name in self._upcast else m for m in self._metas]
        self.tied_aliases = self._tied(disk)
        self._by_expert = {name: _index_by_expert(plan) for name, plan in self._plans.items() if len(plan) > 1}

    def _disk_entries(self) -> dict[str, tuple[str, str, tuple[int, ...]]]:
        """disk key → (file, safetensors dtype tag, shape), from the headers only."""
        files = sorted(self.dir.glob("*.safetensors"))
        if not files:
            raise MergeError(f"{self.dir}: no *.safetensors files; convert the checkpoint with save_pretrained")
        entries = {}
        for path in files:
            with read_safetensors(path, lambda p: safe_open(p, framework="pt")) as f:
                for key in f.keys():
                    sl = f.get_slice(key)
                    entries[key] = (str(path), sl.get_dtype(), tuple(sl.get_shape()))
        return entries

    def _disk_index(self) -> dict[str, tuple[str, str, tuple[int, ...]]]:
        """disk key → (file, wire dtype, shape)."""
        return {key: (file, SAFETENSORS_DTYPES[tag], shape) for key, (file, tag, shape) in self._disk_entries().items()}

    def _assemble(self, disk: dict[str, tuple[str, str, tuple[int, ...]]]) -> list[ParamMeta]:
        lay = self.layout
        names = "|".join(re.escape(n) for n in lay.per_expert_names)
        pattern = re.compile(rf"(.*)\.{re.escape(lay.experts_module)}\.(\d+)\.({names})\.weight")
        groups: dict[tuple[str, str], dict[int, str]] = defaultdict(dict)
        metas: dict[str, ParamMeta] = {}
        self._by_memory = {lay.from_disk(key): key for key in disk}
        for key, (file, dtype, shape) in disk.items():
            name = lay.from_disk(key)
            m = pattern.fullmatch(name)
            if m is None or lay.disk == "fused":
                piece = self._stored_piece(name, key, shape)
                metas[name] = ParamMeta(name, dtype, box_shape(piece.box))
                self._plans[name] = [(piece, file)]
                continue
            slot = lay.slot_of(m.group(3))
            param = lay.slot_param(slot)
            fused = f"{m.group(1)}.{lay.experts_module}.{param}"
            groups[(fused, param)][int(m.group(2))] = key
        for (fused, param), by_expert in groups.items():
            metas[fused] = self._fused_meta(fused, param, by_expert, disk)
        order = sorted(metas, key=lambda n: layer_order_key(n)[:2])
        return [metas[n] for n in order]

    def _loaded_fp32(self) -> frozenset[str]:
        """Stored half-precision tensors that transformers' ``from_pretrained`` holds in float32."""
        kept = kept_in_fp32(self.config)
        return frozenset(m.name for m in self._metas if m.name in kept and m.dtype in ("bfloat16", "float16"))

    def _stored_piece(self, name: str, key: str, shape: tuple[int, ...]) -> Piece:
        """Disk tensor ``key`` as the in-memory tensor ``name``: transposed where the layout says so
        (``disk_transpose``; ``"by_shape"``: iff its shape differs from the meta model's, as transformers'
        ``Transpose(check_dims=True)`` decides)."""
        lay = self.layout
        match = experts_match(name, lay)
        if match is None or match[1] not in (lay.gate_up, lay.down) or lay.disk_transpose == "never":
            return Piece(key, full_box(shape))
        swapped = (*shape[:-2], shape[-1], shape[-2])
        if lay.disk_transpose == "by_shape":
            memory = memory_shapes(self.config).get(name)
            if shape[-1] == shape[-2] or memory is None:
                raise MergeError(f"{self.dir}: {key} {list(shape)} of family {lay.family}: its orientation cannot be "
                                 f"told (transformers transposes iff the shape differs from the model's "
                                 f"{memory and list(memory)}); re-save the checkpoint with save_pretrained")
            if tuple(memory) == tuple(shape):
                return Piece(key, full_box(shape))
            if tuple(memory) != swapped:
                raise MergeError(f"{self.dir}: {key} is {list(shape)}; the model of config.json holds {name} "
                                 f"{list(memory)}")
        return Piece(key, full_box(swapped), transpose=True)

    def _fused_meta(self, fused: str, param: str, by_expert: dict[int, str], disk) -> ParamMeta:
        lay = self.layout
        num_experts = max(by_expert) + 1
        a_key = next(iter(by_expert.values()))
        _, dtype, (out_f, in_f) = disk[a_key]
        if param == lay.gate_up:
            out_f *= 2
        shape = (num_experts, out_f, in_f) if lay.orientation == "out_in" else (num_experts, in_f, out_f)
        plan = []
        for piece in target_pieces("hf", fused, shape, lay):
            # the key as stored: transformers' renamings are not one-to-one (a VL checkpoint may use either prefix)
            key = self._by_memory.get(lay.from_disk(piece.name), piece.name)
            if key not in disk:
                raise MergeError(f"{self.dir}: checkpoint lacks {piece.name} (needed for {fused} {list(shape)})")
            piece = dataclasses.replace(piece, name=key)
            file, p_dtype, p_shape = disk[key]
            if p_shape != piece.shape or p_dtype != dtype:
                raise MergeError(
                    f"{self.dir}: {piece.name} is {p_dtype}{list(p_shape)}, expected {dtype}{list(piece.shape)} "
                    f"like the other experts of {fused}"
                )
            plan.append((piece, file))
        self._plans[fused] = plan
        return ParamMeta(fused, dtype, shape)

    def _tied(self, disk) -> dict[str, str]:
        alias_suffix, kept_suffix = self.layout.tied_alias
        if not self.config.get("tie_word_embeddings", False) or any(k.endswith(alias_suffix) for k in disk):
            return {}
        kept = [m.name for m in self._metas if m.name.endswith(kept_suffix)]
        return {alias_suffix: kept[0]} if kept else {}

    def metas(self) -> list[ParamMeta]:
        return list(self._metas)

    def _disk_values(self, key: str, file: str, slices: tuple[slice, ...]) -> torch.Tensor:
        """``slices`` of disk tensor ``key``: a view of the mapped file (a copy via ``safe_open`` if unaligned)."""
        if file not in self._mapped:
            self._mapped[file] = MappedSafetensors(file)
        whole = self._mapped[file].tensor(key)
        if whole is not None:
            return whole[slices]
        if file not in self._handles:
            self._handles[file] = safe_open(file, framework="pt")
        return self._handles[file].get_slice(key)[slices]

    def _pieces(self, name: str, box: Box) -> list[tuple[Piece, str]]:
        """The plan pieces that may meet ``box`` (per-expert plans are indexed by expert)."""
        by_expert = self._by_expert.get(name)
        if by_expert is None:
            return self._plans[name]
        return [p for e in range(*box[0]) for p in by_expert.get(e, ())]

    def read(self, name: str, box: Box) -> torch.Tensor:
        """A view of the mapped checkpoint when ``box`` lies in one stored tensor; else an assembled copy
        (a float32 copy for a tensor ``as_loaded`` upcasts)."""
        if name in self._upcast:
            return self._read_stored(name, box).float()
        return self._read_stored(name, box)

    def _read_stored(self, name: str, box: Box) -> torch.Tensor:
        out = None
        for piece, file in self._pieces(name, box):
            sub = tuple((max(a, pa), min(b, pb)) for (a, b), (pa, pb) in zip(box, piece.box))
            if any(a >= b for a, b in sub):
                continue
            rel = tuple((a - pa, b - pa) for (a, b), (pa, _) in zip(sub, piece.box))
            tgt = rel[1:] if piece.drop_dim0 else rel
            if piece.transpose:
                tgt = tgt[:-2] + (tgt[-1], tgt[-2])
            values = piece.from_target(self._disk_values(piece.name, file, tuple(slice(a, b) for a, b in tgt)))
            if sub == box:
                return values
            if out is None:
                out = torch.empty(box_shape(box), dtype=values.dtype)
            out[tuple(slice(a - ba, b - ba) for (a, b), (ba, _) in zip(sub, box))] = values
        if out is None and any(a == b for a, b in box):  # empty box
            return torch.empty(box_shape(box), dtype=torch_dtype(self._meta_dtype(name)))
        assert out is not None, f"box {box} of {name} covers no piece"
        return out

    def _meta_dtype(self, name: str) -> str:
        return next(m.dtype for m in self._metas if m.name == name)


def _index_by_expert(plan: list[tuple[Piece, str]]) -> dict[int, list[tuple[Piece, str]]] | None:
    """Expert → pieces, for a plan of one-expert pieces (per-expert disk keys); ``None`` otherwise."""
    if not all(piece.drop_dim0 for piece, _ in plan):
        return None
    index: dict[int, list[tuple[Piece, str]]] = defaultdict(list)
    for piece, file in plan:
        index[piece.box[0][0]].append((piece, file))
    return dict(index)
