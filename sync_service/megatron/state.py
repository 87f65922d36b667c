"""One Megatron-Core rank's weight-sync state: its base boxes in the engines' names, factor snapshots, merged sources.

The ``SyncState`` of ``live.endpoint.TrainerEndpoint`` over a live Megatron model with Megatron-Bridge LoRA. Built from
the rank's placements (``placement.py``: Megatron's parallel state and parameter attributes) mapped to hf-fused
``Segment``s (``targets.py``); it owns the segments of the boxes it sends (``Placement.sender``: one rank per box).
``snapshot(v)`` copies the rank's adapter shards (r-thin; the base is frozen under LoRA and read in place);
``source(v)`` checks that replicas agree, gathers the factors the split requires (``factors.py``) and returns a
``MergedSource`` whose base is ``MegatronBase``: per segment the rank's own base rows / columns plus
(alpha/dim)·B_rows @ A_cols (Bridge's ``linear_out`` rows, ``linear_in`` columns), accumulated in the send's
``accumulate_dtype`` and cast once into the bucket (or quantized to block FP8) by ``MergedSource``. The experts'
``linear_fc2`` at expert-TP > 1 serves what the installed Bridge's forward computes there (``deviations.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from protocols.params import Box, ParamMeta
from sync_service.dtypes import wire_dtype
from sync_service.megatron.factor_terms import TermSpec, exchange, structure, term_values
from sync_service.megatron.factors import GroupGather, local_cols, local_rows, mirror_groups
from sync_service.megatron.placement import Placement, PlacementError, local_placements
from sync_service.megatron.targets import Segment, geometry_of, segments_of
from sync_service.merge.source import MergeConfig, MergedSource
from sync_service.sharding.replicas import ReplicaCheck, ReplicaPart
from sync_service.sharding.snapshots import Snapshots

__all__ = ["MegatronState", "MegatronBase"]


@dataclass(frozen=True, slots=True)
class _Term:
    """The LoRA term of one segment: scale · B[rows] @ A[:, cols]."""

    a: str
    """``linear_in`` parameter name (local)."""
    b: str
    a_cols: tuple[int, int] | None
    """Local columns of A to read, or ``None``: from the gathered A (``a_key``)."""
    b_rows: torch.Tensor | None
    """Local rows of B to read, or ``None``: from the gathered B (``b_key``) or the block-diagonal rule."""
    a_key: str
    b_key: str
    scale: float
    rule: str
    """``"dense"`` or ``"blockdiag"`` (``deviations.py``)."""
    etp: int
    b_box: tuple[int, int]
    """B's local rows' global range (the block-diagonal rule)."""
    span: tuple[int, int]
    """The segment's rows (positions in its box) the term adds to: all, or B's own rows (block-diagonal rule)."""


def _unwrap(chunks) -> list:
    return [getattr(c, "module", c) for c in (chunks if isinstance(chunks, (list, tuple)) else [chunks])]


class MegatronBase:
    """``merge.base.BaseProvider`` whose ``read`` returns merged values of the rank's segments (accumulation dtype)."""

    def __init__(self, state: "MegatronState", factors: dict[str, torch.Tensor], gathered: dict[str, torch.Tensor],
                 accumulate: torch.dtype, *, raw: bool = False) -> None:
        self._state, self._factors, self._gathered, self._acc, self._raw = state, factors, gathered, accumulate, raw
        self._metas = {}
        for seg in state.segments:
            self._metas.setdefault(seg.hf, ParamMeta(seg.hf, state.dtype_of(seg), seg.shape))
        self._cached: tuple[int, torch.Tensor] | None = None

    @property
    def device(self) -> torch.device:
        return self._state.device

    def metas(self) -> list[ParamMeta]:
        return list(self._metas.values())

    def read(self, name: str, box: Box) -> torch.Tensor:
        for i in self._state.by_name.get(name, ()):
            seg = self._state.segments[i]
            if all(a <= x and y <= b for (x, y), (a, b) in zip(box, seg.box)):
                if self._cached is None or self._cached[0] != i:
                    self._cached = (i, self._merged(i, seg))
                return self._cached[1][tuple(slice(x - a, y - a) for (x, y), (a, _) in zip(box, seg.box))]
        raise KeyError(f"{name} {box}: not a box this Megatron rank holds")

    def _merged(self, i: int, seg: Segment) -> torch.Tensor:
        param = self._state.params[seg.param].detach()
        w = param.index_select(0, seg.local_rows.to(param.device))
        if seg.cols is not None:
            (c0, c1), _ = seg.cols
            w = w[:, c0:c1]
        out = w.to(self._acc, copy=True)
        term = None if self._raw else self._state.terms.get(i)
        if term is not None:
            x, y = self.factors_of(seg, term)
            out[term.span[0]:term.span[1]].add_(term.scale * (x.to(self._acc) @ y.to(self._acc)))
        return out.unsqueeze(0) if seg.expert_dim else out

    def factors_of(self, seg: Segment, t: _Term) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) of segment ``seg``'s term: ``linear_out`` rows [span, dim] (ETP times this rank's own rows under the
        block-diagonal rule), ``linear_in`` columns [dim, cols]."""
        (_, (g0, g1)) = seg.cols
        device = self._state.device
        a = self._factors[t.a][:, t.a_cols[0]:t.a_cols[1]] if t.a_cols else self._gathered[t.a_key][:, g0:g1].to(device)
        if t.rule == "blockdiag":  # W + ETP·s·blockdiag(B_r A_r): this rank's B rows only, ETP times
            rows = seg.global_rows[t.span[0]:t.span[1]]
            b = t.etp * self._factors[t.b][rows - t.b_box[0]]
        elif t.b_rows is not None:
            b = self._factors[t.b].index_select(0, t.b_rows.to(device))
        else:
            b = self._gathered[t.b_key].index_select(0, seg.global_rows).to(device)
        return b, a


@dataclass(frozen=True, slots=True)
class _Snapshot:
    version: int
    factors: dict[str, torch.Tensor]


class MegatronState:
    """See the module docstring. Construction is local (no collective); ``prepare()`` runs the collectives once.

    Args:
        chunks: the rank's model chunks (``provide_distributed_model``'s list, or one module).
        config: the HF ``config.json`` dict the model was converted from (geometry, the engines' layout).
        alpha: Bridge LoRA alpha where the adapter modules carry none (``None``: theirs).
        group, rank, world: weightsync's process group over the job's ranks, this rank's index, its size.
        timeout_s: bound of each collective.
        fc2_rule: ``deviations.expert_fc2_rule`` for this run's expert-TP.

    Raises:
        PlacementError: a parameter whose placement or name weightsync cannot read (named). ValueError: no alpha, or
            one that differs from the modules'; a segment whose name or shape the engines' model does not have.
    """

    def __init__(self, chunks, *, config: dict, alpha: float | None, group, rank: int, world: int, timeout_s: float,
                 fc2_rule: str) -> None:
        from megatron.core import parallel_state as ps

        from sync_service.merge.derive import layout_for, memory_shapes

        self.chunks, self.group, self.rank, self.world, self.timeout_s = _unwrap(chunks), group, rank, world, timeout_s
        self.merge = MergeConfig()
        self.params = {n: p for c in self.chunks for n, p in c.named_parameters()}
        self.placements = {p.name: p for p in local_placements(self.chunks)}
        self.etp = ps.get_expert_tensor_parallel_world_size()
        layout, geometry = layout_for(config), geometry_of(config)
        experts = config.get("num_experts") or config.get("num_local_experts")
        tied = bool(config.get("tie_word_embeddings"))
        self.segments: list[Segment] = []
        for p in self.placements.values():
            if p.role != "base" or not p.sender or (tied and p.key == "output_layer.weight"):
                continue
            self.segments.extend(segments_of(p, geometry=geometry, layout=layout, num_experts=experts))
        self.by_name: dict[str, list[int]] = {}
        for i, seg in enumerate(self.segments):
            self.by_name.setdefault(seg.hf, []).append(i)
        self._shapes = memory_shapes(config)
        _check_names(self.segments, self._shapes)
        self.adapters = sorted(n for n, p in self.placements.items() if p.role != "base")
        self._needs: dict[str, dict[str, tuple[Placement, torch.Tensor]]] = {"dense": {}, "expert": {}}
        self.terms = {i: self._term(seg, alpha, fc2_rule) for i, seg in enumerate(self.segments)}
        self.terms = {i: t for i, t in self.terms.items() if t is not None}
        self.changed = frozenset(self.segments[i].hf for i in self.terms)
        self.gathers: dict[str, GroupGather] = {}
        self._snapshots: Snapshots[_Snapshot] = Snapshots(f"Megatron trainer rank {rank}")
        self._full_next = True
        self._all_check: ReplicaCheck | None = None
        self._adapter_check: ReplicaCheck | None = None
        self._adapter_parts: list[tuple[str, tuple]] = []
        self._own_specs: dict[int, TermSpec] = {}
        self._all_specs: list[TermSpec] = []
        self._slot: dict[TermSpec, int] = {}

    # -- construction --------------------------------------------------------------------------------------------
    def _term(self, seg: Segment, alpha: float | None, fc2_rule: str) -> _Term | None:
        prefix = seg.param.removesuffix(".weight").removesuffix(".to_wrap")
        a, b = f"{prefix}.adapter.linear_in.weight", f"{prefix}.adapter.linear_out.weight"
        if a not in self.placements or seg.cols is None:
            return None
        pa, pb = self.placements[a], self.placements[b]
        module = self._adapter_module(prefix)
        scale = _scale(prefix, module, alpha)
        expert = ".mlp.experts." in seg.param
        rule = fc2_rule if expert and prefix.endswith("linear_fc2") else "dense"
        (_, cols) = seg.cols
        a_cols = local_cols(pa, cols)
        b_rows = None if rule == "blockdiag" else local_rows(pb, seg.global_rows)
        where = self._needs["expert" if expert else "dense"]
        if a_cols is None:
            where[pa.key] = (pa, self.params[a])
        if b_rows is None and rule != "blockdiag":
            where[pb.key] = (pb, self.params[b])
        b_box = tuple(pb.pieces[0][0][0]) if rule == "blockdiag" else (0, 0)
        span = (0, len(seg.global_rows))
        if rule == "blockdiag":
            inside = ((seg.global_rows >= b_box[0]) & (seg.global_rows < b_box[1])).nonzero().flatten()
            span = (int(inside.min()), int(inside.max()) + 1) if len(inside) else (0, 0)
            if span[1] - span[0] != len(inside):
                raise PlacementError(f"{prefix}: its linear_out rows are not contiguous in {seg.hf}")
        return _Term(a=a, b=b, a_cols=a_cols, b_rows=b_rows, a_key=pa.key, b_key=pb.key, scale=scale, rule=rule,
                     etp=self.etp, b_box=b_box, span=span)

    def _adapter_module(self, prefix: str):
        for chunk in self.chunks:
            try:
                return chunk.get_submodule(f"{prefix}.adapter")
            except AttributeError:
                continue
        raise PlacementError(f"{prefix}.adapter: no such module in the rank's model chunks")

    def prepare(self) -> None:
        """The collectives of attach, once, on every rank: weightsync's mirrors of Megatron's tensor- and expert-
        tensor-parallel groups, the factor gathers' exchange, and the replica check of every replicated tensor
        (base and adapter: norms, the router, TP-replicated factors, data-parallel copies).

        Raises:
            ValueError: the group's ranks disagree on what to gather. ReplicasDisagreeError: replicas differ (named).
        """
        from megatron.core import parallel_state as ps

        if self.world > 1:
            dense, expert = mirror_groups([ps.get_tensor_model_parallel_group(),
                                           ps.get_expert_tensor_parallel_group()], group=self.group, world=self.world,
                                          timeout_s=self.timeout_s)
            for kind, group in (("dense", dense), ("expert", expert)):
                if group is not None:
                    self.gathers[kind] = GroupGather(self._needs[kind], group=group, timeout_s=self.timeout_s)
                    self.gathers[kind].exchange()
                elif self._needs[kind]:
                    raise ValueError(f"factors {sorted(self._needs[kind])[:3]} need a gather but their group has one rank")
            parts = [(ReplicaPart(p.key, str(box)), name, index) for name, p in self.placements.items()
                     for box, index in p.pieces]
            self._all_check = ReplicaCheck([x for x, _, _ in parts], group=self.group, rank=self.rank,
                                           world=self.world, timeout_s=self.timeout_s)
            self._all_check.check([self._value(self.params[n], index) for _, n, index in parts], what="attach")
            per_push = [(x, n, index) for x, n, index in parts if self._checked_per_push(n)]
            self._adapter_parts = [(n, index) for _, n, index in per_push]
            self._adapter_check = ReplicaCheck([x for x, _, _ in per_push], group=self.group, rank=self.rank,
                                               world=self.world, timeout_s=self.timeout_s)
        self._own_specs = {i: self._spec(i) for i in self.terms}
        self._all_specs = exchange(list(self._own_specs.values()), group=self.group, world=self.world,
                                   timeout_s=self.timeout_s)
        counts: dict[str, int] = {}
        for spec in self._all_specs:
            self._slot[spec] = counts.get(spec.name, 0)
            counts[spec.name] = self._slot[spec] + 1

    def _checked_per_push(self, name: str) -> bool:
        """Replicas checked on every push: the adapters (they train) and the small replicated base tensors, norms and
        the router (1-D, or ``mlp.router.weight``); the large base boxes once, at attach (frozen under LoRA)."""
        p = self.placements[name]
        return p.role != "base" or len(p.global_shape) == 1 or p.key.endswith("mlp.router.weight")

    def _spec(self, i: int) -> TermSpec:
        """Segment ``i``'s term as factor streaming names it (hf-fused rows / cols, experts, rank, scaling)."""
        seg, t = self.segments[i], self.terms[i]
        h0 = seg.box[1 if seg.expert_dim else 0][0]
        return TermSpec(seg.hf, tuple(seg.box[0]) if seg.expert_dim else (-1, -1), (h0 + t.span[0], h0 + t.span[1]),
                        tuple(seg.box[-1]), self.placements[t.a].global_shape[0], t.scale)

    # -- factor streaming (FactorTrainer's view of the state) -------------------------------------------------
    def structure(self):
        """Every rank's terms with zero factors (``factor_terms.structure``), one order on every rank."""
        return structure(self._all_specs)

    @property
    def base(self):
        """The tensors of every rank's segments and terms, whole (``metas()``: global shapes, this rank's dtype)."""
        return _Metas(self)

    @property
    def factors(self) -> dict:
        """Adapter parameter name → an object whose ``param`` is the live parameter (its dtype: the recipes' wire)."""
        from types import SimpleNamespace

        return {n: SimpleNamespace(param=self.params[n]) for n in self.adapters}

    @staticmethod
    def _value(t: torch.Tensor, index) -> torch.Tensor:
        return (t[index] if index else t).detach()

    # -- SyncState ----------------------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return next(iter(self.params.values())).device

    def dtype_of(self, seg: Segment) -> str:
        return wire_dtype(self.params[seg.param].dtype)

    def owned(self) -> list[ParamMeta]:
        return [ParamMeta(s.hf, self.dtype_of(s), s.shape, s.box) for s in self.segments]

    def snapshot(self, version: int) -> frozenset[str] | None:
        changed = None if self._full_next else self.changed
        factors = {n: self.params[n].detach().clone() for n in self.adapters}
        self._snapshots.put(version, _Snapshot(version, factors))
        self._full_next = False
        return changed

    def drop_snapshot(self, version: int) -> None:
        self._snapshots.drop(version)

    def force_full(self) -> None:
        self._full_next = True

    def source(self, version: int, *, whole_adapter: bool = False) -> MergedSource:
        """The merged source of ``version``'s snapshot (collective: the replica check, the factor gathers).
        ``whole_adapter`` (factor streaming): the source's base is the pristine base and its adapter holds every
        rank's terms (``structure()``), this rank's with their values.

        Raises:
            KeyError: no snapshot of ``version``. ReplicasDisagreeError: replicated factors, norms or router weights
                differ (named)."""
        snap = self._snapshots.take(version)
        if self._adapter_check is not None:
            self._adapter_check.check([self._value(snap.factors.get(n, self.params[n]), index)
                                       for n, index in self._adapter_parts], what=f"push of version {version}")
        gathered: dict[str, torch.Tensor] = {}
        for kind, gather in self.gathers.items():
            names = {p.key: name for name, p in self.placements.items() if p.key in gather.placements}
            gathered.update(gather.gather({k: snap.factors[names[k]] for k in gather.keys}))
        acc = torch.float64 if self.merge.accumulate_dtype == "float64" else torch.float32
        base = MegatronBase(self, snap.factors, gathered, acc, raw=whole_adapter)
        if not whole_adapter:
            return MergedSource(base, None, config=self.merge, owned=self.owned())
        adapter = self.structure()
        for i, spec in self._own_specs.items():
            x, y = base.factors_of(self.segments[i], self.terms[i])
            adapter.terms[spec.name][self._slot[spec]] = term_values(spec, x, y)
        return MergedSource(base, adapter, config=self.merge, owned=self.owned())


class _Metas:
    """``metas()`` of every tensor a rank's segments or any rank's terms name (global shapes: the HF model's)."""

    def __init__(self, state: MegatronState) -> None:
        self._state = state

    def metas(self) -> list[ParamMeta]:
        st = self._state
        dtype = wire_dtype(next(iter(st.params.values())).dtype)
        names = sorted({s.name for s in st._all_specs} | {seg.hf for seg in st.segments})
        return [ParamMeta(n, dtype, tuple(st._shapes[n])) for n in names]


def _scale(prefix: str, module, alpha: float | None) -> float:
    """alpha / dim of a Bridge adapter module (its own ``alpha`` and ``dim``; ``alpha`` where it has none).

    Raises:
        ValueError: neither carries alpha, or both and they differ, or alpha / dim is not finite (NaN, inf, dim 0)."""
    dim, own = getattr(module, "dim", None), getattr(module, "alpha", None)
    if dim is None:
        raise ValueError(f"{prefix}.adapter has no dim: not a Megatron-Bridge LoRA adapter")
    if own is not None and alpha is not None and float(own) != float(alpha):
        raise ValueError(f"lora_alpha={alpha} differs from {prefix}.adapter.alpha {own}; drop lora_alpha")
    value = own if own is not None else alpha
    if value is None:
        raise ValueError(f"{prefix}.adapter carries no alpha; give attach_megatron(lora_alpha=...) (Bridge's "
                         f"LoRA(alpha=...))")
    scale = float(value) / float(dim) if float(dim) > 0 else float("nan")
    if not math.isfinite(scale):  # a NaN / inf alpha would reach the engines only as non-finite merged weights
        raise ValueError(f"{prefix}.adapter: alpha {value!r} / dim {dim!r} is no finite LoRA scale; give "
                         f"attach_megatron(lora_alpha=...) the finite alpha Bridge's LoRA(alpha=...) was built with")
    return scale


def _check_names(segments: list[Segment], shapes: dict[str, tuple[int, ...]]) -> None:
    """Every segment names a tensor of the engines' model with its shape.

    Raises:
        ValueError: naming the first segment that does not."""
    for seg in segments:
        if tuple(shapes.get(seg.hf, ())) != tuple(seg.shape):
            raise ValueError(f"{seg.param} maps to {seg.hf} {list(seg.shape)}, which the HF model of hf_config holds "
                             f"as {list(shapes[seg.hf]) if seg.hf in shapes else 'nothing'}; give the HF config the "
                             f"Megatron model was converted from")
