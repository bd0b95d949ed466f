"""What the install tests carry into the container: a wheel of this checkout and a wheelhouse
of its runtime dependencies, an upgraded copy of the wheel, and the install command."""

from __future__ import annotations

import base64
import hashlib
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tests.systemd.nspawn import REPO, SRC_IN_CONTAINER

CRIU_DEBS = "/var/cache/gpusnap/criu-debs"  # inside the rootfs (scripts/nspawn-rootfs.sh)
KEY_FILE = "/etc/gpusnap/signing.key"


@dataclass(frozen=True)
class Payload:
    """A wheel of this checkout and a wheelhouse of its runtime dependencies."""

    wheel: Path
    wheelhouse: Path

    def in_container(self, path: Path) -> str:
        return f"{SRC_IN_CONTAINER}/{path.relative_to(REPO)}"


def changed_wheel(wheel: Path, out_dir: Path) -> Path:
    """The same wheel with one module changed (and its RECORD kept true): an upgrade."""
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / wheel.name
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        record_name = next(n for n in src.namelist() if n.endswith(".dist-info/RECORD"))
        body = src.read("gpusnap/__init__.py") + b"# upgraded\n"
        digest = base64.urlsafe_b64encode(hashlib.sha256(body).digest()).rstrip(b"=").decode()
        for name in src.namelist():
            if name == record_name:
                lines = [
                    f"gpusnap/__init__.py,sha256={digest},{len(body)}"
                    if line.startswith("gpusnap/__init__.py,")
                    else line
                    for line in src.read(name).decode().splitlines()
                ]
                dst.writestr(name, "\n".join(lines) + "\n")
            elif name == "gpusnap/__init__.py":
                dst.writestr(name, body)
            else:
                dst.writestr(name, src.read(name))
    return out


def install_command(payload: Payload, *extra: str, wheel: Path | None = None) -> list[str]:
    """``scripts/install.sh`` as run in the container: offline, CRIU from the carried .debs."""
    return [
        "bash",
        f"{SRC_IN_CONTAINER}/scripts/install.sh",
        "--wheel",
        payload.in_container(wheel or payload.wheel),
        "--wheelhouse",
        payload.in_container(payload.wheelhouse),
        "--criu-debs",
        CRIU_DEBS,
        *extra,
    ]
