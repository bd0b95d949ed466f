"""``gpusnap store …``: push, pull, list, show, verify and gc a checkpoint store directly;
make and show signing keys (``keygen``, ``pubkey``).

These commands need no daemon. The store is named by ``--store URL`` or ``GPUSNAP_STORE``
(default ``file:///var/lib/gpusnap/store``); see ``_common.store_parser`` for the rest.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from gpusnap.cli._common import (
    Subparsers,
    add_allow_rollback,
    add_command,
    add_group,
    common_parser,
    open_store_from_args,
    parse_duration,
    positive_int,
    stderr_is_tty,
    store_parser,
)
from gpusnap.cli._output import emit, human_bytes, out, print_json, render_table, when
from gpusnap.cli.cache_cmds import open_pull_cache
from gpusnap.cli.manifest_view import add_show_env, redact_env, render_manifest
from gpusnap.cli.progress import ProgressBar
from gpusnap.errors import (
    EXIT_INTEGRITY,
    EXIT_OK,
    AlreadyExists,
    GpusnapError,
    InvalidArgument,
    NotFound,
    exit_code_for,
)
from gpusnap.storage import (
    CheckpointStore,
    export_public_key,
    generate_encryption_key,
    generate_signing_key,
    public_key_path,
)
from gpusnap.storage.keys import load_signing_key

Progress = Callable[[int, int], None]


def _path_arg(text: str) -> Path:
    """A path argument; an empty string would silently mean the current directory."""
    if not text.strip():
        raise argparse.ArgumentTypeError("a path must not be empty")
    return Path(text)


def register(subparsers: Subparsers) -> None:
    sub = add_group(
        subparsers,
        "store",
        "work on a checkpoint store directly (no daemon needed)",
        "Work on a checkpoint store directly; no daemon needed.",
    )
    parents = [common_parser(), store_parser()]

    p = add_command(sub, "push", cmd_push, "upload a directory as a new checkpoint", parents)
    p.add_argument("dir", type=_path_arg, metavar="DIR", help="directory to upload")
    p.add_argument("--workload", required=True, metavar="NAME", help="workload name")
    p.add_argument("--parent", metavar="ID", help="checkpoint this one follows")
    p.add_argument(
        "--full",
        action="store_true",
        help="upload every chunk, whatever the local index says (replaces damaged objects)",
    )

    p = add_command(sub, "pull", cmd_pull, "download a checkpoint into a directory", parents)
    p.add_argument("checkpoint_id", metavar="ID")
    p.add_argument("dest", type=_path_arg, metavar="DEST", help="destination directory")
    p.add_argument(
        "--no-cache",
        action="store_true",
        help="neither read nor fill the node's chunk cache",
    )
    p.epilog = (
        "Chunks come from the node's chunk cache first: the one in --cache-dir (which then "
        "also holds the chunk index), else GPUSNAP_CACHE_DIR, else the daemon's "
        "/var/lib/gpusnap/cache where it exists. Every cached chunk is verified like a "
        "store's; --json reports bytes_fetched (from the store) and bytes_cached."
    )

    p = add_command(sub, "ls", cmd_ls, "list checkpoints, newest first", parents)
    p.add_argument("--workload", metavar="NAME", help="only this workload's checkpoints")

    p = add_command(
        sub,
        "latest",
        cmd_latest,
        "the newest checkpoint of a workload, checked for rollback",
        parents,
    )
    p.add_argument("--workload", required=True, metavar="NAME", help="workload name")
    add_allow_rollback(p)
    p.epilog = (
        "Refused (exit 4) when the workload's head record names a checkpoint the store no "
        "longer has, or is older than the newest head this node has seen (kept in "
        "heads.json in --cache-dir, default the store's chunk-index directory)."
    )

    p = add_command(sub, "show", cmd_show, "describe one checkpoint", parents)
    p.add_argument("checkpoint_id", metavar="ID")
    add_show_env(p)

    p = add_command(sub, "verify", cmd_verify, "check checkpoints are complete and intact", parents)
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("checkpoint_id", metavar="ID", nargs="?", help="checkpoint to verify")
    which.add_argument("--all", action="store_true", help="verify every checkpoint")
    p.add_argument(
        "--read-data", action="store_true", help="re-read and re-hash every chunk (slow)"
    )

    p = add_command(sub, "gc", cmd_gc, "delete unreferenced chunks, apply retention", parents)
    p.add_argument(
        "--keep-last",
        type=positive_int,
        metavar="N",
        help="keep only the newest N checkpoints of each workload",
    )
    p.add_argument(
        "--grace",
        type=parse_duration,
        metavar="DURATION",
        help="spare chunks younger than this, so pushes in flight keep theirs "
        "(e.g. 0s, 30m, 2h, 1d, 1h30m; default 1h)",
    )
    p.add_argument("--dry-run", action="store_true", help="report, delete nothing")

    p = add_command(
        sub,
        "keygen",
        cmd_keygen,
        "create this node's signing key and FILE.pub beside it (or, with --encryption, a "
        "chunk encryption key)",
    )
    p.add_argument("--out", type=Path, required=True, metavar="FILE", help="key file to create")
    p.add_argument(
        "--encryption", action="store_true", help="an encryption key instead of a signing key"
    )

    p = add_command(
        sub, "pubkey", cmd_pubkey, "print the public half of a signing key (PEM) and its key id"
    )
    p.add_argument("key", type=_path_arg, metavar="KEY", help="a signing key file (or a .pub)")


# -- helpers ---------------------------------------------------------------------------


@contextmanager
def _opened(args: argparse.Namespace, *, create: bool = False) -> Iterator[CheckpointStore]:
    """The store; only a push creates one (a mistyped path to read is ``NotFound``)."""
    store = open_store_from_args(args, create=create)
    try:
        yield store
    finally:
        store.close()


@contextmanager
def _progress(args: argparse.Namespace, label: str) -> Iterator[Progress | None]:
    """A progress bar on stderr when it is a terminal and output is for a person."""
    if args.json or not stderr_is_tty():
        yield None
        return
    bar = ProgressBar("store", sys.stderr)
    bar.phase(label)
    try:
        yield bar
    finally:
        bar.close()


def _note(args: argparse.Namespace, text: str) -> None:
    """A human summary on stderr (stdout keeps the one result a script reads); never with
    --json, where the summary is the JSON itself."""
    if not args.json:
        sys.stderr.write(text + "\n")


# -- commands --------------------------------------------------------------------------


def cmd_push(args: argparse.Namespace) -> int:
    src: Path = args.dir
    if not src.exists():
        raise NotFound(f"no such directory: {src}")
    if not src.is_dir():
        raise InvalidArgument(f"{src} is not a directory; push takes a directory")
    with _opened(args, create=True) as store, _progress(args, "push") as progress:
        if args.parent is not None:
            store.manifest(args.parent)  # NotFound (3) / Corrupt (4) before any upload
        result = store.push(
            src, workload=args.workload, parent=args.parent, progress=progress, full=args.full
        )
    if args.json:
        print_json(result.as_dict())
        return EXIT_OK
    out(result.checkpoint_id)
    _note(
        args,
        f"pushed {human_bytes(result.bytes_total)} in {result.chunks_total} chunks; "
        f"uploaded {human_bytes(result.bytes_uploaded)} in {result.chunks_uploaded} new chunks "
        f"({result.seconds:.1f} s)",
    )
    if result.chunks_reuploaded:
        sys.stderr.write(
            f"gpusnap: warning: {result.chunks_reuploaded} chunk(s) the local index listed were "
            "not in the store; uploaded again (was the store recreated, restored or pruned by "
            "hand? `gpusnap store verify --all` names damaged checkpoints)\n"
        )
    return EXIT_OK


def cmd_pull(args: argparse.Namespace) -> int:
    cache = open_pull_cache(args.cache_dir, disabled=args.no_cache)
    try:
        store = open_store_from_args(args, create=False, chunk_cache=cache)
        try:
            with _progress(args, "pull") as progress:
                result = store.pull(args.checkpoint_id, args.dest, progress=progress)
        finally:
            store.close()
    finally:
        if cache is not None:
            cache.close()
    if args.json:
        print_json(result.as_dict())
        return EXIT_OK
    size = human_bytes(result.bytes_total)
    where = (
        f"; {human_bytes(result.bytes_fetched)} from the store, "
        f"{human_bytes(result.bytes_cached)} from the cache"
        if cache is not None
        else ""
    )
    _note(args, f"pulled {args.checkpoint_id} ({size}, {result.seconds:.1f} s{where})")
    out(str(args.dest))
    return EXIT_OK


def cmd_ls(args: argparse.Namespace) -> int:
    with _opened(args) as store:
        listed, skipped = store.list_checked(workload=args.workload)
    summaries = [s.as_dict() for s in listed]
    code = _skipped_code(skipped)
    if args.json:
        unreadable = [{"key": key, "error": str(err)} for key, err in skipped]
        print_json({"checkpoints": summaries, "unreadable": unreadable})
        _report_skipped(skipped)
        return code
    rows = [
        [
            s["checkpoint_id"],
            s["workload"],
            when(s["created_at"]),
            human_bytes(s["bytes_total"]),
            str(s["files"]),
        ]
        for s in summaries
    ]
    out(render_table(["ID", "WORKLOAD", "CREATED", "SIZE", "FILES"], rows))
    _report_skipped(skipped)
    return code


def _skipped_code(skipped: list[tuple[str, GpusnapError]]) -> int:
    """An ls that hid manifests it could not authenticate must not look like success."""
    if not skipped:
        return EXIT_OK
    return max(exit_code_for(err) for _key, err in skipped)


def _report_skipped(skipped: list[tuple[str, GpusnapError]]) -> None:
    if skipped:
        key, err = skipped[0]
        sys.stderr.write(
            f"gpusnap: error: {len(skipped)} manifest(s) left out, not readable or not "
            f"authentic (first: {key}: {err})\n"
        )


def cmd_latest(args: argparse.Namespace) -> int:
    with _opened(args) as store:
        latest = store.latest_checked(args.workload, allow_rollback=args.allow_rollback)
    found = latest.summary
    if latest.note is not None:
        sys.stderr.write(f"gpusnap: note: {latest.note}\n")
    if found is None:
        raise NotFound(f"workload {args.workload} has no checkpoint in the store")
    if args.json:
        print_json(found.as_dict())
    else:
        out(found.checkpoint_id)
    return EXIT_OK


def cmd_show(args: argparse.Namespace) -> int:
    with _opened(args) as store:
        manifest = store.manifest(args.checkpoint_id).to_dict()
    shown = manifest if args.show_env else redact_env(manifest)
    return emit(args.json, shown, lambda: render_manifest(shown))


def cmd_verify(args: argparse.Namespace) -> int:
    ids = None if args.all else [args.checkpoint_id]
    with _opened(args) as store:
        report = store.verify(ids, read_data=args.read_data)
    problems = list(report.problems)
    if args.json:
        print_json(report.as_dict())
    else:
        what = f"{len(report.checkpoints)} checkpoint(s), {report.chunks_checked} {report.checked}"
        if not args.read_data:
            what += " (not read back; --read-data re-hashes every chunk)"
        out(f"{'ok' if not problems else 'checked'}: {what}")
        for problem in problems:
            out(f"problem: {problem}")
        for warning in report.warnings:
            out(f"warning: {warning}")
        if report.index_dropped:
            out(
                f"the local chunk index forgot {report.index_dropped} chunk(s): the next push "
                "of the same data uploads them again, which repairs every checkpoint above"
            )
    if problems:
        sys.stderr.write(f"gpusnap: error: verify found {len(problems)} problem(s)\n")
        return EXIT_INTEGRITY
    return EXIT_OK


def cmd_gc(args: argparse.Namespace) -> int:
    kwargs: dict[str, Any] = {"keep_last": args.keep_last, "dry_run": args.dry_run}
    if args.grace is not None:
        kwargs["grace_seconds"] = args.grace
    # gc of a store not made yet is an empty gc (as it has always been), not an error.
    with _opened(args, create=True) as store:
        report = store.gc(**kwargs)
    # A gc that hit a problem (an unreadable manifest makes it keep every chunk) must not look
    # like success to a cron job, or the store silently stops shrinking. Every problem is
    # something bad in the store, so the exit code is the integrity one.
    code = EXIT_INTEGRITY if report.problems else EXIT_OK
    if args.json:
        print_json(report.as_dict())
        return code
    verb = "would delete" if args.dry_run else "deleted"
    for checkpoint in report.manifests_deleted:
        out(f"{verb} checkpoint {checkpoint} (retention)")
    out(
        f"{verb} {report.chunks_deleted} unreferenced chunks ({human_bytes(report.bytes_freed)}); "
        f"kept {report.chunks_referenced} referenced and {report.chunks_kept_in_grace} "
        "within the grace period"
    )
    if report.blocked_by:
        out(f"no chunk deleted: pushes in flight ({', '.join(report.blocked_by)})")
    if report.reserve_released:
        out("the store's disk was full: gc used the store's space reserve to run")
    if report.reserve_missing:
        out(
            "warning: could not recreate the store's space reserve (disk still too full?); "
            "free more space (a smaller --keep-last, a shorter --grace) before it fills again"
        )
    for problem in report.problems:
        out(f"problem: {problem}")
    for untrusted in report.untrusted:
        out(f"untrusted: {untrusted}; this node does not trust its signer and leaves it alone")
    if report.problems:
        sys.stderr.write(f"gpusnap: error: gc found {len(report.problems)} problem(s)\n")
    return code


def cmd_keygen(args: argparse.Namespace) -> int:
    path: Path = args.out
    public = None if args.encryption else public_key_path(path)
    for target in (path, public):
        if target is not None and (target.exists() or target.is_symlink()):
            raise AlreadyExists(f"{target} exists; refusing to overwrite a key")
    if args.encryption:
        generate_encryption_key(path)
    else:
        generate_signing_key(path)
    os.chmod(path, 0o600)
    kind = "encryption" if args.encryption else "signing"
    data: dict[str, Any] = {"key_file": str(path), "kind": kind}
    text = f"wrote {kind} key to {path} (mode 0600); keep it secret"
    if public is not None:
        export_public_key(path, public)
        key_id = load_signing_key(public).key_id
        data.update(public_key_file=str(public), key_id=key_id)
        text += (
            f"\nwrote its public key to {public} (key id {key_id}); other nodes trust this "
            "node's checkpoints by adding it to their trusted keys"
        )
    return emit(args.json, data, lambda: text)


def cmd_pubkey(args: argparse.Namespace) -> int:
    key = load_signing_key(args.key)
    pem = key.public_pem().decode()
    if args.json:
        print_json({"key_file": str(args.key), "key_id": key.key_id, "public_key": pem})
        return EXIT_OK
    sys.stdout.write(pem)
    _note(args, f"key id {key.key_id}")
    return EXIT_OK
