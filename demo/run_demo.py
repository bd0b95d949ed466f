"""The gpusnap demo: checkpoint a generating language model mid-sentence, kill it, restore it.

In a scratch directory: a signing key, a config with an embedded ``file://`` store, a
``gpusnapd`` on its own socket, and ``demo/tinylm.py`` generating tokens. Mid-generation the
demo runs ``gpusnap checkpoint --workload tinylm --wait --json`` (kill mode: the process is
gone afterwards), then ``gpusnap restore --workload tinylm --latest --wait --json``, lets the
restored process finish, runs the same model uninterrupted, and compares the two token files.
Prints IDENTICAL (exit 0) or the first difference (exit 1), with the checkpoint's size, the
pause and the timings.

It runs without a GPU, and says so: tinylm computes on the CPU (numpy) and gpusnapd's GPU
support is off (``[gpu] driver = "none"``), so the checkpoint is CRIU's alone. The scratch
directory (config, key, store, the daemon's and the model's logs, both token files) is removed
at the end unless ``--keep`` or ``--workdir`` is given; the demo says where it is either way.

    bash scripts/demo.sh [--steps 150] [--checkpoint-after 40] [--workdir DIR] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy

from gpusnap.storage import generate_signing_key

ROOT = Path(__file__).resolve().parent.parent
TINYLM = ROOT / "demo" / "tinylm.py"
BIN = Path(sys.executable).parent
HANG_GUARD = 120.0  # seconds; only against hangs, never a performance expectation


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def say(text: str) -> None:
    print(text, flush=True)


def fail(text: str) -> int:
    print(f"demo: {text}", file=sys.stderr, flush=True)
    return 1


def wait_for(what: str, ready: Any, timeout: float = HANG_GUARD) -> None:
    end = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > end:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.02)


def lines(path: Path) -> list[bytes]:
    try:
        return path.read_bytes().splitlines()
    except FileNotFoundError:
        return []


def write_config(work: Path, steps: int, seed: int) -> Path:
    cfg = work / "gpusnapd.toml"
    command = [
        sys.executable,
        str(TINYLM),
        "--out",
        str(work / "run" / "tokens.txt"),
        "--steps",
        str(steps),
        "--seed",
        str(seed),
        "--pid-file",
        str(work / "run" / "tinylm.pid"),
    ]
    cfg.write_text(
        f"""# Written by demo/run_demo.py
[daemon]
socket = "{work}/sock/gpusnapd.sock"
state_dir = "{work}/state"

[store]
url = "file://{work}/store"
key_file = "{work}/signing.key"

[gpu]
driver = "none"   # tinylm runs on the CPU

