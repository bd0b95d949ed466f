"""Options shared by every ``gpusnap`` command, and the store options of ``gpusnap store``.

Every subcommand takes ``parents=[common_parser()]`` so ``--json`` and ``-v`` work after the
command name. Command modules (``store_cmds``, ``daemon_cmds``, ``trigger_cmds``) expose
``register(subparsers)`` and set ``func(args) -> int`` on each parser they add.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import os
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from gpusnap.errors import InvalidArgument
from gpusnap.storage import CheckpointStore, ChunkCache, open_store
from gpusnap.storage.backend import MAX_PART_BYTES, MAX_WORKERS, MIN_PART_BYTES, BackendOptions

# The store used when neither --store nor GPUSNAP_STORE names one (see docs).
DEFAULT_STORE_URL = "file:///var/lib/gpusnap/store"

# How long one store request is retried (backoff with jitter) before the command fails: a
# deadline rather than a count, so a few seconds of S3 SlowDown are always ridden out.
DEFAULT_RETRY_FOR = 30.0
_RETRY_ATTEMPTS_CAP = 1000  # the deadline, not this cap, ends the retries

# What ``add_subparsers()`` returns; generic only to the type checker.
if TYPE_CHECKING:
    Subparsers = argparse._SubParsersAction[argparse.ArgumentParser]
else:
    Subparsers = argparse._SubParsersAction

_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)([smhd])")
_DURATION_WHOLE = re.compile(r"(?:\d+(?:\.\d+)?[smhd])+")
_UNIT_SECONDS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


class UsageError(InvalidArgument):
    """A command line argparse refuses: one line, exit 2, and with ``--json`` the error object
    on stdout too (``cli/main.py``)."""


class Parser(argparse.ArgumentParser):
    """``argparse`` whose errors are a ``UsageError`` (one line naming the command and where its
    help is) instead of a usage block and ``SystemExit``. An option the command does not have
    is named as such, not hidden behind a missing required argument (argparse checks those
    first). Subcommand parsers are of this class too (``add_subparsers`` keeps it)."""

    _seen: Sequence[str] = ()

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        self._seen = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:  # named against the command that was given, not the top level
            prog = getattr(parsed, "command_prog", self.prog)
            raise _usage(prog, f"unrecognized argument {extras[0]}")
        return parsed

    def error(self, message: str) -> NoReturn:
        unknown = self._unknown_options()
        if unknown and "required" in message:
            message = f"unrecognized argument {unknown[0]}"
        elif "invalid choice" in message:
            message = _with_suggestion(message)
        raise _usage(self.prog, message)

    def _unknown_options(self) -> list[str]:
        known = list(self._option_string_actions)
        out = []
        for arg in self._seen:
            if arg == "--":
                break
            if not arg.startswith("-") or arg == "-" or _NUMBER.fullmatch(arg):
                continue
            name = arg.split("=", 1)[0]
            if name.startswith("--"):
                if any(k.startswith(name) for k in known):  # exact, or a prefix argparse takes
                    continue
            elif name[:2] in known:  # -v, -vv, -xVALUE
                continue
            out.append(name)
        return out


def _usage(prog: str, message: str) -> UsageError:
    """``checkpoint: <message> (see `gpusnap checkpoint --help`)``: one line."""
    command = prog.partition(" ")[2]
    return UsageError(f"{command + ': ' if command else ''}{message} (see `{prog} --help`)")


_NUMBER = re.compile(r"-\d+(\.\d+)?")
_CHOICE = re.compile(r"invalid choice: '([^']*)' \(choose from (.*)\)")


def _with_suggestion(message: str) -> str:
    m = _CHOICE.search(message)
    if m is None:
        return message
    choices = [c.strip().strip("'") for c in m[2].split(",")]
    close = difflib.get_close_matches(m[1], choices, n=1)
    hint = f"did you mean {close[0]!r}?" if close else f"one of {', '.join(choices)}"
    return f"{message[: m.start()]}invalid choice {m[1]!r} ({hint})"


def common_parser() -> argparse.ArgumentParser:
    """``--json`` and ``-v``; add as a parent to every command parser."""
    p = Parser(add_help=False)
    # SUPPRESS keeps a value given before the command from being reset by a subparser;
    # main() fills in the defaults afterwards, so ``args.json`` always exists.
    p.add_argument(
        "--json",
        action="store_true",
        default=argparse.SUPPRESS,
        help="print machine-readable JSON on stdout (errors too)",
    )
    p.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=argparse.SUPPRESS,
        help="more detail on stderr (a traceback for internal errors)",
    )
    return p


def add_command(
    subparsers: Subparsers,
    name: str,
    func: Callable[[argparse.Namespace], int],
    help_text: str,
    parents: Sequence[argparse.ArgumentParser] | None = None,
) -> argparse.ArgumentParser:
    """Add the command ``name`` that runs ``func(args) -> exit code``; with ``--json`` and
    ``-v`` unless other ``parents`` are given. Returns its parser, for its own arguments."""
    p = subparsers.add_parser(name, parents=list(parents or [common_parser()]), help=help_text)
    p.set_defaults(func=func, command_prog=p.prog)
    return p


def add_group(subparsers: Subparsers, name: str, help_text: str, description: str) -> Subparsers:
    """Add the command group ``name`` (``gpusnap NAME <NAME command>``, one required); returns
    the subparsers its commands are added to (``add_command``). The chosen one is in
    ``args.NAME_command``."""
    group = subparsers.add_parser(
        name, help=help_text, description=description, parents=[common_parser()]
    )
    return group.add_subparsers(dest=f"{name}_command", metavar=f"<{name} command>", required=True)


# No duration any option takes comes near this (31 years).
MAX_DURATION_SECONDS = 1e9


def parse_duration(text: str) -> float:
    """``0s``, ``90s``, ``30m``, ``2h``, ``1d``, ``1h30m`` -> seconds. For argparse ``type=``."""
    s = text.strip().lower()
    if not _DURATION_WHOLE.fullmatch(s):
        raise argparse.ArgumentTypeError(
            f"invalid duration {text!r} (use e.g. 0s, 90s, 30m, 2h, 1d or 1h30m)"
        )
    return checked_seconds(
        sum(float(n) * _UNIT_SECONDS[u] for n, u in _DURATION_PART.findall(s)), text
    )


def checked_seconds(value: float, text: str) -> float:
    """``value`` if it is a finite number of seconds no option could mean more than."""
    if not math.isfinite(value) or not 0 <= value <= MAX_DURATION_SECONDS:
        raise argparse.ArgumentTypeError(
            f"invalid duration {text!r} (0 to {MAX_DURATION_SECONDS:g} seconds)"
        )
    return value


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {text!r}")
    return value


def worker_count(text: str) -> int:
    """``--workers N``: 1 to ``MAX_WORKERS``."""
    value = positive_int(text)
    if value > MAX_WORKERS:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_WORKERS}: {text!r}")
    return value


def part_size(text: str) -> int:
    """An S3 multipart part size: ``byte_size`` within S3's bounds."""
    value = byte_size(text)
    if not MIN_PART_BYTES <= value <= MAX_PART_BYTES:
        raise argparse.ArgumentTypeError(
            f"a part is {MIN_PART_BYTES} to {MAX_PART_BYTES} bytes (5MiB to 5GiB), not {text!r}"
        )
    return value


