"""The rescue of a kill-mode checkpoint whose upload failed never raises, and says what was lost.

Its caller is already failing the job with the upload's error; whatever goes wrong in the
rescue (images gone, CRIU failing, the images impossible to keep) must end up in that one line,
never as a foreign exception escaping the job.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from gpusnap.daemon.infra.statedir import StateDirs
from gpusnap.daemon.pipelines.rescue import Rescue
from gpusnap.errors import Unsupported


class _FailingCriu:
    def __init__(self, error: Exception) -> None:
        self.error = error
        self.calls = 0

    def restore(self, images: Path, **_: Any) -> Any:
        self.calls += 1
        raise self.error


def _node(tmp_path: Path, criu: _FailingCriu) -> Any:
    """The parts of a ``Node`` a rescue uses: CRIU, the state directories, the reaper."""
    dirs = StateDirs.of(tmp_path / "state", None)
    for d in (dirs.state, dirs.logs, dirs.staging):
        d.mkdir(parents=True, exist_ok=True)
    return SimpleNamespace(criu=criu, dirs=dirs, adopt=lambda pid: None)


def _rescue(node: Any, images: Path) -> str:
    freeze = cast("Any", SimpleNamespace(cuda_pids=()))
    return Rescue(node, "20990101T000000-abcdef", images, freeze=freeze, gpu_stamp={}).run()


def _images(tmp_path: Path) -> Path:
    images = tmp_path / "state" / "staging" / "20990101T000000-abcdef" / "images"
    images.mkdir(parents=True)
    (images / "pages-1.img").write_bytes(b"the only copy")
    return images


def test_images_removed_under_the_job_are_reported_lost_without_trying_criu(
    tmp_path: Path,
) -> None:
    criu = _FailingCriu(Unsupported("not reached"))
    images = tmp_path / "state" / "staging" / "20990101T000000-abcdef" / "images"
    message = _rescue(_node(tmp_path, criu), images)
    assert criu.calls == 0
    assert f"its images {images} are gone" in message
    assert "the workload is lost" in message


def test_a_failed_local_restore_keeps_the_images_and_says_where(tmp_path: Path) -> None:
    images = _images(tmp_path)
    message = _rescue(_node(tmp_path, _FailingCriu(Unsupported("criu broke"))), images)
    kept = tmp_path / "state" / "kept" / "20990101T000000-abcdef"
    assert message == (
        f"restoring the workload locally failed too (criu broke); its images are kept in {kept}"
    )
    assert (kept / "pages-1.img").read_bytes() == b"the only copy"


def test_images_that_cannot_be_moved_are_kept_beside_staging(tmp_path: Path) -> None:
    images = _images(tmp_path)
    node = _node(tmp_path, _FailingCriu(Unsupported("criu broke")))
    (node.dirs.state / "kept").write_text("a file where the kept/ directory should be")
    message = _rescue(node, images)
    beside = node.dirs.staging / "kept-20990101T000000-abcdef"
    assert f"its images are kept in {beside}" in message
    assert (beside / "pages-1.img").read_bytes() == b"the only copy"


@pytest.mark.parametrize("error", [FileNotFoundError(2, "gone"), RuntimeError("unexpected")])
def test_a_foreign_error_in_the_rescue_is_one_line_not_an_exception(
    tmp_path: Path, error: Exception
) -> None:
    images = _images(tmp_path)
    message = _rescue(_node(tmp_path, _FailingCriu(error)), images)
    assert message.startswith(f"rescuing the workload failed ({type(error).__name__}: ")
    assert "\n" not in message
