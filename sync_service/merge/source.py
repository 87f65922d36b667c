"""``MergedSource``: the merged weights as a ``WeightSource`` in hf-fused naming.

Out of place: the base is only read. Per box: base values → fp32 scratch (reused, budgeted) →
+ Σ s·x@y (fused ``addmm_``/``baddbmm_``) → DoRA rescale if any → one cast into ``out`` → trainable
token rows (``RowOverride``) written over their rows of the box, cast once from the adapter's values.
Tensors the adapter does not touch are copied straight from the base (one cast, no scratch).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace

import torch

from protocols.params import Box, ParamMeta, box_numel, box_shape, full_box
from sync_service.dtypes import TORCH_DTYPES
from sync_service.merge.base import BaseProvider
from sync_service.merge.errors import MergeError
from sync_service.fp8 import SCALE_WIRES, scale_meta, scale_name
from sync_service.merge.finite import all_finite
from sync_service.merge.fp8_fill import Fp8Fill
from sync_service.merge.layouts import FamilyLayout
from sync_service.merge.staging import Scratch, apply_parts, apply_terms, chunks, term_parts, tile_bytes_for
from sync_service.merge.targets import target_pieces
from sync_service.merge.terms import LoraAdapter, RowOverride


@dataclass(kw_only=True, slots=True)
class MergeConfig:
    """How ``MergedSource`` merges."""

    out_dtype: str | None = None
    """Wire dtype name of the merged tensors (``"bfloat16"``, ...); ``None`` keeps each base tensor's dtype."""
    out_dtypes: Mapping[str, str] | None = None
    """Tensor name → wire dtype it is written in, over the owned metas' dtype: the sync plan's, which carries the
    engines' dtype (``coordinator.planning.engine_dtypes``; set per send by the trainer endpoint). The merge
    still accumulates in ``accumulate_dtype`` and casts once, from the accumulator into ``out``."""
    staging_bytes: int = 64 << 20
    """Budget of the fp32 scratch, bytes; boxes larger than this are merged in chunks."""
    tile_bytes: int | None = None
    """fp32 scratch per merge step, bytes (capped by ``staging_bytes``); ``None``: the merge device's
    (``merge.staging.tile_bytes_for``). On a CPU 2 MiB: small enough that one step's base values, scratch and
    output (4 MiB at 2 MiB of fp32 on a bf16 base) stay in this CPU's L2/L3, so the three passes (cast in, add
    terms, cast out) cost about one pass over memory; large enough that the per-step Python overhead (~10 torch
    calls) stays small. On one EP=2 trainer rank's whole fill at 1x, 2 MiB took 0.86-0.88 x the CPU time of 1 MiB,
    3-4 MiB 0.89 (docs/benchmarks.md, Merge). On a GPU the whole staging budget (whole expert blocks: the cost
    there is kernel launches, not cache). The values are bitwise the same at every tile size."""
    fp8_blocks: Mapping[str, tuple[int, int]] | None = None
    """FP8 value name → block ``(bm, bn)``, for the tensors the plan sends in block FP8 (values
    ``float8_e4m3fn`` in ``out_dtypes`` plus their scales ``sync_service.fp8.scale_name``; set per send by the
    trainer endpoint from the plan). Each is merged in ``accumulate_dtype`` and quantized per block into the
    bucket (``merge.fp8_fill``); the source produces the scales' boxes too, in their ``out_dtypes`` dtype (float32
    by default; ``float8_e8m0fnu``: quantized with ue8m0 rounding, ``sync_service.fp8.SCALE_WIRES``)."""
    check_finite: bool = False
    """Raise ``MergeError`` naming the tensor when a merged value is NaN or Inf (costs one pass)."""
    accumulate_dtype: str = "float32"
    """Scratch dtype of ``W + Σ s·B@A`` before the one cast into the output: ``"float32"`` (fast; a bf16
    output can round one ulp away from PEFT's float64 merge where the fp32 sum lands next to a bf16
    rounding boundary) or ``"float64"`` (bitwise PEFT's float64 ``merge_and_unload`` cast once, in the
    tests' models; twice the scratch bytes). A float64 base always accumulates in float64."""


