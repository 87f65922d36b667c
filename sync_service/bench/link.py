"""The rows across hosts (``LINK_ROW_KINDS``) at one link rate, run by a driver on the trainers' host.

``LinkSite`` says where things are: Ray actor options that place an actor on the trainers' host and
on each engine host, their addresses, and the interfaces whose counters ``bench.wire`` reads.
``run_link_rows`` starts, per size, the trainer shards (EP) on the trainers' host and one engine on
engine host 0, then

  1. ``delta``: merged delta syncs (one untimed first full sync), ``SyncConfig.transport`` =
     ``cfg.link_transport`` bound to the driver's address;
  2. ``factors``, ``auto``: the same with ``mode="factors"`` / ``"auto"`` (a fresh ``WeightSync`` each:
     its first full sync carries the pristine base) — ``LINK_MODES``;
  3. ``delta_fanout2``: a second engine on engine host 1, merged delta syncs to both (``relay="auto"``:
     engine 0 relays every bucket to engine 1); ``delta_fanout2_direct``: the same with ``relay="direct"``;
     ``delta_fp8``: the bf16 engines stopped, merged delta syncs into an engine on engine host 0 loaded from
     the block-FP8 checkpoint of the model (``model.ensure_fp8_engine``, written before the actors start): the
     trainers quantize each merged box into the bucket, so about half the delta's bytes cross the link;
  4. ``floor``: the delta's payload bytes over a plain TCP socket, trainers' host -> engine host 0;
  5. ``gather`` and ``disk`` (``bench.baselines``), the disk checkpoint copied over TCP (``bench.sock``).

Every timed run's bytes are counted at the trainers' uplink (tx) and the engine hosts' links (rx).
"""

from __future__ import annotations

import shutil
import statistics
from dataclasses import dataclass
from pathlib import Path

import ray

from sync_service.bench.baselines import run_disk, run_gather
from sync_service.bench.model import BenchModel, ensure_fp8_engine
from sync_service.bench.ours import PushRuns
from sync_service.bench.rows import BenchConfig, Placement, Row, median_index
from sync_service.bench.sock import LinkEnd
from sync_service.bench.wire import WireMeter
from sync_service.netns import Host

__all__ = ["LINK_MODES", "LinkSite", "run_link_rows"]

LINK_MODES = {"delta": "merged", "factors": "factors", "auto": "auto"}
"""The link rows of one bf16 engine: row kind -> ``SyncConfig.mode``."""


@dataclass(kw_only=True, slots=True)
class LinkSite:
    """The hosts of one link rate, as the driver (on the trainers' host) sees them."""

    trainer: Host
    """The trainers' host (``sync_service.netns``): the driver's listeners (``SyncConfig.bind_host``) bind
    its address; its ``eth0`` is the shaped uplink."""
    engines: tuple[Host, ...]
    """The engine hosts (>= 1; the fan-out row needs 2)."""
    trainer_options: dict
    """Ray actor options placing an actor on the trainers' host (e.g. its node's custom resource)."""
    engine_options: tuple[dict, ...]
    """The same for each engine host, in ``engines`` order."""

    def placement(self) -> Placement:
        return Placement(trainer_options=dict(self.trainer_options), engine_options=tuple(self.engine_options))

    def meter(self) -> WireMeter:
        return WireMeter(self.trainer, self.engines)


def run_link_rows(model: BenchModel, cfg: BenchConfig, size: int, link: str, site: LinkSite, rows: list[Row],
                  launcher, work_dir: Path, guard, say=print) -> None:
    """Append the link rows at ``size`` to ``rows`` (each tagged ``link``); ``guard(what, step)`` runs
    one row and records its failure. Blocks; kills every actor it starts."""
    start = len(rows)
    guard("link ours", lambda: _ours(model, cfg, size, site, rows, launcher, say))
    delta = next((r for r in rows[start:] if r.kind == "delta"), None)
    if delta is not None:
        say(f"  {size}x {link} floor")
        guard("link floor", lambda: rows.append(_floor(delta.bytes, cfg, size, model.shape.bf16_bytes(), site)))
    placement, meter = site.placement(), site.meter()
    guard("link gather", lambda: rows.append(run_gather(model, cfg, size, launcher, say=say, placement=placement,
                                                        meter=meter)))
    guard("link disk", lambda: rows.append(_disk(model, cfg, size, site, work_dir, launcher, say)))
    for r in rows[start:]:
        r.link = link


def _disk(model: BenchModel, cfg: BenchConfig, size: int, site: LinkSite, work_dir: Path, launcher, say) -> Row:
    with _Copier(site, cfg.timeout_s) as copier:
        return run_disk(model, cfg, size, work_dir, launcher, say=say, placement=site.placement(), copy_over=copier,
                        meter=site.meter())


