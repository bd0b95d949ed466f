"""io_uring off, for a process and every process it starts: what makes a workload
checkpoint-ready (``gpusnap exec`` and gpusnapd's cold start both install this filter).

CRIU cannot dump an io_uring instance (``Unknown shit 600 (anon_inode:[io_uring])``), and
libuv (uvloop, so vLLM's and SGLang's API servers) opens one whenever the kernel lets it,
whatever ``UV_USE_IO_URING`` says. A seccomp filter that answers ``io_uring_setup``,
``io_uring_enter`` and ``io_uring_register`` with ENOSYS makes such libraries fall back to
epoll, as they do on a kernel without io_uring; Docker's and podman's default profiles block
io_uring the same way. The filter is inherited across fork and kept across exec, so every
descendant has it; nothing else about the process changes.

Pure Python: the classic-BPF program is built by hand and installed with
``prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ...)`` through ctypes. io_uring's three calls are
numbered 425-427 in the unified syscall table of every architecture this knows (x86_64, its
i386 and x32 ABIs, aarch64 and its 32-bit arm ABI); a call of any other architecture is
allowed untouched.

Imports nothing of ours: the CLI (``gpusnap exec``) and the daemon (``daemon/host/
coldstart.py``) both use it, and neither may import the other. The daemon runs this file as a
script in front of the command (``wrap``) rather than installing the filter between fork and
exec: it has threads, and a fork of a threaded process may run nothing but exec safely.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import shutil
import struct
import sys
from collections.abc import Sequence

IO_URING_SYSCALLS = (425, 426, 427)  # io_uring_setup, io_uring_enter, io_uring_register

# <linux/audit.h>: the architectures whose io_uring calls are 425-427.
_AUDIT_ARCH_X86_64 = 0xC000003E
_AUDIT_ARCH_I386 = 0x40000003
_AUDIT_ARCH_AARCH64 = 0xC00000B7
_AUDIT_ARCH_ARM = 0x40000028
ARCHES = (_AUDIT_ARCH_X86_64, _AUDIT_ARCH_I386, _AUDIT_ARCH_AARCH64, _AUDIT_ARCH_ARM)
_X32_SYSCALL_BIT = 0x40000000  # x86_64's x32 ABI numbers its calls with this bit set

# <linux/filter.h>, <linux/bpf_common.h>, <linux/seccomp.h>, <linux/prctl.h>
_BPF_LD_W_ABS = 0x20
_BPF_ALU_AND_K = 0x54
_BPF_JEQ_K = 0x15
_BPF_JGE_K = 0x35
_BPF_JGT_K = 0x25
_BPF_RET_K = 0x06
_SECCOMP_RET_ALLOW = 0x7FFF0000
_SECCOMP_RET_ERRNO = 0x00050000
_OFFSET_NR = 0  # struct seccomp_data: int nr; __u32 arch; ...
_OFFSET_ARCH = 4
_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_SECCOMP = 22
_SECCOMP_MODE_FILTER = 2
_CAP_SYS_ADMIN = 21


class SeccompError(OSError):
    """The filter could not be installed (errno and why in the message)."""


def _insn(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def io_uring_filter() -> bytes:
    """The BPF program (``struct sock_filter[]``): ENOSYS for io_uring's calls on the known
    architectures, everything else allowed."""
    n = len(ARCHES)
    prog = [_insn(_BPF_LD_W_ABS, 0, 0, _OFFSET_ARCH)]
    # One test per architecture: a match jumps past the remaining tests and the "allow".
    for i, arch in enumerate(ARCHES):
        prog.append(_insn(_BPF_JEQ_K, n - i, 0, arch))
    prog.append(_insn(_BPF_RET_K, 0, 0, _SECCOMP_RET_ALLOW))  # an architecture not known
    lo, hi = IO_URING_SYSCALLS[0], IO_URING_SYSCALLS[-1]
    prog += [
        _insn(_BPF_LD_W_ABS, 0, 0, _OFFSET_NR),
        _insn(_BPF_ALU_AND_K, 0, 0, ~_X32_SYSCALL_BIT & 0xFFFFFFFF),
        _insn(_BPF_JGE_K, 0, 2, lo),  # nr < 425: allow
        _insn(_BPF_JGT_K, 1, 0, hi),  # nr > 427: allow
        _insn(_BPF_RET_K, 0, 0, _SECCOMP_RET_ERRNO | errno.ENOSYS),
        _insn(_BPF_RET_K, 0, 0, _SECCOMP_RET_ALLOW),
    ]
    return b"".join(prog)


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


class IoUringBlock:
    """The filter, prepared: everything allocated and looked up here, so that ``install``
    (which may run in a forked child before exec, ``subprocess``'s ``preexec_fn``) only makes
    the two prctl calls."""

    def __init__(self) -> None:
        prog = io_uring_filter()
        self._buf = ctypes.create_string_buffer(prog, len(prog))
        self._fprog = _SockFprog(len(prog) // 8, ctypes.cast(self._buf, ctypes.c_void_p))
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        self._prctl = libc.prctl
        self._prctl.restype = ctypes.c_int
        self._prctl.argtypes = [
            ctypes.c_int,
            ctypes.c_ulong,
            ctypes.c_void_p,
            ctypes.c_ulong,
            ctypes.c_ulong,
        ]
        # Without CAP_SYS_ADMIN the kernel installs a filter only under no_new_privs. With
        # it, no_new_privs is left off on purpose: it would change what the command may do
        # (setuid and file-capability binaries, e.g. sudo or ping, no longer gain privileges),
        # and "nothing else changed" is the promise.
        self._need_nnp = not has_cap_sys_admin()

    def install(self) -> None:
        """Install the filter on the calling thread (and, through fork and exec, on every
        process it starts). ``SeccompError`` when the kernel refuses."""
        if self._need_nnp and self._prctl(_PR_SET_NO_NEW_PRIVS, 1, None, 0, 0) != 0:
            err = ctypes.get_errno()
            raise SeccompError(err, f"prctl(PR_SET_NO_NEW_PRIVS): {os.strerror(err)}")
        if self._prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(self._fprog), 0, 0):
            err = ctypes.get_errno()
            raise SeccompError(err, f"prctl(PR_SET_SECCOMP): {os.strerror(err)}")


def has_cap_sys_admin() -> bool:
    """Whether this process's effective capabilities include CAP_SYS_ADMIN."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> _CAP_SYS_ADMIN & 1)
    except (OSError, ValueError):
        pass
    return False


def block_io_uring() -> None:
    """Install the io_uring filter on this process (before it execs the workload)."""
    IoUringBlock().install()


def resolve(command: str, search: str | None = None) -> str:
    """The file ``command`` names (a path, or looked up in ``search``, else PATH, as execvp
    does). ``FileNotFoundError`` when there is none, ``PermissionError`` when it cannot be
    run."""
    path = command if "/" in command else shutil.which(command, path=search)
    if path is None or not os.path.exists(path):
        raise FileNotFoundError(errno.ENOENT, "no such command", command)
    if os.path.isdir(path) or not os.access(path, os.X_OK):
        raise PermissionError(errno.EACCES, "not an executable file", command)
    return path


def wrap(command: Sequence[str]) -> list[str]:
    """``command`` run through this file: io_uring off, then exec (for a threaded caller).
    ``-I``: the interpreter reads no PYTHON* variables of the command's environment and
    imports nothing but the standard library."""
    return [sys.executable, "-I", os.path.abspath(__file__), "--", *command]


def main(argv: list[str]) -> int:
    """``python seccomp.py -- COMMAND [ARGS...]``: exec COMMAND with io_uring off. A failure
    is one line on stderr, exit 127 (no such command) or 126 (any other), as a shell's."""
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        sys.stderr.write("gpusnap seccomp: a COMMAND is required\n")
        return 126
    try:
        path = resolve(argv[0])
        block_io_uring()
        os.execv(path, argv)  # noqa: S606 - the command as given, no shell
    except FileNotFoundError as exc:
        sys.stderr.write(f"gpusnap seccomp: {argv[0]}: {exc.strerror}\n")
        return 127
    except OSError as exc:
        sys.stderr.write(f"gpusnap seccomp: {argv[0]}: {exc.strerror or exc}\n")
        return 126
    return 126  # not reached: execv returned


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
