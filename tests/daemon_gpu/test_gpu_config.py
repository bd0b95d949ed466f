"""The ``[gpu]`` keys this layer reads: deadlines that grow with device memory, and where the
kernel module's version line is read from."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpusnap.daemon.config.file import GpuSection
from tests.daemon_gpu.configs import config_error, parse_with


def _gpu(tmp_path: Path, keys: str) -> GpuSection:
    return parse_with(tmp_path, f"[gpu]\n{keys}").gpu


def test_the_gpu_section_takes_a_copy_rate_and_a_version_file(tmp_path: Path) -> None:
    assert _gpu(tmp_path, "") == GpuSection()
    assert GpuSection().nvidia_version_file == Path("/proc/driver/nvidia/version")
    gpu = _gpu(tmp_path, 'copy_rate_gbps = 2.5\nnvidia_version_file = "/run/fake/version"')
    assert (gpu.copy_rate_gbps, gpu.nvidia_version_file) == (2.5, Path("/run/fake/version"))


@pytest.mark.parametrize(
    ("keys", "says"),
    [
        ("copy_rate_gbps = 0", "key 'copy_rate_gbps': must be at least"),
        ('nvidia_version_file = "version"', "key 'nvidia_version_file': must be an absolute path"),
        ("copy_rate = 1", "unknown key 'copy_rate' (did you mean 'copy_rate_gbps'?)"),
    ],
)
def test_a_bad_gpu_key_is_a_config_error_naming_it(tmp_path: Path, keys: str, says: str) -> None:
    message = config_error(tmp_path, f"[gpu]\n{keys}")
    assert says in message and "[gpu]" in message
