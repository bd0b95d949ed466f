"""The rescue of a kill-mode checkpoint whose upload failed: the workload back from local images.

A kill-mode dump leaves the tree dead and its only copy in staging. When the push then fails,
the checkpoint body (``checkpoint.py``) asks ``Rescue.run`` to restore the tree on this node
from those images, and its CUDA processes back onto their GPUs (CRIU alone leaves them
CHECKPOINTED). What happened is said in words, in the job's one-line error, with what (if
anything) was lost; where even the local restore fails, the images are kept out of staging.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpusnap.daemon.gpu.adapter import Freeze
from gpusnap.daemon.host import scopes
from gpusnap.daemon.host.criu import systemd_running
from gpusnap.daemon.node.node import Node
from gpusnap.errors import GpusnapError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Rescue:
    """What a rescue needs: the node, the job, its images and what its GPU freeze did."""

    node: Node
    job_id: str
    images: Path
    freeze: Freeze
    gpu_stamp: dict[str, Any]
    # Custom storage: the device memory is in the store's (uncommitted) streams, not in the
    # images; thawing the freeze refills it from there.
    gpu_memory_in_store: bool = False
    workload: str = ""  # names the scope the tree is restored into (``host/scopes.py``)

    def run(self) -> str:
        """What happened, in words. Never raises: the caller is already reporting the upload's
        failure, and the rescue's own failure must be said in that one line."""
        try:
            return self._restore()
        except Exception as exc:  # the one line must say it, never a traceback
            log.exception("rescue of job %s failed", self.job_id)
            return f"rescuing the workload failed ({type(exc).__name__}: {exc}); see the daemon log"

    def _restore(self) -> str:
        images, logs = self.images, self.node.dirs.logs
        if not images.is_dir():
            log.error(
                "job %s: the local images %s are gone; the workload is lost", self.job_id, images
            )
            return (
                f"the workload cannot be restored locally either: its images {images} are gone "
                "(removed by something outside this job); the workload is lost"
            )
        sibling = not systemd_running()
        try:
            restored = self.node.criu.restore(
                images,
                log_path=logs / f"{self.job_id}-rescue.log",
                pidfile=logs / f"{self.job_id}-rescue.pid",
                scope_unit=scopes.unit_name(self.workload or "rescue", self.job_id),
                scope_description=scopes.description(
                    self.workload or "a workload", f"its local dump (job {self.job_id})"
                ),
                sibling=sibling,
            )
        except GpusnapError as err:
            return f"restoring the workload locally failed too ({err}); {self.keep_images()}"
        if sibling:
            self.node.adopt(restored.pid)
        done = f"the workload was restored on this node from the local dump (pid {restored.pid})"
        if not self.freeze.cuda_pids:
            return done
        try:
            if self.gpu_memory_in_store:
                self.node.gpu.thaw(self.freeze)
            else:
                self.node.gpu.restore(list(self.freeze.cuda_pids), self.gpu_stamp)
        except GpusnapError as err:
            log.warning("GPU restore after the local rescue of job %s failed: %s", self.job_id, err)
            return f"{done}, but its GPU state was not restored ({err})"
        return f"{done} with its GPU state"

    def keep_images(self) -> str:
        """Move the images out of staging (which is removed when the job ends); say where."""
        images, kept = self.images, self.node.dirs.kept(self.job_id)
        try:
            kept.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(images), str(kept))
        except OSError as exc:
            log.exception("job %s: cannot keep the images %s in %s", self.job_id, images, kept)
            why = exc.strerror or exc
            if not images.is_dir():
                return f"its images {images} are gone ({why}); the workload is lost"
            beside = self.node.dirs.kept_beside(self.job_id)
            try:
                os.rename(images, beside)
            except OSError:
                log.exception("job %s: cannot keep the images in %s either", self.job_id, beside)
                return (
                    f"its images could not be kept ({why}) and go with the job's "
                    "staging; the workload is lost"
                )
            return f"its images are kept in {beside} ({kept} failed: {why})"
        return f"its images are kept in {kept}"
