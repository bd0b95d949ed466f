"""``gpusnap plan``: the subcommand's options, and the one function that runs it.

Needs no daemon, but for ``--workload NAME``: the figures of that workload's real last
checkpoints, asked of this node's daemon (``measured``). With ``--store URL`` it measures
upload bandwidth through the store's backend (``bandwidth``); otherwise it touches nothing but
the files it is given.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

from gpusnap.cli._common import Subparsers, common_parser, positive_int
from gpusnap.cli._output import print_json
from gpusnap.cli.plan import bandwidth, engines, families, measured, weights
from gpusnap.cli.plan.estimate import make_plan, measured_only
from gpusnap.cli.plan.render import render, render_measured_only
from gpusnap.errors import EXIT_OK, InvalidArgument
from gpusnap.storage import BackendOptions
from gpusnap.storage.manifest import check_workload

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?)b?(?:/s)?\s*$", re.IGNORECASE)
_POWER = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}


def parse_bytes(text: str) -> int:
    """``141GB``, ``80GiB``, ``150e9``, ``1.25GB/s`` → bytes (K/M/G/T/P decimal, Ki/Mi/Gi/Ti/Pi
    binary; a trailing ``/s`` lets a bandwidth read as one). For argparse ``type=``."""
    try:
        value = float(text)
    except ValueError:
        m = _SIZE.match(text)
        if not m:
            raise argparse.ArgumentTypeError(
                f"not a size: {text!r} (use e.g. 141GB, 80GiB or 1.25GB/s)"
            ) from None
        number, prefix, binary = m.groups()
        value = float(number) * (1024 if binary else 1000) ** _POWER[prefix.lower()]
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive size: {text!r}")
    return int(value)


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1]: {text!r}")
    return value


def _path(text: str) -> Path:
    if not text.strip():
        raise argparse.ArgumentTypeError("a path must not be empty")
    return Path(text)


def register(subparsers: Subparsers) -> None:
    p = subparsers.add_parser(
        "plan",
        parents=[common_parser()],
        help="size a model's KV cache, state and checkpoints; does a reclaim fit the notice?",
        description="Size what a serving process holds for a model on an engine (KV cache, "
        "recurrent state, the pre-allocated pool), its full and reclaim checkpoints, and "
        "whether the reclaim checkpoint uploads within AWS's, GCP's and Azure's notice. "
        "No daemon needed. See docs/planning.md.",
    )
    p.add_argument(
        "--model",
        type=_path,
        metavar="DIR|config.json",
        help="the model's directory or its config.json (needed unless --workload)",
    )
    p.add_argument(
        "--workload",
        metavar="NAME",
        help="this node's workload: the checkpoint figures from its real last checkpoints "
        "(asked of the daemon) instead of estimates",
    )
    p.add_argument(
        "--safetensors-index",
        type=_path,
        metavar="FILE",
        help="model.safetensors.index.json (default: the one beside config.json)",
    )
    p.add_argument("--engine", choices=engines.ENGINES, default="vllm", help="default vllm")
    p.add_argument(
        "--kv-dtype",
        choices=engines.KV_DTYPES,
        default="auto",
        help="attention KV element type (auto: the model's dtype)",
    )
    p.add_argument(
        "--gpu-memory",
        type=parse_bytes,
        metavar="BYTES",
        help="memory of one GPU, e.g. 141GB or 80GiB (sizes the pool)",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=_fraction,
        metavar="F",
        help="vLLM's --gpu-memory-utilization / SGLang's --mem-fraction-static "
        "(default: the engine's)",
    )
    p.add_argument(
        "--tp",
        type=positive_int,
        default=1,
        metavar="N",
        help="tensor-parallel GPUs on the node (default 1)",
    )
    p.add_argument(
        "--sessions",
        type=positive_int,
        metavar="N",
        help="live sessions at reclaim time (default: as many as the pool holds)",
    )
    p.add_argument(
        "--context",
        type=positive_int,
        metavar="TOKENS",
        help="tokens per session (default: 32768, or the model's maximum if less)",
    )
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--bandwidth",
        type=parse_bytes,
        metavar="BYTES/S",
        help="the node's upload bandwidth to the store, e.g. 1.25GB/s",
    )
    where.add_argument(
        "--store",
        metavar="URL",
        help="measure the bandwidth with a short timed upload to this store",
    )
    p.add_argument(
        "--probe-bytes",
        type=parse_bytes,
        default=bandwidth.DEFAULT_PROBE_BYTES,
        metavar="BYTES",
        help="how much --store uploads to measure (default 64MiB)",
    )
    p.add_argument(
        "--endpoint-url", metavar="URL", help="S3 endpoint for --store (env AWS_ENDPOINT_URL)"
    )
    p.add_argument(
        "--block-size",
        type=positive_int,
        metavar="TOKENS",
        help="vLLM's --block-size (default: vLLM's choice for the model)",
    )
    p.add_argument(
        "--overhead",
        type=parse_bytes,
        metavar="BYTES",
        help="device memory per GPU beside weights and pool (default: modelled)",
    )
    p.add_argument(
        "--host-bytes",
        type=parse_bytes,
        metavar="BYTES",
        help="host pages of the engine process per GPU (default 2GiB)",
    )
    p.add_argument(
        "--plot",
        type=_path,
        metavar="FILE.png",
        help="draw state per session against context, with the reclaim windows",
    )
    p.set_defaults(func=cmd_plan)


def cmd_plan(args: argparse.Namespace) -> int:
    if args.model is None and args.workload is None:
        raise InvalidArgument("gpusnap plan needs --model, --workload, or both")
    if args.model is None and args.plot is not None:
        raise InvalidArgument("--plot needs --model (it draws the model's state)")
    if args.workload is not None:
        check_workload(args.workload)
    # Asked first: a workload with no checkpoint (exit 3) or no daemon (exit 5) says so
    # before any model file is read or bandwidth probed.
    real = measured.from_daemon(args, args.workload) if args.workload else None
    rate, source = _bandwidth(args)
    if args.model is None:
        assert real is not None
        doc, fits = measured_only(real, rate, source)
        if args.json:
            print_json(doc)
        else:
            sys.stdout.write(render_measured_only(doc, real, fits))
        return EXIT_OK

    model = families.read_model(args.model)
    engine = engines.resolve(
        model,
        args.engine,
        tp=args.tp,
        kv_dtype=args.kv_dtype,
        block_size=args.block_size,
        utilization=args.gpu_memory_utilization,
    )
    found = weights.find(args.model, args.safetensors_index)
    plan = make_plan(
        model_path=str(args.model),
        model=model,
        engine=engine,
        context=args.context,
        sessions=args.sessions,
        weights=found,
        gpu_memory=args.gpu_memory,
        overhead=args.overhead,
        host_bytes=args.host_bytes,
        bandwidth=rate,
        bandwidth_source=source,
        measured=real,
    )
    if args.plot is not None:
        from gpusnap.cli.plan import plot  # noqa: PLC0415 - matplotlib only for --plot

        plot.draw(plan, args.plot)
    if args.json:
        doc = plan.to_json()
        doc["plot"] = str(args.plot) if args.plot is not None else None
        print_json(doc)
    else:
        sys.stdout.write(render(plan))
        if args.plot is not None:
            sys.stdout.write(f"plot: {args.plot}\n")
    return EXIT_OK


def _bandwidth(args: argparse.Namespace) -> tuple[float | None, str | None]:
    """The upload bandwidth given (``--bandwidth``) or measured (``--store``), and its source."""
    if args.store:
        endpoint = args.endpoint_url or os.environ.get("AWS_ENDPOINT_URL") or None
        probe = bandwidth.measure(
            args.store,
            total_bytes=args.probe_bytes,
            options=BackendOptions(endpoint_url=endpoint, retry_attempts=3, retry_deadline=30.0),
        )
        return probe.bytes_per_second, (
            f"measured: {probe.bytes_sent} bytes to {args.store} in {probe.seconds:.3f} s"
        )
    rate: float | None = args.bandwidth
    return rate, "--bandwidth" if rate else None