_SIZE = re.compile(r"(\d+)\s*([KMG]i?B?|B)?", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "B": 1, "K": 1024, "M": 1024**2, "G": 1024**3}


def byte_size(text: str) -> int:
    """``5242881``, ``512KiB``, ``8MiB``, ``1G`` -> bytes (binary units). For argparse."""
    match = _SIZE.fullmatch(text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"invalid size {text!r} (use e.g. 8MiB or 5242880)")
    unit = (match.group(2) or "").upper()[:1]
    value = int(match.group(1)) * _SIZE_UNITS[unit]
    if value < 1:
        raise argparse.ArgumentTypeError(f"a size must be at least 1 byte: {text!r}")
    return value


def store_parser() -> argparse.ArgumentParser:
    """Where the store is and how to reach it; a parent of every ``gpusnap store`` command."""
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("store")
    g.add_argument(
        "--store",
        metavar="URL",
        help=f"file:///path or s3://bucket/prefix (env GPUSNAP_STORE; default {DEFAULT_STORE_URL})",
    )
    g.add_argument(
        "--key-file",
        metavar="FILE",
        type=Path,
        help="manifest signing key (env GPUSNAP_KEY_FILE); make one with `store keygen`",
    )
    g.add_argument(
        "--trusted-keys",
        metavar="PATH",
        type=Path,
        action="append",
        help="a public key file, or a directory of *.pub files, whose signatures this node "
        "accepts besides its own key's (repeatable; env GPUSNAP_TRUSTED_KEYS, ':'-separated)",
    )
    g.add_argument(
        "--encryption-key-file",
        metavar="FILE",
        type=Path,
        help="client-side chunk encryption key (env GPUSNAP_ENCRYPTION_KEY_FILE)",
    )
    g.add_argument("--endpoint-url", metavar="URL", help="S3 endpoint (env AWS_ENDPOINT_URL)")
    g.add_argument("--region", help="S3 region (default: boto3's configuration chain)")
    g.add_argument(
        "--addressing-style", choices=("auto", "path", "virtual"), help="S3 addressing style"
    )
    g.add_argument(
        "--sse", choices=("AES256", "aws:kms"), help="S3 server-side encryption for new objects"
    )
    g.add_argument("--sse-kms-key-id", metavar="ID", help="KMS key for --sse aws:kms")
    g.add_argument(
        "--multipart-threshold",
        type=byte_size,
        metavar="SIZE",
        help="S3: objects this large or larger go up in parts (e.g. 64MiB; the default)",
    )
    g.add_argument(
        "--multipart-chunksize",
        type=part_size,
        metavar="SIZE",
        help="S3: the size of each part (at least 5MiB; default 16MiB)",
    )
    g.add_argument("--cache-dir", metavar="DIR", type=Path, help="local chunk-index cache")
    g.add_argument("--workers", type=worker_count, metavar="N", help="parallel transfers")
    g.add_argument(
        "--retry-for",
        type=parse_duration,
        default=DEFAULT_RETRY_FOR,
        metavar="DURATION",
        help="keep retrying a failing store request (5xx, connection errors) with backoff "
        "for this long before giving up; 0s: no retries (default 30s)",
    )
    g.add_argument(
        "--insecure-skip-verify",
        action="store_true",
        help="read manifests without checking their signature (unsafe)",
    )
    return p


