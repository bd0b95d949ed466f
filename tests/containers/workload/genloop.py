"""A tiny generation loop with a KV cache, pure Python (the test image has python3-minimal only).

Run inside a container: ``python3 /gen/genloop.py OUT_DIR STEPS INTERVAL WEIGHTS_MIB [LOG]``
(``GENLOOP_WEIGHTS=bf16`` in its environment: weights laid out like bf16 ones).
Each step "attends" over rows of its KV cache and bytes of its weights chosen by its state,
appends a 4 KiB row to the cache, and writes one line ``step token state`` to OUT_DIR/tokens;
the stream is a hash chain over everything read, so a run restored with a single changed byte
of cache, weights or state diverges. The same lines go to LOG when given (the tests give a
file in the container's rw layer, so a checkpoint's rootfs diff holds something that grows).
``done`` ends the file.

Like tests/support/workloads.py, the writer truncates the file back to its own length before each
write: a run restored from an older checkpoint rewrites the lines written after it.
"""

import hashlib
import os
import random
import sys
import time

ROW = 4096


class Out:
    """A file this run owns the length of. ``reopen``: opened for each write and closed again,
    so no fd is held on it: CRIU refuses to restore an fd on a file whose size changed, and
    with leave-running the original run goes on growing the file."""

    def __init__(self, path, reopen=False):
        self.path = path
        self.reopen = reopen
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.length = 0
        if reopen:
            os.close(self.fd)

    def write(self, data):
        fd = os.open(self.path, os.O_WRONLY) if self.reopen else self.fd
        try:
            os.ftruncate(fd, self.length)
            os.pwrite(fd, data, self.length)
        finally:
            if self.reopen:
                os.close(fd)
        self.length += len(data)


def make_weights(size):
    """Seeded random bytes; with GENLOOP_WEIGHTS=bf16, laid out like bf16 weights instead
    (each value's low byte random, its high byte one of a few exponents), which compress as
    real weights roughly do (bench/container_bench.py). Built with C-level bytes operations:
    the image has no numpy."""
    rng = random.Random(1234)
    if os.environ.get("GENLOOP_WEIGHTS") != "bf16":
        return randbytes(rng, size)
    exponents = bytes(0x3C + (i % 6) for i in range(256))  # 256 values onto 6 exponents
    out = bytearray(size)
    out[0::2] = randbytes(rng, (size + 1) // 2)
    out[1::2] = randbytes(rng, size // 2).translate(exponents)
    return bytes(out)


def randbytes(rng, size):
    """``rng.randbytes(size)``, 64 MiB at a time (one call takes at most 256 MiB)."""
    if size <= 64 << 20:
        return rng.randbytes(size)
    return b"".join(rng.randbytes(min(64 << 20, size - i)) for i in range(0, size, 64 << 20))


def main():
    out_dir, steps, interval, weights_mib = (
        sys.argv[1],
        int(sys.argv[2]),
        float(sys.argv[3]),
        int(sys.argv[4]),
    )
    weights = make_weights(weights_mib << 20)  # read-only after this
    kv = bytearray()
    h = hashlib.sha256(b"prompt").digest()
    out = Out(os.path.join(out_dir, "tokens"), reopen=True)
    # Reopened too, unless GENLOOP_HOLD_LOG=1: a leave-running checkpoint's rw-layer diff is
    # exported after the container runs again, so a file held open there is longer than CRIU
    # recorded, and the restore fits it back (daemon/containers/openfiles.py).
    hold = os.environ.get("GENLOOP_HOLD_LOG") == "1"
    log = Out(sys.argv[5], reopen=not hold) if len(sys.argv) > 5 else None
    step = 0
    while step < steps:
        step += 1
        rows = len(kv) // ROW
        ctx = b""
        for i in range(4):
            if rows:
                r = (h[i] * 7919 + step) % rows
                ctx += bytes(kv[r * ROW + h[4 + i] : r * ROW + h[4 + i] + 16])
        sel = bytes(
            weights[int.from_bytes(h[8 + 4 * i : 12 + 4 * i], "little") % len(weights)]
            for i in range(8)
        )
        h = hashlib.sha256(h + ctx + sel + step.to_bytes(8, "little")).digest()
        kv += random.Random(h).randbytes(ROW)
        line = f"{step} {int.from_bytes(h[:2], 'little') % 32000} {h[:8].hex()}\n".encode()
        out.write(line)
        if log is not None:
            log.write(line)
        if interval:
            time.sleep(interval)
    out.write(b"done\n")


if __name__ == "__main__":
    main()