def check_untied_owned(adapter: LoraAdapter, owned: Sequence[ParamMeta]) -> None:
    """Refuse a sync whose merged model unties embeddings the engines hold tied.

    ``owned`` (the boxes a sync produces) follows the engines' parameter table; an engine loaded from
    a tied base holds one tensor for both names and cannot take the separate one the adapter needs
    (``adapter.untied``), so syncing would leave it wrong. ``weightsync merge`` writes the untied
    model instead. Raises ``MergeError`` naming both tensors and the fix (an untied base)."""
    names = {m.name for m in owned}
    for alias, kept in adapter.untied.items():
        if alias not in names and kept in names:
            raise MergeError(
                f"the adapter's modules_to_save replaces one of {alias} / {kept}, which the base ties "
                f"(tie_word_embeddings): the merged model unties them, as PEFT's merge_and_unload does, but "
                f"trainers and engines loaded from the tied base hold one tensor for both; start them from "
                f"an untied copy of the base (a separate {alias} = {kept}, tie_word_embeddings false)"
            )


def _write_rows(override: RowOverride, box: Box, out: torch.Tensor) -> None:
    """The override's rows inside ``box`` (a 2D box: rows, cols) written over ``out``, each value
    cast once from the adapter's dtype to ``out``'s (PEFT: ``W.index_copy(0, indices, values)``)."""
    (r0, r1), (c0, c1) = box
    inside = (override.indices >= r0) & (override.indices < r1)
    if bool(inside.any()):
        values = override.values[inside.to(override.values.device)][:, c0:c1]
        out[(override.indices[inside] - r0).to(out.device)] = values.to(out.device, out.dtype)


def _inside(box: Box, outer: Box) -> bool:
    return len(box) == len(outer) and all(oa <= a <= b <= ob for (a, b), (oa, ob) in zip(box, outer))


def _rel(sub: Box, box: Box) -> tuple[slice, ...]:
    return tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(sub, box))


