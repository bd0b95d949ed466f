"""``gpusnap``: the operator CLI.

``gpusnap store …`` (``cli/store_cmds.py``) works on a store directly and ``gpusnap plan``
(``cli/plan/``) on a model's config, both without the daemon; the daemon and trigger commands
(``cli/daemon_cmds.py``, ``cli/trigger_cmds.py``) talk to ``gpusnapd`` over gRPC. Each command
module has one ``register(subparsers)``; a new one is imported here and named in
``COMMAND_MODULES``.

Exit codes (one table, ``gpusnap/errors.py``): 0 success, 1 any other error, 2 usage error,
3 not found, 4 integrity or authenticity failure, 5 daemon unreachable, 130 interrupted.
Errors are one line on stderr, never a traceback (unless ``-v`` or ``GPUSNAP_DEBUG=1``).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import traceback

from gpusnap import __version__
from gpusnap.cli import (
    cache_cmds,
    daemon_cmds,
    exec_cmd,
    plan,
    preflight_cmds,
    store_cmds,
    trigger_cmds,
)
from gpusnap.cli._common import Parser, UsageError, common_parser
from gpusnap.cli._output import PROG, print_error
from gpusnap.errors import EXIT_FAILURE, GpusnapError
from gpusnap.storage.redact import RedactSecrets

# Every command module, in the order `gpusnap --help` lists their commands.
COMMAND_MODULES = (
    store_cmds,
    cache_cmds,
    plan,
    daemon_cmds,
    preflight_cmds,
    trigger_cmds,
    exec_cmd,
)

EXIT_INTERRUPTED = 130


def _add_connection_options(parser: argparse.ArgumentParser) -> None:
    """Where gpusnapd is: its unix socket, or its mutual-TLS TCP listener. No defaults here:
    ``cli/_client.connect`` reads the environment, so an option can beat a variable."""
    g = parser.add_argument_group("reaching gpusnapd (before the command)")
    g.add_argument("--socket", metavar="PATH", help="gpusnapd's API socket (env GPUSNAP_SOCKET)")
    g.add_argument(
        "--address",
        metavar="HOST:PORT",
        help="gpusnapd's mutual-TLS listener instead of the socket; needs --tls-ca, --tls-cert "
        "and --tls-key (env GPUSNAP_ADDRESS)",
    )
    g.add_argument(
        "--tls-ca",
        metavar="FILE",
        help="CA (PEM) that signs the daemon's certificate (env GPUSNAP_TLS_CA)",
    )
    g.add_argument(
        "--tls-cert",
        metavar="FILE",
        help="client certificate (PEM), signed by the daemon's client CA (env GPUSNAP_TLS_CERT)",
    )
    g.add_argument(
        "--tls-key",
        metavar="FILE",
        help="the client certificate's private key (PEM, unencrypted) (env GPUSNAP_TLS_KEY)",
    )
    g.add_argument(
        "--tls-server-name",
        metavar="NAME",
        help="name to verify in the daemon's certificate instead of HOST "
        "(env GPUSNAP_TLS_SERVER_NAME)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog=PROG,
        description="Checkpoint, ship and restore GPU workloads.",
        parents=[common_parser()],
        epilog="exit codes: 0 ok, 1 error, 2 usage, 3 not found, 4 integrity/authenticity, "
        "5 daemon unreachable",
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    _add_connection_options(parser)
    subparsers = parser.add_subparsers(dest="command", metavar="<command>", required=True)
    for module in COMMAND_MODULES:
        module.register(subparsers)
    return parser


def _debug_wanted(args: argparse.Namespace | None) -> bool:
    if os.environ.get("GPUSNAP_DEBUG", "") not in ("", "0"):
        return True
    return bool(args is not None and getattr(args, "verbose", 0))


def _configure_logging(verbose: int) -> None:
    """Library logs (retries and the like) go to stderr only with -v: an error is one line."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"{PROG}: %(levelname)s: %(name)s: %(message)s"))
    handler.addFilter(RedactSecrets())  # botocore's debug lines carry credentials
    root = logging.getLogger()
    root.handlers[:] = [handler]
    if verbose <= 0:
        root.setLevel(logging.CRITICAL + 1)  # the failure itself is reported by main()
    else:
        root.setLevel(logging.INFO if verbose == 1 else logging.DEBUG)


def main(argv: list[str] | None = None) -> int:
    _configure_logging(0)
    parser = build_parser()
    args: argparse.Namespace | None = None
    words = sys.argv[1:] if argv is None else argv
    try:
        try:
            args = parser.parse_args(argv)
        except UsageError as err:  # before args exist: --json as it was typed
            return print_error(err, as_json="--json" in words[: _end_of_options(words)])
        if not hasattr(args, "json"):
            args.json = False
        if not hasattr(args, "verbose"):
            args.verbose = 0
        _configure_logging(args.verbose)
        code: int = args.func(args)
        return code
    except GpusnapError as err:
        return print_error(err, as_json=bool(args is not None and args.json))
    except KeyboardInterrupt:
        sys.stderr.write(f"\n{PROG}: interrupted\n")
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (`gpusnap store ls | head`); stay quiet about it.
        with contextlib.suppress(OSError):
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - replaces the closed pipe
        return EXIT_FAILURE
    except OSError as err:
        # A local file problem the library did not translate: still one clear line.
        if _debug_wanted(args):
            traceback.print_exc()
        return print_error(err, as_json=bool(args is not None and args.json), kind="os_error")
    except Exception as err:
        if _debug_wanted(args):
            traceback.print_exc()
        return print_error(err, as_json=bool(args is not None and args.json), internal=True)


def _end_of_options(words: list[str]) -> int:
    return words.index("--") if "--" in words else len(words)


if __name__ == "__main__":
    sys.exit(main())
