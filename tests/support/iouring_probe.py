"""A process that says whether it may create an io_uring, and so does a child of its own.

Run as ``python iouring_probe.py OUT [EXIT]``: writes to OUT one JSON object — its
``io_uring_setup`` outcome (``"ok"`` or the errno's name), its child's, its environment's
``PROBE_VALUE``, its working directory and the descriptors it holds open — then exits with
status EXIT (0 by default). The child is a fresh interpreter (fork + exec), as a server's
workers are.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import subprocess
import sys

_IO_URING_SETUP = 425  # x86_64 and aarch64 alike


def io_uring_setup() -> str:
    """Create an io_uring of one entry: "ok" (and close it) or the errno's name."""
    libc = ctypes.CDLL(None, use_errno=True)
    params = ctypes.create_string_buffer(120)  # struct io_uring_params, zeroed
    fd = libc.syscall(_IO_URING_SETUP, 1, params)
    if fd >= 0:
        os.close(fd)
        return "ok"
    return errno.errorcode.get(ctypes.get_errno(), str(ctypes.get_errno()))


def main() -> int:
    if sys.argv[1] == "--child":
        print(io_uring_setup())
        return 0
    out, status = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 0
    child = subprocess.run(
        [sys.executable, __file__, "--child"], capture_output=True, text=True, check=True
    )
    report = {
        "self": io_uring_setup(),
        "child": child.stdout.strip(),
        "env": os.environ.get("PROBE_VALUE"),
        "cwd": os.getcwd(),
        "fds": sorted(int(fd) for fd in os.listdir("/proc/self/fd")),
        "pid": os.getpid(),
    }
    with open(out, "w") as fh:
        json.dump(report, fh)
    return status


if __name__ == "__main__":
    sys.exit(main())