def _env_path(value: Path | None, env: str) -> Path | None:
    if value is not None:
        return value
    from_env = os.environ.get(env)
    return Path(from_env) if from_env else None


def store_url(args: argparse.Namespace) -> str:
    url: str | None = args.store or os.environ.get("GPUSNAP_STORE")
    return url or DEFAULT_STORE_URL


def backend_options(args: argparse.Namespace) -> BackendOptions:
    sizes = {
        name: value
        for name in ("multipart_threshold", "multipart_chunksize")
        if (value := getattr(args, name, None)) is not None
    }
    return BackendOptions(
        endpoint_url=args.endpoint_url or os.environ.get("AWS_ENDPOINT_URL") or None,
        region=args.region,
        addressing_style=args.addressing_style,
        sse=args.sse,
        sse_kms_key_id=args.sse_kms_key_id,
        retry_attempts=_RETRY_ATTEMPTS_CAP if args.retry_for > 0 else 1,
        retry_deadline=args.retry_for if args.retry_for > 0 else None,
        **sizes,
    )


def add_allow_rollback(p: argparse.ArgumentParser) -> None:
    """``--allow-rollback``: for commands that pick a workload's latest checkpoint."""
    p.add_argument(
        "--allow-rollback",
        action="store_true",
        help="accept an older checkpoint as the latest when the store's head record is "
        "missing, older than this node has seen, or names a checkpoint the store lacks",
    )


def trusted_keys(args: argparse.Namespace) -> list[Path]:
    """``--trusted-keys`` (repeatable), else ``GPUSNAP_TRUSTED_KEYS`` (``:``-separated)."""
    given: list[Path] | None = getattr(args, "trusted_keys", None)
    if given:
        return given
    return [Path(p) for p in os.environ.get("GPUSNAP_TRUSTED_KEYS", "").split(":") if p]


def open_store_from_args(
    args: argparse.Namespace, *, create: bool = True, chunk_cache: ChunkCache | None = None
) -> CheckpointStore:
    """Open the store the options name; without ``create`` a missing one is ``NotFound``.
    ``chunk_cache``: the node's chunk cache, for a pull (the caller closes it)."""
    return open_store(
        store_url(args),
        key_file=_env_path(args.key_file, "GPUSNAP_KEY_FILE"),
        encryption_key_file=_env_path(args.encryption_key_file, "GPUSNAP_ENCRYPTION_KEY_FILE"),
        options=dataclasses.replace(backend_options(args), create=create),
        verify=not args.insecure_skip_verify,
        cache_dir=args.cache_dir,
        workers=args.workers,
        trusted_keys=trusted_keys(args),
        chunk_cache=chunk_cache,
    )


def stderr_is_tty() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False
