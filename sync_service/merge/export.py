"""Stream a merged checkpoint to safetensors shards, as ``save_pretrained`` lays them out.

Validates everything (config, family, base keys, adapter keys and shapes, target, dtype) before
the output exists; writes into a temporary sibling directory and renames it at the end, so a
failure leaves nothing at ``out_dir``. Peak memory: one shard buffer, not the model.

One buffer the size of the largest shard is allocated once and reused for every shard: each target
tensor is a view of it that ``MergedSource.fill`` writes into (no per-tensor allocation, no extra
copy), and ``save_file`` writes the views from their pointers.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import save_file

from protocols.params import MERGE_DTYPES
from sync_service.dtypes import TORCH_DTYPES
from sync_service.merge.adapter import load_adapter
from sync_service.merge.base import SafetensorsBase
from sync_service.merge.errors import MergeError
from sync_service.merge.export_fp8 import Fp8Options, Fp8Writer, check_quantize, quantized_names, write_quantization_config
from sync_service.merge.fp8_base import open_base
from sync_service.merge.inputs import read_json_object, read_safetensors
from sync_service.merge.source import MergeConfig, MergedSource
from sync_service.merge.targets import TARGETS, Piece, target_pieces
from sync_service.merge.terms import LoraAdapter
from sync_service.merge.vocab import ResizedBase, plan_resize

COPIED_FILES = (  # non-weight files of a model directory, copied to the output when present
    "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja",
    "chat_template.json", "preprocessor_config.json", "processor_config.json",
)
_FLOAT_DTYPES = tuple(sorted(MERGE_DTYPES))


_ALIGN = 8  # bytes; every tensor view of the shard buffer starts aligned for any dtype


MIN_STAGING_BYTES = 8
"""Smallest fp32 scratch budget, bytes: one float64 element (the scratch of a float64 base)."""


def _check_out_parent(out_dir: Path) -> None:
    """The nearest existing ancestor of ``out_dir`` must be a directory this process can create a directory in
    (``out_dir`` is created below it); raises ``MergeError`` naming ``--out`` and the ancestor."""
    parent = out_dir.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise MergeError(f"--out {out_dir}: {parent} is a file, not a directory; choose an --out under a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise MergeError(f"--out {out_dir}: {parent} is not writable; choose an --out under a writable directory")
    try:  # os.access says yes to root on /proc and read-only mounts: make (and remove) a directory there
        os.rmdir(tempfile.mkdtemp(prefix=".weightsync-probe-", dir=parent))
    except OSError as exc:
        raise MergeError(f"--out {out_dir}: cannot create a directory in {parent} ({exc.strerror or exc}); "
                         f"choose an --out under a writable directory") from None


class _PlainWriter:
    """One output tensor per target piece, in the source's out dtype (``Fp8Writer``: a quantized merge)."""

    def __init__(self, source: MergedSource):
        self.source = source

    def outputs(self, name: str, piece: Piece) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        return [(piece.name, self.source.out_dtype(name), piece.shape)]

    def fill(self, name: str, piece: Piece, views: list[torch.Tensor]) -> None:
        self.source.fill(name, piece.box, piece.from_target(views[0]))


def _plan_shards(source: MergedSource, writer, target: str, max_shard_bytes: int) -> list[list[tuple[str, Piece]]]:
    """``(hf-fused name, target piece)`` grouped into shards, in layer order (greedy, like ``save_pretrained``)."""
    shards: list[list[tuple[str, Piece]]] = [[]]
    size = 0
    for meta in source.param_metas():
        for piece in target_pieces(target, meta.name, meta.shape, source.layout):
            nbytes = sum(_nbytes(out) for out in writer.outputs(meta.name, piece))
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append((meta.name, piece))
            size += nbytes
    return shards


def _nbytes(output: tuple[str, torch.dtype, tuple[int, ...]]) -> int:
    _, dtype, shape = output
    return math.prod(shape) * dtype.itemsize


