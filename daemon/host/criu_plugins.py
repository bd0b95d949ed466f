"""CRIU runs with no plugins: an empty plugin directory of our own (``--libdir``).

CRIU loads every ``*.so`` of its plugin directory (``/usr/lib/criu`` unless ``--libdir`` or
``$CRIU_LIBS_DIR`` say otherwise). A CRIU built with its CUDA plugin (the default ``make
install``) acts on CHECKPOINTED CUDA processes by itself at restore: it restores and unlocks
them before gpusnap can, without the GPU UUID map and before the free-memory check (issue 10
§2.3). gpusnap drives the CUDA checkpoint API itself, as NVIDIA's Dynamo Snapshot does, so it
keeps every plugin out.
"""

from __future__ import annotations

import os
import tempfile
import threading
from pathlib import Path

_lock = threading.Lock()
_dir: Path | None = None


def no_plugins_args() -> list[str]:
    """``--libdir EMPTY``: an empty directory, private to this process (mode 0700)."""
    global _dir  # noqa: PLW0603 - one directory per daemon process, made on first use
    with _lock:
        if _dir is None or not _dir.is_dir():  # made again if something cleaned /tmp
            _dir = Path(tempfile.mkdtemp(prefix="gpusnap-criu-no-plugins-"))
        return ["--libdir", str(_dir)]


def criu_env() -> dict[str, str]:
    """This process's environment without ``CRIU_LIBS_DIR`` (``--libdir`` wins anyway)."""
    return {k: v for k, v in os.environ.items() if k != "CRIU_LIBS_DIR"}