def _ours(model: BenchModel, cfg: BenchConfig, size: int, site: LinkSite, rows: list[Row], launcher, say) -> None:
    placement = site.placement()
    fp8_dir = ensure_fp8_engine(model)
    trainers = launcher.start_trainers(model.base_dir, model.adapter_dir, ep=cfg.ep, timeout_s=cfg.timeout_s,
                                       actor_options=placement.trainer_options)
    engines = launcher.start_engines(model.base_dir, 1, timeout_s=cfg.timeout_s, actor_options=placement.engines(1))
    runs = PushRuns(trainers, cfg, size, model.shape.bf16_bytes(), meter=site.meter(),
                    sync_kw={"transport": cfg.link_transport, "bind_host": site.trainer.address})
    try:
        for kind, mode in LINK_MODES.items():
            say(f"  {size}x {kind} (1 engine host)")
            rows.extend(runs.rows({kind: {"mode": mode}}, engines))
        if len(site.engine_options) > 1:
            say(f"  {size}x delta (2 engines on 2 hosts)")
            engines += launcher.start_engines(model.base_dir, 1, timeout_s=cfg.timeout_s, prefix="fanout",
                                              actor_options=placement.engines(1, first=1))
            rows.extend(runs.rows({"delta_fanout2": True}, engines))
            say(f"  {size}x delta (2 engines on 2 hosts, each from the trainers)")
            rows.extend(runs.rows({"delta_fanout2_direct": {"relay": "direct"}}, engines))
        while engines:  # their memory back first: beside them the FP8 engine's push was killed by Ray at 1x
            ray.kill(engines.pop())
        say(f"  {size}x delta into a block-FP8 engine (1 engine host)")
        engines += launcher.start_engines(fp8_dir, 1, timeout_s=cfg.timeout_s, prefix="fp8",
                                          actor_options=placement.engines(1))
        rows.extend(runs.rows({"delta_fp8": True}, engines))
    finally:
        for actor in [*trainers, *engines]:
            ray.kill(actor)


def _floor(nbytes: int, cfg: BenchConfig, size: int, model_bytes: int, site: LinkSite) -> Row:
    """``repeats`` streams of ``nbytes`` over plain TCP, trainers' host -> engine host 0 (after one
    untimed warm-up stream)."""
    sender = LinkEnd.options(**site.trainer_options).remote(cfg.timeout_s)
    receiver = LinkEnd.options(**site.engine_options[0]).remote(cfg.timeout_s)
    meter, seconds, wire = site.meter(), [], []
    try:
        port = ray.get(receiver.listen.remote(site.engines[0].address), timeout=cfg.timeout_s)
        for i in range(cfg.repeats + 1):
            ray.get(receiver.receive.remote(), timeout=cfg.timeout_s)
            meter.start()
            s = ray.get(sender.send_bytes.remote(site.engines[0].address, port, nbytes), timeout=cfg.timeout_s)
            got = ray.get(receiver.wait.remote(), timeout=cfg.timeout_s)
            w = meter.stop()
            if got != nbytes:
                raise RuntimeError(f"link floor: the receiver got {got} of {nbytes} bytes")
            if i:
                seconds.append(s)
                wire.append(w)
    finally:
        for actor in (sender, receiver):
            ray.kill(actor)
    k = median_index(seconds)
    return Row(kind="floor", size=size, model_bytes=model_bytes, bytes=nbytes, engines=1, seconds=seconds,
               stages={"transfer_s": statistics.median(seconds)}, note="plain TCP, one stream, no header or checksum",
               **wire[k].row_fields())


class _Copier:
    """The disk row's copy: a checkpoint directory over plain TCP to engine host 0, into a sibling
    directory (``<dir>-copied``) its engine reads. Use as a context manager (both ends start once);
    a call returns (that directory, seconds from connect to the receiver's ack)."""

    def __init__(self, site: LinkSite, timeout_s: float) -> None:
        self.address, self.timeout_s = site.engines[0].address, timeout_s
        self.sender = LinkEnd.options(**site.trainer_options).remote(timeout_s)
        self.receiver = LinkEnd.options(**site.engine_options[0]).remote(timeout_s)

    def __enter__(self) -> "_Copier":
        try:
            self.port = ray.get(self.receiver.listen.remote(self.address), timeout=self.timeout_s)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for actor in (self.sender, self.receiver):
            ray.kill(actor)

    def __call__(self, out_dir: Path) -> tuple[Path, float]:
        dest = out_dir.with_name(out_dir.name + "-copied")
        shutil.rmtree(dest, ignore_errors=True)
        ray.get(self.receiver.receive.remote(str(dest)), timeout=self.timeout_s)
        seconds = ray.get(self.sender.send_dir.remote(self.address, self.port, str(out_dir)), timeout=self.timeout_s)
        ray.get(self.receiver.wait.remote(), timeout=self.timeout_s)
        return dest, seconds