def _padded(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _resized(base: SafetensorsBase, adapter_dir: Path):
    """``base``, or a ``ResizedBase`` with the adapter's vocabulary shapes when the adapter was trained
    on a resized vocabulary (``vocab.plan_resize``: PEFT's resize_token_embeddings before loading)."""
    from safetensors import safe_open

    weights = adapter_dir / "adapter_model.safetensors"
    if not weights.is_file():
        return base  # load_adapter says what is missing

    def shapes(path: str) -> dict[str, tuple[int, ...]]:
        with safe_open(path, "pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}

    resize = plan_resize(read_safetensors(weights, shapes), base.metas(), base.layout, base.tied_aliases)
    return ResizedBase(base, resize) if resize else base


def _open_base(base_dir: Path, adapter_dir: Path | None, dtype: str | None, quantize: str | None):
    """The merge's base (``fp8_base.open_base``: a block-FP8 one reads dequantized; ``_resized``) and output dtype:
    ``dtype``, else bfloat16 with ``quantize``, else a block-FP8 base's ``dequantized_dtype``, else ``None``."""
    checkpoint = open_base(base_dir)
    dtype = dtype or ("bfloat16" if quantize else getattr(checkpoint, "dequantized_dtype", None))
    return (checkpoint if adapter_dir is None else _resized(checkpoint, adapter_dir)), dtype


def _vocab_size(base) -> int | None:
    """V' of a ``ResizedBase`` (written to config.json), else ``None``."""
    return next((shape[0] for shape in base.shapes.values()), None) if isinstance(base, ResizedBase) else None


def _write_config(base_dir: Path, out: Path, dtype: str | None, untied: bool, vocab_size: int | None = None) -> None:
    """The base's config.json with ``dtype`` set, ``tie_word_embeddings`` false when the adapter
    untied the embeddings (where the base config has the flag: top level or ``text_config``), and
    ``vocab_size`` set where the config has it when the adapter resized the vocabulary; without the base's
    ``quantization_config`` (the output is dequantized, or ``write_quantization_config`` writes its own)."""
    config = read_json_object(base_dir / "config.json")
    config.pop("quantization_config", None)
    if vocab_size is not None:
        for cfg in (config, config.get("text_config")):
            if isinstance(cfg, dict) and "vocab_size" in cfg:
                cfg["vocab_size"] = vocab_size
    if dtype is not None:
        for key in ("dtype", "torch_dtype"):
            if key in config or key == "dtype":
                config[key] = dtype
    if untied:
        for cfg in (config, config.get("text_config")):
            if isinstance(cfg, dict) and cfg.get("tie_word_embeddings"):
                cfg["tie_word_embeddings"] = False
        config["tie_word_embeddings"] = False
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for name in COPIED_FILES:
        if (base_dir / name).is_file():
            shutil.copy2(base_dir / name, out / name)


def _progress(total: int, enabled: bool | None):
    from sync_service.merge.progress import bar

    return bar(total, enabled=enabled, unit="tensor", desc="merge")


def _check_arguments(target: str, dtype: str | None, max_shard_bytes: int, staging_bytes: int, out_dir: Path) -> None:
    """The options and ``out_dir`` of ``merge_checkpoint``; raises ``MergeError`` naming the flag."""
    if target not in TARGETS:
        raise MergeError(f"unknown --target {target!r}; known: {', '.join(sorted(TARGETS))}")
    if dtype is not None and dtype not in _FLOAT_DTYPES:
        raise MergeError(f"--dtype {dtype!r} not supported; use one of {', '.join(_FLOAT_DTYPES)}")
    if max_shard_bytes <= 0:
        raise MergeError(f"--max-shard-size must be positive, got {max_shard_bytes} bytes")
    if staging_bytes < MIN_STAGING_BYTES:
        raise MergeError(f"--staging-size must be at least {MIN_STAGING_BYTES} bytes, got {staging_bytes}; use e.g. 64MiB")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise MergeError(f"--out {out_dir} exists and is not an empty directory; remove it or choose another path")
    _check_out_parent(out_dir)


def merge_checkpoint(
    base_dir: str | Path,
    adapter_dir: str | Path | None,
    out_dir: str | Path,
    *,
    target: str = "hf",
    dtype: str | None = None,
    max_shard_bytes: int = 5 * 10**9,
    progress: bool | None = None,
    staging_bytes: int = 64 << 20,
    accumulate_dtype: str = "float32",
    quantize: str | None = None,
    fp8: Fp8Options | None = None,
    on_merge: Callable[[], None] | None = None,
) -> dict:
    """Merge a PEFT LoRA adapter into a safetensors checkpoint and write the result.

    Output: ``model.safetensors`` or ``model-0000k-of-0000n.safetensors`` + ``model.safetensors.index.json``,
    ``config.json`` (``dtype`` updated when ``dtype`` is given; ``vocab_size`` when the adapter was trained
    on a resized vocabulary, whose embeddings it holds: ``vocab.py``) and the tokenizer/generation files found.

    Args:
        adapter_dir: the PEFT adapter; ``None`` writes the base itself (in ``dtype``, or quantized: an FP8 copy).
        dtype: output dtype name (``"bfloat16"``, ``"float16"``, ``"float32"``); ``None`` keeps the base's
            (with ``quantize``: ``"bfloat16"``, the dtype of the tensors left unquantized, as FP8 checkpoints ship;
            a block-FP8 base, merged dequantized by ``fp8_base.py``: its config's dtype, as transformers loads it).
        accumulate_dtype: ``MergeConfig.accumulate_dtype`` (``"float64"``: bitwise PEFT's float64 merge, cast once).
        quantize: ``"fp8"`` writes block FP8 as transformers does (``export_fp8.py``); ``None`` does not quantize.
        fp8: block size and scale format for ``quantize="fp8"`` (default ``Fp8Options()``: 128x128, float32 scales).
        max_shard_bytes: largest shard, bytes (a single larger tensor gets a shard of its own).
        progress: tqdm bar; ``None`` shows it when stderr is a terminal.
        on_merge: called once everything is read and checked, as the merge starts (the CLI closes its reading bar).

    Returns:
        ``{"tensors": n, "bytes": total, "shards": k, "seconds": t, "setup_seconds": t0, "changed": c}``, counted as
        written to disk (``changed``: those the adapter alters, e.g. every per-expert key of a fused expert tensor
        with LoRA; ``tensors`` counts FP8 scales too); ``setup_seconds``: validation and adapter loading (PEFT's
        import: seconds on a cold start). A quantized merge adds ``_fp8_counts``' keys and ``"quantized"``.

    Raises:
        MergeError: any bad input, or ``out_dir`` exists and is not empty, or a merged value is NaN
            or ±Inf (also an overflow of ``dtype``); nothing is left at ``out_dir`` then.
    """
    t0 = time.perf_counter()
    base_dir, out_dir = Path(base_dir), Path(out_dir)
    adapter_dir = None if adapter_dir is None else Path(adapter_dir)
    _check_arguments(target, dtype, max_shard_bytes, staging_bytes, out_dir)
    check_quantize(quantize, fp8)
    fp8 = (fp8 or Fp8Options()) if quantize else None
    base, dtype = _open_base(base_dir, adapter_dir, dtype, quantize)
    source, writer = _source_and_writer(base, adapter_dir, dtype, fp8, MergeConfig(
        out_dtype=dtype, staging_bytes=staging_bytes, check_finite=True, accumulate_dtype=accumulate_dtype))
    shards = _plan_shards(source, writer, target, max_shard_bytes)
    if fp8 is not None:
        _check_something_quantized(writer, shards, fp8)
    setup_s = time.perf_counter() - t0
    if on_merge is not None:
        on_merge()
    total = _write_output(source, writer, target, shards, base_dir, out_dir, dtype, progress, fp8)
    return _summary(source, writer, shards, total, time.perf_counter() - t0, setup_s)


def _source_and_writer(base, adapter_dir: Path | None, dtype: str | None, fp8: Fp8Options | None, config: MergeConfig):
    """The merge's ``MergedSource`` over ``base`` and the adapter (none: the base as is, cast or an FP8 copy), and its
    writer (``Fp8Writer`` with ``fp8``: transformers' quantized names merged in the accumulation dtype)."""
    adapter = (LoraAdapter() if adapter_dir is None
               else load_adapter(adapter_dir, base.layout, base.metas(), tied_aliases=base.tied_aliases))
    quantized = quantized_names(base.config, fp8) if fp8 else frozenset()
    config = replace(config, out_dtypes={name: config.accumulate_dtype for name in quantized})
    source = MergedSource(base, adapter, config=config)
    return source, (Fp8Writer(source, fp8, quantized, TORCH_DTYPES[dtype]) if fp8 else _PlainWriter(source))


def _check_something_quantized(writer, shards: list[list[tuple[str, Piece]]], fp8: Fp8Options) -> None:
    """Raises MergeError (before anything is written) when no tensor would be FP8: the block divides none of the
    tensors transformers quantizes (a small model under the default 128 x 128), or it quantizes none."""
    pieces = [(n, p) for shard in shards for n, p in shard if n in writer.quantized]
    if any(len(writer.outputs(n, p)) == 2 for n, p in pieces):
        return
    if not pieces:
        raise MergeError("--quantize fp8: transformers quantizes no tensor of this model (no nn.Linear / FP8 "
                         "experts it replaces); nothing would be FP8 — merge without --quantize")
    block = ",".join(map(str, fp8.weight_block_size))
    piece = pieces[0][1]
    raise MergeError(f"--quantize fp8: --weight-block-size {block} divides none of the tensors transformers quantizes "
                     f"(e.g. {piece.name} {list(piece.shape)}); nothing would be FP8 — pass a block that divides them, "
                     f"e.g. --weight-block-size {_block_hint(pieces)}")


def _block_hint(pieces: list[tuple[str, Piece]]) -> str:
    """``"s,s"``: the largest power-of-two square block (at most 128) that divides the last two dims of every piece."""
    common = math.gcd(*(d for _, p in pieces for d in p.shape[-2:]))
    side = min(128, common & -common)
    return f"{side},{side}"


def _fp8_counts(writer, pieces: list[tuple[str, Piece]]) -> dict:
    """The summary's keys of a quantized merge (``merge_checkpoint``) beside ``"quantized"`` (the FP8 weights
    written): ``"quantizable"``, the weights of the modules transformers quantizes (the block divides
    ``"quantized"`` of them), and when some are left unquantized ``"unquantized"``: ``{"example": "name [shape]",
    "block_hint": "r,c" (a block that divides them all), "dtype": the dtype they are written in}``."""
    quantizable = [(n, p) for n, p in pieces if n in writer.quantized]
    left = [(n, p) for n, p in quantizable if len(writer.outputs(n, p)) == 1]
    out = {"quantizable": len(quantizable)}
    if left:
        out["unquantized"] = {"example": f"{left[0][1].name} {list(left[0][1].shape)}", "block_hint": _block_hint(quantizable),
                              "dtype": str(writer.plain_dtype).removeprefix("torch.")}
    return out


def _summary(source: MergedSource, writer, shards: list[list[tuple[str, Piece]]], total: int, seconds: float,
             setup_s: float) -> dict:
    pieces = [(name, piece) for shard in shards for name, piece in shard]
    summary = {"tensors": sum(len(writer.outputs(n, p)) for n, p in pieces), "bytes": total, "shards": len(shards),
               "seconds": seconds, "setup_seconds": setup_s,
               "changed": sum(source.touches(name, piece.box) for name, piece in pieces)}
    return summary | ({"quantized": writer.quantized_pieces, **_fp8_counts(writer, pieces)} if isinstance(writer, Fp8Writer) else {})


def _write_output(source: MergedSource, writer, target: str, shards: list[list[tuple[str, Piece]]], base_dir: Path,
                  out_dir: Path, dtype: str | None, progress: bool | None, fp8: Fp8Options | None = None) -> int:
    """Write shards + config into a temporary sibling of ``out_dir``, then rename it to ``out_dir``
    (``_publish``). On any failure the temporary directory and the parents this call created (while
    still empty) are removed; ``out_dir`` is left as it was. Returns bytes."""
    parents = [p for p in out_dir.absolute().parents if not p.exists()]
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        total = _write_shards(writer, shards, tmp, progress)
        _write_config(base_dir, tmp, dtype, bool(source.adapter.untied), _vocab_size(source.base))
        if fp8 is not None:
            write_quantization_config(tmp / "config.json", fp8)
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)  # mkdtemp makes 0700; the output is an ordinary directory
        for path in tmp.iterdir():  # safetensors writes 0600: readable by a server running as another user
            if path.is_file():
                path.chmod(0o666 & ~umask)
        _publish(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for parent in parents:  # innermost first; one another merge wrote into stays
            with contextlib.suppress(OSError):
                parent.rmdir()
        raise
    return total


def _publish(tmp: Path, out_dir: Path) -> None:
    """Rename ``tmp`` to ``out_dir`` in one step: rename(2) replaces an empty directory and refuses a
    non-empty one, so of two merges into one ``--out`` exactly one wins and the other finds it taken
    (no lock file, nothing left inside ``out_dir``).

    Raises:
        MergeError: ``out_dir`` was filled (another merge) or became a file meanwhile.
    """
    try:
        os.rename(tmp, out_dir)
    except OSError as exc:
        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
            raise
        raise MergeError(f"--out {out_dir}: was filled or replaced while this merge ran (another merge into the "
                         f"same --out?); it is left as it is; choose another --out or remove it and merge again") from None


def _write_shards(writer, shards: list[list[tuple[str, Piece]]], out: Path, progress) -> int:
    """Each shard's tensors merged (``writer.fill``) into views of one reused buffer, then saved. Returns bytes."""
    buffer = torch.empty(max(sum(_padded(_nbytes(o)) for n, p in shard for o in writer.outputs(n, p))
                             for shard in shards), dtype=torch.uint8)
    weight_map: dict[str, str] = {}
    total = 0
    with _progress(sum(len(s) for s in shards), progress) as bar:
        for k, shard in enumerate(shards):
            file = "model.safetensors" if len(shards) == 1 else f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
            tensors, offset = {}, 0
            for name, piece in shard:
                views = []
                for key, dtype, shape in writer.outputs(name, piece):
                    nbytes = _nbytes((key, dtype, shape))
                    views.append(buffer[offset:offset + nbytes].view(dtype).view(shape))
                    tensors[key] = views[-1]
                    weight_map[key] = file
                    offset += _padded(nbytes)
                    total += nbytes
                writer.fill(name, piece, views)
                bar.update(1)
            save_file(tensors, str(out / file), metadata={"format": "pt"})
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return total
