"""The ``weightsync`` console script: the command line of ``sync_service/entrypoints/cli.py`` with the Ray actor
launcher (``actors.launch.RayLauncher``) bound in, so sub-commands that start trainers and engines
(``demo``, ``sync``, ``bench``, ``run``) can; ``merge`` never starts Ray.

    python -m actors.cli sync --base BASE --adapter LORA
"""

from __future__ import annotations

import sys

from actors.launch import RayLauncher
from sync_service.entrypoints import cli


def main(argv: list[str] | None = None) -> int:
    """``sync_service.entrypoints.cli.main(argv, launcher=RayLauncher())``; returns the exit status."""
    return cli.main(argv, launcher=RayLauncher())


if __name__ == "__main__":
    sys.exit(main())
