"""Transport throughput: one sync of N GiB of bf16 tensors, trainer process → engine process.

    .venv/bin/python benchmarks/transport_bench.py --gib 1 --bucket-mib 256 --syncs 3

Per transport: the full pipeline (TensorSource → bucket fill + xxh3 → transport → verify → apply
into a MemoryEngine in another process → finish → ack), best of ``--syncs`` warm syncs, in GB/s
(1e9 bytes/s). Floors measured in the same run: a plain cross-process copy through a reused
shared mapping (writer copies in, reader copies out into its own buffer; the shm/Ray reference),
and a raw gloo broadcast of the same bytes in the same bucket sizes (the torch.distributed reference).
"""

from __future__ import annotations

import argparse
import mmap
import multiprocessing as mp
import os
import shutil
import socket
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

ROWS, COLS = 4096, 2048  # one tensor: 16 MiB of bf16


def tensors(gib: float) -> dict[str, torch.Tensor]:
    n = max(1, int(gib * (1 << 30)) // (ROWS * COLS * 2))
    g = torch.Generator().manual_seed(0)
    return {f"layers.{i}.w": torch.randn(ROWS, COLS, generator=g).bfloat16() for i in range(n)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- floors

def _copy_reader(path: str, slot: int, conn) -> None:
    fd = os.open(path, os.O_RDWR)
    buf = np.frombuffer(mmap.mmap(fd, 2 * slot), dtype=np.uint8)
    own = np.ones(slot, dtype=np.uint8)
    conn.send("ready")
    while (k := conn.recv()) is not None:
        np.copyto(own, buf[k * slot:(k + 1) * slot])
        conn.send(k)


def shm_copy_floor(total: int, slot: int, rounds: int) -> float:
    path = f"/dev/shm/wsbench-{uuid.uuid4().hex[:8]}"
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    os.ftruncate(fd, 2 * slot)
    buf = np.frombuffer(mmap.mmap(fd, 2 * slot), dtype=np.uint8)
    buf[:] = 0
    src = np.ones(slot, dtype=np.uint8)
    parent, child = mp.get_context("spawn").Pipe()
    p = mp.get_context("spawn").Process(target=_copy_reader, args=(path, slot, child))
    p.start()
    parent.recv()
    best = 0.0
    for _ in range(rounds):
        t, n, inflight = time.perf_counter(), total // slot, 0
        for i in range(n):
            if inflight == 2:
                parent.recv()
                inflight -= 1
            np.copyto(buf[(i % 2) * slot:(i % 2 + 1) * slot], src)
            parent.send(i % 2)
            inflight += 1
        for _ in range(inflight):
            parent.recv()
        best = max(best, n * slot / (time.perf_counter() - t) / 1e9)
    parent.send(None)
    p.join()
    os.unlink(path)
    return best


def _gloo_peer(rank: int, port: int, total: int, slot: int, rounds: int, q) -> None:
    import datetime

    import torch.distributed as dist
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=60))
    pg = dist.ProcessGroupGloo(store, rank, 2, datetime.timedelta(seconds=60))
    buf = torch.ones(slot, dtype=torch.uint8)
    best = 0.0
    for _ in range(rounds):
        pg.barrier().wait()
        t = time.perf_counter()
        for _ in range(total // slot):
            pg.broadcast([buf]).wait()
        best = max(best, total // slot * slot / (time.perf_counter() - t) / 1e9)
    if rank == 1:
        q.put(best)


def gloo_floor(total: int, slot: int, rounds: int) -> float:
    ctx, port = mp.get_context("spawn"), free_port()
    q = ctx.Queue()
    ps = [ctx.Process(target=_gloo_peer, args=(r, port, total, slot, rounds, q)) for r in (0, 1)]
    [p.start() for p in ps]
    best = q.get(timeout=300)
    [p.join() for p in ps]
    return best


# ---------------------------------------------------------------- transports

def _engine_main(spec_bytes: bytes, gib: float, bucket: int, syncs: int, q) -> None:
    from sync_service.engines.memory import MemoryEngine
    from sync_service.streaming import BucketReceiver, TensorSource, build_plan
    from sync_service.transports import TransportSpec, open_receiver

    ts = tensors(gib)
    engine = MemoryEngine({n: torch.zeros_like(t) for n, t in ts.items()})
    plan = build_plan(TensorSource(ts).param_metas(), bucket_bytes=bucket)
    del ts
    rx = open_receiver(TransportSpec.from_bytes(spec_bytes), 0)
    q.put("ready")
    for _ in range(syncs):
        s = BucketReceiver(engine, plan).receive_sync(rx, timeout_s=300, commit=True)
        q.put((s.wait_s, s.verify_s, s.apply_s))
    rx.close()


def run_transport(kind: str, gib: float, bucket: int, syncs: int) -> tuple[float, list]:
    from sync_service.streaming import BucketPool, Sender, TensorSource, build_plan
    from sync_service.transports import TransportSpec, open_sender

    spec = TransportSpec(kind=kind, name="b" + uuid.uuid4().hex[:8], bucket_bytes=bucket, port=free_port(),
                         op_timeout_s=300)
    q, proc = None, None
    if kind == "ray":
        import ray
        from ray.util.queue import Queue  # noqa: F401  (import check)
        peer = ray.remote(num_cpus=0)(_RayEngine).remote()
        opening = peer.open.remote(spec.to_bytes(), gib, bucket)
    else:
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        proc = ctx.Process(target=_engine_main, args=(spec.to_bytes(), gib, bucket, syncs, q))
        proc.start()
    tx = open_sender(spec, 0)
    if kind == "ray":
        ray.get(opening)
    else:
        q.get(timeout=300)
    source = TensorSource(tensors(gib))
    plan = build_plan(source.param_metas(), bucket_bytes=bucket)
    sender = Sender(tx, BucketPool(bucket_bytes=bucket))
    best, details = 0.0, []
    for v in range(syncs):
        fut = peer.receive.remote() if kind == "ray" else None
        t = time.perf_counter()
        st = sender.send_sync(f"b{v}", v, source, plan, timeout_s=300)
        dt = time.perf_counter() - t
        rx_times = ray.get(fut) if kind == "ray" else q.get(timeout=300)
        best = max(best, st.payload_bytes / dt / 1e9)
        details.append({"s": round(dt, 3), "pack_s": round(st.pack_s, 3), "send_s": round(st.transfer_s, 3),
                        "rx_wait_verify_apply_s": [round(x, 3) for x in rx_times]})
    tx.close()
    if proc is not None:
        proc.join(60)
    return best, details


class _RayEngine:
    def open(self, spec_bytes, gib, bucket):
        from sync_service.engines.memory import MemoryEngine
        from sync_service.streaming import TensorSource, build_plan
        from sync_service.transports import TransportSpec, open_receiver
        ts = tensors(gib)
        self.engine = MemoryEngine({n: torch.zeros_like(t) for n, t in ts.items()})
        self.plan = build_plan(TensorSource(ts).param_metas(), bucket_bytes=bucket)
        self.rx = open_receiver(TransportSpec.from_bytes(spec_bytes), 0)

    def receive(self):
        from sync_service.streaming import BucketReceiver
        s = BucketReceiver(self.engine, self.plan).receive_sync(self.rx, timeout_s=300, commit=True)
        return s.wait_s, s.verify_s, s.apply_s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0, help="payload per sync, GiB")
    ap.add_argument("--bucket-mib", type=int, default=256, help="bucket size, MiB")
    ap.add_argument("--syncs", type=int, default=3, help="syncs per transport (best one reported)")
    ap.add_argument("--transports", default="shm,ray,torch_dist")
    args = ap.parse_args()
    bucket, total = args.bucket_mib << 20, int(args.gib * (1 << 30))
    floor = shm_copy_floor(total, bucket, args.syncs)
    gloo = gloo_floor(total, bucket, args.syncs)
    print(f"floor: cross-process copy through reused shared memory {floor:.2f} GB/s; raw gloo broadcast {gloo:.2f} GB/s")
    print("| transport | GB/s | ratio | reference |\n|---|---|---|---|")
    for kind in args.transports.split(","):
        if kind == "ray":
            import ray
            tmp = tempfile.mkdtemp(prefix="wsb", dir="/tmp")
            ray.init(num_cpus=2, _temp_dir=tmp, include_dashboard=False, log_to_driver=False,
                     runtime_env={"env_vars": {"PYTHONPATH": str(Path(__file__).resolve().parents[1])}})
        gbps, details = run_transport(kind, args.gib, bucket, args.syncs)
        ref, ref_name = (gloo, "raw gloo broadcast") if kind == "torch_dist" else (floor, "shm copy floor")
        print(f"| {kind} | {gbps:.2f} | {gbps / ref:.2f} | {ref_name} |", flush=True)
        print(f"<!-- {kind} per sync: {details} -->", flush=True)
        if kind == "ray":
            ray.shutdown()
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
