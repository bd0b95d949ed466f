"""The container tests' image, made without a registry, and cached.

``debootstrap --variant=minbase --include=python3-minimal`` of the machine's own Debian suite
(from the mirror its apt sources name), trimmed, imported into a scratch podman root with
``podman import`` and saved as an OCI archive. Loading that one archive into each storage root
gives the same image id (the config digest) everywhere, as one image pulled on two nodes does.
Both artefacts are cached under the repository's ignored ``/.cache/containers/``; a lock file
keeps two pytest processes from building them at once.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / ".cache" / "containers"
IMAGE_REF = "localhost/gpusnap-genloop:1"
WORKLOAD_DIR = Path(__file__).resolve().parent / "workload"
# Trimmed from the rootfs: nothing the workload runs needs them.
_TRIM = (
    "usr/share/doc",
    "usr/share/man",
    "usr/share/info",
    "usr/share/locale",
    "var/cache/apt",
    "var/lib/apt/lists",
)


def _run(cmd: list[str], timeout: float) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise RuntimeError(
            f"{' '.join(cmd[:3])} ... failed ({proc.returncode}): {' | '.join(tail)}"
        )


@contextmanager
def _locked() -> Iterator[None]:
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _suite_and_mirror() -> tuple[str, str]:
    os_release = Path("/etc/os-release").read_text()
    m = re.search(r"^VERSION_CODENAME=(\w+)", os_release, re.M)
    if not m:
        raise RuntimeError("no VERSION_CODENAME in /etc/os-release")
    suite = m.group(1)
    sources = []
    for p in [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]:
        if p.is_file():
            sources.append(p.read_text())
    text = "\n".join(sources)
    # deb822 stanzas ("URIs: ..." with "Suites: bookworm ...") or one-line "deb URI suite ..."
    for stanza in re.split(r"\n\s*\n", text):
        uris = re.search(r"^URIs:\s*(\S+)", stanza, re.M)
        suites = re.search(r"^Suites:\s*(.+)$", stanza, re.M)
        if uris and suites and suite in suites.group(1).split():
            return suite, uris.group(1)
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[0] == "deb" and parts[2] == suite:
            return suite, parts[1]
    raise RuntimeError(f"no apt source for {suite} to debootstrap from")


def rootfs_tar() -> Path:
    """A tarball of a minimal Debian rootfs with python3 (built once, ~1 min)."""
    out = CACHE / "rootfs.tar"
    with _locked():
        if out.exists():
            return out
        if shutil.which("debootstrap") is None:
            raise RuntimeError("debootstrap missing (scripts/install-containers.sh installs it)")
        suite, mirror = _suite_and_mirror()
        work = CACHE / "rootfs.build"
        shutil.rmtree(work, ignore_errors=True)
        _run(
            [
                "debootstrap",
                "--variant=minbase",
                "--include=python3-minimal",
                suite,
                str(work),
                mirror,
            ],
            900,
        )
        for rel in _TRIM:
            shutil.rmtree(work / rel, ignore_errors=True)
        tmp = out.with_suffix(".tmp")
        subprocess.run(["tar", "-C", str(work), "-cf", str(tmp), "."], check=True, timeout=300)
        os.replace(tmp, out)
        shutil.rmtree(work, ignore_errors=True)
        return out


def image_archive() -> Path:
    """An OCI archive of ``IMAGE_REF``: the rootfs, ``podman import``ed (built once)."""
    rootfs = rootfs_tar()
    key = hashlib.sha256(f"{rootfs.stat().st_size}:{rootfs.stat().st_mtime_ns}".encode())
    out = CACHE / f"image-{key.hexdigest()[:12]}.oci.tar"
    with _locked():
        if out.exists():
            return out
        # podman refuses a runroot path longer than 50 characters: the scratch root is short.
        scratch = Path(tempfile.mkdtemp(prefix="gpusnap-img-", dir="/tmp"))
        podman = [
            "podman",
            "--root",
            str(scratch / "root"),
            "--runroot",
            str(scratch / "run"),
            "--tmpdir",
            str(scratch / "tmp"),
            "--cgroup-manager",
            "cgroupfs",
            "--events-backend",
            "file",
        ]
        try:
            _run([*podman, "import", str(rootfs), IMAGE_REF], 300)
            tmp = out.with_suffix(".tmp")
            tmp.unlink(missing_ok=True)
            _run([*podman, "save", "--format", "oci-archive", "-o", str(tmp), IMAGE_REF], 300)
            os.replace(tmp, out)
        finally:
            subprocess.run(
                [*podman, "system", "reset", "--force"],
                capture_output=True,
                timeout=120,
                check=False,
            )
            shutil.rmtree(scratch, ignore_errors=True)
        return out