[[workload]]
name = "tinylm"
pid_file = "{work}/run/tinylm.pid"
engine = {{ name = "numpy", version = "{numpy.__version__}" }}
model = {{ name = "gpusnap/tinylm", revision = "seed-{seed}" }}
start = {{ command = {json.dumps(command)}, cwd = "{work}/run" }}
"""
    )
    return cfg


def gpusnap(work: Path, *args: str) -> tuple[int, dict[str, Any], str]:
    proc = subprocess.run(
        [str(BIN / "gpusnap"), "--socket", str(work / "sock" / "gpusnapd.sock"), *args],
        capture_output=True,
        text=True,
        timeout=HANG_GUARD,
        check=False,
    )
    try:
        data = json.loads(proc.stdout) if proc.stdout.strip() else {}
    except ValueError:
        data = {}
    return proc.returncode, data, proc.stderr.strip()


def main() -> int:
    p = argparse.ArgumentParser(description="gpusnap demo")
    p.add_argument("--steps", type=int, default=150, help="tokens to generate")
    p.add_argument("--checkpoint-after", type=int, default=40, help="tokens before the checkpoint")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--interval", type=float, default=0.05, help="seconds between tokens")
    p.add_argument("--workdir", type=Path, help="scratch directory (default: a new temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the scratch directory")
    args = p.parse_args()
    if os.geteuid() != 0:
        return fail("CRIU needs root: run as root (e.g. sudo bash scripts/demo.sh)")
    if not 0 < args.checkpoint_after < args.steps:
        return fail("--checkpoint-after must be between 1 and --steps - 1")

    work = (args.workdir or Path(tempfile.mkdtemp(prefix="gpusnap-demo-"))).resolve()
    for sub in ("run", "ref", "sock"):
        (work / sub).mkdir(parents=True, exist_ok=True)
    (work / "sock").chmod(0o750)
    generate_signing_key(work / "signing.key")
    cfg = write_config(work, args.steps, args.seed)
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    kept = args.keep or args.workdir is not None
    say(f"scratch directory: {work} ({'kept' if kept else 'removed at the end; --keep keeps it'})")
    say(
        "no GPU in this demo: tinylm runs on the CPU (numpy) and gpusnapd's GPU support is off "
        '([gpu] driver = "none"); on a GPU node the same commands also take device memory'
    )

    daemon_log = open(work / "gpusnapd.log", "wb")  # noqa: SIM115 - lives as long as the daemon
    daemon = subprocess.Popen(
        [str(BIN / "gpusnapd"), "--config", str(cfg)],
        stdin=subprocess.DEVNULL,
        stdout=daemon_log,
        stderr=daemon_log,
        env=env,
    )
    workload: subprocess.Popen[bytes] | None = None
    try:

        def daemon_up() -> bool:
            return daemon.poll() is not None or gpusnap(work, "status", "--json")[0] == 0

        wait_for("gpusnapd to serve", daemon_up)
        if daemon.poll() is not None:
            return fail(f"gpusnapd exited: see {work / 'gpusnapd.log'}")
        say(f"gpusnapd running (pid {daemon.pid}), store file://{work}/store")

        tokens = work / "run" / "tokens.txt"
        with open(work / "run" / "tinylm.log", "ab") as log:
            workload = subprocess.Popen(
                [
                    sys.executable, str(TINYLM), "--out", str(tokens),
                    "--steps", str(args.steps), "--seed", str(args.seed),
                    "--interval", str(args.interval),
                    "--pid-file", str(work / "run" / "tinylm.pid"),
                ],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, cwd=work / "run", env=env,
                start_new_session=True,
            )  # fmt: skip
        say(f"tinylm generating {args.steps} tokens (pid {workload.pid})")
        wait_for(
            f"{args.checkpoint_after} tokens",
            lambda: len(lines(tokens)) >= args.checkpoint_after,
        )

        rc, ck, err = gpusnap(work, "checkpoint", "--workload", "tinylm", "--wait", "--json")
        if rc != 0:
            return fail(f"checkpoint failed (exit {rc}): {err}")
        before = len(lines(tokens))
        workload.wait(HANG_GUARD)  # the dump killed it; reap it so its pid is free again
        say(
            f"checkpoint {ck['checkpoint_id']} after {before} tokens: "
            f"{_mib(ck['bytes_total'])} ({_mib(ck['bytes_uploaded'])} uploaded), "
            f"pause {ck['pause_seconds'] * 1000:.0f} ms, committed in {ck['seconds']:.2f} s; "
            "tinylm is gone"
        )

        rc, rs, err = gpusnap(
            work, "restore", "--workload", "tinylm", "--latest", "--wait", "--json"
        )
        if rc != 0:
            return fail(f"restore failed (exit {rc}): {err}")
        if rs.get("mode") != "restored":
            return fail(f"restore cold-started instead: {rs.get('reasons')}")
        say(f"restored as pid {rs['pids'][0]} in {rs['seconds']:.2f} s; generation continues")
        wait_for("the restored run to finish", lambda: lines(tokens)[-1:] == [b"done"])

        ref = work / "ref" / "tokens.txt"
        subprocess.run(
            [sys.executable, str(TINYLM), "--out", str(ref), "--steps", str(args.steps),
             "--seed", str(args.seed), "--interval", "0"],
            check=True, env=env, timeout=HANG_GUARD, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        got, want = lines(tokens), lines(ref)
        summary = {
            "identical": got == want,
            "tokens": args.steps,
            "tokens_before_checkpoint": before,
            "checkpoint_id": ck["checkpoint_id"],
            "checkpoint_bytes": ck["bytes_total"],
            "uploaded_bytes": ck["bytes_uploaded"],
            "pause_seconds": ck["pause_seconds"],
            "checkpoint_seconds": ck["seconds"],
            "restore_seconds": rs["seconds"],
            "gpu": False,
            "workdir": str(work) if kept else None,
        }
        if got == want:
            say(
                f"IDENTICAL: all {args.steps} tokens of the restored run match an uninterrupted run"
            )
        else:
            first = next(
                (i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b),
                min(len(got), len(want)),
            )
            a = got[first].decode() if first < len(got) else "(end)"
            b = want[first].decode() if first < len(want) else "(end)"
            say(f"DIFFERENT at line {first + 1}: restored {a!r}, uninterrupted {b!r}")
        say(json.dumps(summary))
        return 0 if got == want else 1
    except (TimeoutError, RuntimeError, subprocess.SubprocessError, OSError) as exc:
        return fail(f"{exc} (logs in {work})")
    finally:
        if workload is not None and workload.poll() is None:
            workload.kill()
            workload.wait()
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(HANG_GUARD)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()
        daemon_log.close()
        if kept:
            say(
                f"files kept in {work}: gpusnapd.toml, signing.key, store/, gpusnapd.log, "
                "run/ (tokens.txt, tinylm.log), ref/tokens.txt"
            )
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
