"""Default values of a sync, in one place: ``SyncConfig``, the ``sync`` / ``demo`` / ``run`` CLIs and the
deploy config (``deploy_config.SyncSection``) all read them from here."""

from __future__ import annotations

TRANSPORT = "shm"
"""``SyncConfig.transport`` and ``--transport``: same-host shared memory (``deploy_config`` adds ``"auto"``)."""
BUCKET_BYTES = 64 << 20
"""``SyncConfig.bucket_bytes`` and the deploy config's ``sync.bucket_bytes``: 64 MiB, bytes."""
SMALL_MODEL_BUCKET_BYTES = 1 << 20
"""``--bucket-bytes`` of the local CLIs and the RL demo, which run KB-to-MB models: 1 MiB, so a version
still travels as several buckets (double buffering at work) in small shared-memory segments."""
TIMEOUT_S = 120.0
"""``SyncConfig.timeout_s``, ``--timeout`` and ``sync.timeout_s``: bound of every blocking step, seconds."""
MAX_TIMEOUT_S = 7 * 24 * 3600.0
"""The longest ``timeout_s`` accepted, seconds (a week): Python's thread and socket waits overflow past ~9.2e9 s."""
MAX_ENGINES = 64
"""Most rollout engines one run starts (``--engines`` of ``sync`` / ``demo``, ``engines.count`` of ``run``'s
config): engine actors take ``num_cpus=0``, so Ray would start any number at once, each a process with its
own model copy; 64 is well above any one-driver fleet measured here (docs/operations.md, bounds)."""
MAX_VERSIONS = 1 << 20
"""Most versions one ``sync`` / ``demo`` run pushes (``--versions``): a count of pushes, each verified; far
below the largest weight version (2**63 - 1, an int64 on the wire)."""
DELTA = True
"""``SyncConfig.delta`` and ``sync.delta``: after a full sync, send only the tensors the adapter changes."""
RAY_WORKER_ENV = {"OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_OFFLINE": "1",
                  "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
"""``runtime_env["env_vars"]`` of the Ray every CLI starts or joins (``sync`` / ``demo`` / ``bench`` / ``run`` and
the bench's namespace drivers): one thread per actor, no hub access, no progress bars or info logs."""
