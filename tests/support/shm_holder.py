"""A process that keeps its state in tmpfs files, as vLLM's processes keep theirs in /dev/shm.

``python shm_holder.py WORKDIR TAG STEPS INTERVAL``: makes ``/dev/shm/TAG-seg`` (a sparse
file of 64 MiB, mapped shared: its first 8 bytes are the step counter, a page further on a
running hash) and ``/dev/shm/TAG-sem`` (made under a temporary name that is then deleted
while held open, the way glibc's ``sem_open`` does it: CRIU needs ``--link-remap`` for it), opens
``WORKDIR/out.log`` for writing (not appending), writes ``WORKDIR/ready`` and then, each
step, appends a line to the log: the step read from the mapping, the running hash, and the
bytes of the semaphore file read through its deleted name's descriptor. It exits 0 after
STEPS steps. Everything it prints follows from the mapping's bytes, so a run restored with its
tmpfs files as they were at the dump prints what an uninterrupted run prints.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import sys
import time

SEG_SIZE = 64 << 20
HASH_AT = 1 << 20


def main() -> int:
    workdir, tag, steps, interval = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
    seg_fd = os.open(f"/dev/shm/{tag}-seg", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    os.ftruncate(seg_fd, SEG_SIZE)
    seg = mmap.mmap(seg_fd, SEG_SIZE, mmap.MAP_SHARED)
    tmp = f"/dev/shm/{tag}-sem.tmp"
    sem_fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    os.write(sem_fd, b"a semaphore\n")
    os.link(tmp, f"/dev/shm/{tag}-sem")
    os.unlink(tmp)
    log = os.open(f"{workdir}/out.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    with open(f"{workdir}/ready", "w") as fh:
        fh.write(f"{os.getpid()}\n")
    while True:
        step = int.from_bytes(seg[0:8], "little")
        if step >= steps:
            return 0
        prev = bytes(seg[HASH_AT : HASH_AT + 32])
        digest = hashlib.sha256(prev + step.to_bytes(8, "little")).digest()
        seg[HASH_AT : HASH_AT + 32] = digest
        seg[0:8] = (step + 1).to_bytes(8, "little")
        sem = os.pread(sem_fd, 64, 0).decode().strip()
        os.write(log, f"{step} {digest.hex()[:16]} {sem}\n".encode())
        time.sleep(interval)


if __name__ == "__main__":
    sys.exit(main())