class MergedSource:
    """Base + LoRA merged on demand; implements ``protocols.interfaces.WeightSource``.

    Args:
        base: the base tensors (never modified).
        adapter: normalised adapter, or ``None`` (the base as is). Not copied: pass
            ``adapter.snapshot()`` if the trainer keeps updating the factors meanwhile.
        config: dtype, staging budget, finiteness check.
        owned: the boxes this source produces (default: every base tensor whole, in layer order).
        layout: family layout, needed for target namings other than ``hf-fused`` (default:
            ``base.layout`` when the base has one).
    """

    def __init__(
        self,
        base: BaseProvider,
        adapter: LoraAdapter | None,
        *,
        config: MergeConfig,
        owned: Sequence[ParamMeta] | None = None,
        layout: FamilyLayout | None = None,
    ):
        self.base = base
        self.adapter = adapter or LoraAdapter()
        self.config = config
        self.layout = layout or getattr(base, "layout", None)
        self._base_metas = {m.name: m for m in base.metas()}
        for alias, kept in self.adapter.untied.items():  # a tied alias the adapter unties is a tensor of its own
            self._base_metas[alias] = ParamMeta(alias, self._base_metas[kept].dtype, self._base_metas[kept].shape)
        if config.out_dtype is not None and not hasattr(torch, config.out_dtype):
            raise MergeError(f"MergeConfig.out_dtype {config.out_dtype!r} is not a torch dtype name (e.g. 'bfloat16')")
        if config.accumulate_dtype not in ("float32", "float64"):
            raise MergeError(f"MergeConfig.accumulate_dtype {config.accumulate_dtype!r}: use 'float32' or 'float64'")
        if owned is None:
            owned = [ParamMeta(m.name, config.out_dtype or m.dtype, m.shape) for m in self._base_metas.values()]
        else:
            check_untied_owned(self.adapter, owned)
        blocks = dict(config.fp8_blocks or {})
        if blocks:  # block FP8: each values box is followed by its scales box, as the plan lists them
            owned = [x for m in owned for x in ([m, scale_meta(m, blocks[m.name])] if m.name in blocks else [m])]
        self.device = torch.device(getattr(base, "device", "cpu"))
        """Where the merge runs: the base's device (its scratch and temporaries live there; ``out`` may be elsewhere)."""
        self._tile_bytes = tile_bytes_for(self.device, config.staging_bytes, config.tile_bytes)
        self._fp8 = Fp8Fill(blocks, self._merge_box, self._accumulate_of, self._scale_fmt, tile_bytes=self._tile_bytes)
        if config.out_dtypes:  # the plan's dtypes (the engines'), cast once from the accumulator or the base
            owned = [replace(m, dtype=config.out_dtypes.get(m.name, m.dtype)) for m in owned]
        self._owned = list(owned)
        self._boxes: dict[str, list[Box]] = {}
        self._dtypes: dict[str, str] = {}
        for meta in self._owned:
            if not hasattr(torch, meta.dtype) or self._dtypes.setdefault(meta.name, meta.dtype) != meta.dtype:
                raise MergeError(f"owned boxes of {meta.name} need one torch dtype name, got {meta.dtype!r}")
            if meta.name not in self._base_metas and meta.name not in self._fp8.values_of:
                raise MergeError(f"owned box names {meta.name}, which is not a base tensor")
            self._boxes.setdefault(meta.name, []).append(meta.covered_box())
        for name in self._fp8.values_of.keys() & self._dtypes.keys():
            if self._dtypes[name] not in SCALE_WIRES:
                raise MergeError(f"scales {name} would be written as {self._dtypes[name]}; block-FP8 scales are "
                                 f"one of {', '.join(SCALE_WIRES)} (the plan's dtype: the engines')")
        self._scratch = Scratch(config.staging_bytes)
        self._cast: dict[tuple, list] = {}  # (name, dtype, device, factor identities and versions) -> cast terms
        self._fp8_scratch = torch.empty(0, dtype=torch.uint8, device=self.device)

    @property
    def peak_staging_bytes(self) -> int:
        """Largest fp32 scratch in use at once so far, bytes (<= ``config.staging_bytes``)."""
        return self._scratch.peak_bytes

    def param_metas(self) -> Sequence[ParamMeta]:
        return list(self._owned)

    def changed_names(self) -> frozenset[str]:
        changed = self.adapter.changed_names() & frozenset(self._boxes)
        return changed | {s for s, v in self._fp8.values_of.items() if v in changed and s in self._boxes}

    def out_dtype(self, name: str) -> torch.dtype:
        """The dtype ``fill`` writes for ``name``: the owned meta's (default: ``out_dtype`` or the base's)."""
        return TORCH_DTYPES[self._dtypes[name]]

    def fill(self, name: str, box: Box, out: torch.Tensor) -> None:
        """Write the merged values of ``box`` of ``name`` into ``out`` (shape ``box_shape(box)``).

        Raises:
            KeyError: ``name`` is not owned. ValueError (MergeError): box outside the owned
            boxes, wrong ``out`` shape/dtype, or non-finite values with ``check_finite``.
        """
        if name not in self._boxes:
            raise KeyError(f"{name} is not produced by this MergedSource")
        box = tuple(tuple(ab) for ab in box)
        if not any(_inside(box, owned) for owned in self._boxes[name]):
            raise MergeError(f"box {box} of {name} is not inside an owned box {self._boxes[name]}")
        if tuple(out.shape) != box_shape(box) or out.dtype != self.out_dtype(name):
            raise MergeError(f"out for {name} {box}: got {out.dtype}{list(out.shape)}, want {self.out_dtype(name)}{list(box_shape(box))}")
        if name in self._fp8.values_of:
            self._fp8.fill_scales(name, box, out)
        elif name in self._fp8.blocks:
            self._fp8.fill_values(name, box, out)
        else:
            self._fill_into(name, box, out)

    def _merge_box(self, name: str, box: Box, dtype: torch.dtype) -> torch.Tensor:
        """The merged values of ``box`` of ``name`` in ``dtype`` (the accumulation dtype of a block-FP8 tensor), in a
        scratch reused by the next call (the caller may overwrite it; ``Fp8Fill`` asks for cache-sized bands)."""
        nbytes = box_numel(box) * dtype.itemsize
        if self._fp8_scratch.numel() < nbytes:
            self._fp8_scratch = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        merged = self._fp8_scratch[:nbytes].view(dtype).view(box_shape(box))
        self._fill_into(name, box, merged)
        return merged

    def _scale_fmt(self, name: str) -> str:
        """The ``scale_fmt`` FP8 tensor ``name`` is quantized with: its scales' dtype's (``fp8.SCALE_WIRES``)."""
        return SCALE_WIRES[self._dtypes[scale_name(name)]]

    def _accumulate_of(self, name: str) -> torch.dtype:
        return self._accumulate(TORCH_DTYPES[self._base_metas[name].dtype])

    def _fill_into(self, name: str, box: Box, out: torch.Tensor) -> None:
        """``fill``'s merge, ``out`` in any floating dtype (checked by the caller)."""
        adapter = self.adapter
        if name in adapter.dora_magnitudes:
            self._fill_dora(name, box, out)
        elif name in adapter.terms:
            self._fill_terms(name, box, out, adapter.terms[name])
        else:
            out.copy_(self._read_base(name, box))
            if self.config.check_finite and out.is_floating_point():
                self._check(name, out)
        overrides = adapter.row_overrides.get(name, ())
        for override in overrides:
            _write_rows(override, box, out)
        if overrides:
            self._check(name, out)

    def _fill_terms(self, name: str, box: Box, out: torch.Tensor, terms) -> None:
        """Per tile: base → fp32 scratch → + its term parts → one cast into ``out``; a tile no term
        touches is cast straight from the base (same values, no fp32 round trip)."""
        acc = self._accumulate(TORCH_DTYPES[self._base_metas[name].dtype])
        terms = self._terms_in(name, terms, acc)
        for sub in self._chunks(name, box):
            parts = term_parts(terms, sub)
            view = out[_rel(sub, box)]
            base = self._read_base(name, sub)
            if not parts:
                view.copy_(base)
                if view.is_floating_point():
                    self._check(name, view)
                continue
            acc = self._accumulate(base.dtype)
            direct = view.dtype == acc and view.device == base.device and view.is_contiguous()
            scratch = view if direct else self._scratch.view(box_shape(sub), base.device, acc)  # direct: no copy out
            scratch.copy_(base)
            apply_parts(scratch, parts)
            if not direct:
                view.copy_(scratch)
            self._check(name, view, scratch)

    def _fill_dora(self, name: str, box: Box, out: torch.Tensor) -> None:
        """DoRA (2D): rows of ``box`` scaled by m / ‖W + ΔW‖ over the whole row (PEFT ``dora.py``)."""
        terms, magnitude = self.adapter.terms.get(name, []), self.adapter.dora_magnitudes[name]
        (r0, r1), cols = box
        width = self._base_metas[name].shape[1]
        sq = torch.zeros(r1 - r0, dtype=torch.float64, device=self.device)
        for sub in self._chunks(name, ((r0, r1), (0, width))):
            scratch = self._merged(name, sub, terms)
            sq[sub[0][0] - r0: sub[0][1] - r0] += scratch.square().sum(dim=1).to(sq.device)
        factor = magnitude[r0:r1].to(sq.device) / sq.sqrt()
        for sub in self._chunks(name, box):
            scratch = self._merged(name, sub, terms)
            scratch.mul_(factor[sub[0][0] - r0: sub[0][1] - r0].to(scratch.device, scratch.dtype).unsqueeze(1))
            view = out[_rel(sub, box)]
            view.copy_(scratch)
            self._check(name, view, scratch)

    def _accumulate(self, base_dtype: torch.dtype) -> torch.dtype:
        return torch.float64 if base_dtype == torch.float64 or self.config.accumulate_dtype == "float64" else torch.float32

    def _chunks(self, name: str, box: Box):
        itemsize = self._accumulate(TORCH_DTYPES[self._base_metas[name].dtype]).itemsize
        return chunks(box, self._tile_bytes, itemsize)

    def _terms_in(self, name: str, terms, dtype: torch.dtype) -> list:
        """``terms`` with their factors in the accumulation ``dtype`` on the merge device: cast once per source and
        tensor, not once per tile (on a GPU a per-tile cast is two more launches per tile). The key holds each
        factor's identity and ``_version`` (bumped by any in-place update), so a factor changed in place is cast
        again; factors already in ``dtype`` on the device are used as they are."""
        device = self.device
        if all(t.x.dtype == t.y.dtype == dtype and t.x.device == t.y.device == device for t in terms):
            return terms
        key = (name, dtype, device, tuple((id(t.x), t.x._version, id(t.y), t.y._version) for t in terms))
        cast = self._cast.get(key)
        if cast is None:
            self._cast = {k: v for k, v in self._cast.items() if k[0] != name}  # one cast set per tensor
            cast = self._cast[key] = [replace(t, x=t.x.to(device, dtype), y=t.y.to(device, dtype)) for t in terms]
        return cast

    def _merged(self, name: str, sub: Box, terms) -> torch.Tensor:
        """Base values of ``sub`` + every term, in the reused scratch (valid until the next call)."""
        base = self._read_base(name, sub)
        scratch = self._scratch.view(box_shape(sub), base.device, self._accumulate(base.dtype))
        scratch.copy_(base)
        apply_terms(scratch, sub, terms)
        return scratch

    def _read_base(self, name: str, box: Box) -> torch.Tensor:
        """The base values of ``box``: a modules_to_save replacement when the adapter has one
        (an untied alias without one reads the tensor it was tied to)."""
        replacement = self.adapter.replacements.get(name)
        if replacement is not None:
            return replacement[tuple(slice(a, b) for a, b in box)]
        return self.base.read(self.adapter.untied.get(name, name), box)

    def _check(self, name: str, values: torch.Tensor, accumulated: torch.Tensor | None = None) -> None:
        """With ``check_finite``: ``values`` (as written, in the output dtype) must be finite; when the
        fp32 ``accumulated`` values they were cast from are finite, the cast overflowed the dtype."""
        if not self.config.check_finite or all_finite(values):
            return
        if accumulated is not None and all_finite(accumulated):
            limit = torch.finfo(values.dtype).max
            raise MergeError(f"merged {name} overflows {str(values.dtype).removeprefix('torch.')} (|value| > {limit:g} "
                             f"becomes Inf); check the adapter's scaling (lora_alpha / r) or merge to a wider dtype")
        raise MergeError(f"merged {name} has NaN or Inf values; check the adapter factors and the base")

    def touches(self, name: str, box: Box) -> bool:
        """Whether the adapter changes any value of ``box`` of ``name`` (a term, DoRA or a replacement)."""
        adapter = self.adapter
        if name in self._fp8.values_of:  # scales change with their values
            return name in self.changed_names()
        if name in adapter.replacements or name in adapter.dora_magnitudes:
            return True
        (r0, r1) = box[0]
        if any(bool(((o.indices >= r0) & (o.indices < r1)).any()) for o in adapter.row_overrides.get(name, ())):
            return True
        return bool(term_parts(adapter.terms.get(name, ()), box))

    def iter_tensors(self, target: str = "hf-fused") -> Iterator[tuple[str, torch.Tensor]]:
        """Whole merged tensors in layer order, in naming ``target`` (see ``targets.TARGETS``).

        Each yielded tensor is new (the caller may keep it); memory held at once: one target tensor.
        Raises ``MergeError`` for an unknown target.
        """
        for meta in self._owned:
            shape = self._base_metas[meta.name].shape
            if meta.covered_box() != full_box(shape):
                raise MergeError(f"iter_tensors needs whole tensors; {meta.name} is owned as box {meta.box}")
            for piece in target_pieces(target, meta.name, shape, self.layout):
                buf = torch.empty(box_shape(piece.box), dtype=self.out_dtype(meta.name))
                self.fill(meta.name, piece.box, buf)
                yield piece.name, piece.to_target(buf).contiguous()
