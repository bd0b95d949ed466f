"""``gpusnap --address HOST:PORT --tls-*``: the CLI over gpusnapd's mutual-TLS TCP listener.

One real gpusnapd for the module, serving its unix socket and a mutual-TLS listener on
127.0.0.1. The server certificate comes from one CA, client certificates from another, and a
third CA signs a stranger's certificate and plays the wrong CA. Mistakes on the client's side
(options that do not fit together, files that cannot be used) fail before any connection,
exit 2; a daemon that refuses us, or that we refuse, is exit 5 naming the address. There is
no plaintext TCP. The daemon-side listener is covered in tests/e2e/test_operations.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from cryptography.x509.oid import ExtendedKeyUsageOID

from gpusnap.errors import (
    EXIT_DAEMON_UNREACHABLE,
    EXIT_NOT_FOUND,
    EXIT_OK,
    EXIT_USAGE,
)
from tests.cli._cli import Cli, Result
from tests.support import workloads
from tests.support.criu import criu_or_skip
from tests.support.daemons import Node, Nodes
from tests.support.tls import Ca, free_port

# Neither comes from the environment of whoever runs the tests unless a test sets it.
_CLEAN_ENV = {
    "GPUSNAP_SOCKET": "",
    "GPUSNAP_ADDRESS": "",
    "GPUSNAP_TLS_CA": "",
    "GPUSNAP_TLS_CERT": "",
    "GPUSNAP_TLS_KEY": "",
    "GPUSNAP_TLS_SERVER_NAME": "",
}


@dataclass(frozen=True)
class Pki:
    """The PEM files of a test: server side, our client, and a stranger."""

    dir: Path
    server_ca: Path  # signs the daemon's certificate: the client's --tls-ca
    server_cert: Path
    server_key: Path
    client_ca: Path  # the daemon's client_ca_file
    client_cert: Path
    client_key: Path
    other_ca: Path  # signs nothing of the daemon's
    stranger_cert: Path  # a client certificate signed by other_ca
    stranger_key: Path


@dataclass(frozen=True)
class Daemon:
    node: Node
    address: str
    pki: Pki
    pid_file: Path  # of the configured workload "svc"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
    server_ca, client_ca, other_ca = Ca("server CA"), Ca("client CA"), Ca("other CA")
    files: dict[str, bytes] = {"server_ca": server_ca.pem, "client_ca": client_ca.pem}
    files["other_ca"] = other_ca.pem
    files["server_cert"], files["server_key"] = server_ca.leaf(
        "gpusnapd", ExtendedKeyUsageOID.SERVER_AUTH
    )
    files["client_cert"], files["client_key"] = client_ca.leaf(
        "operator", ExtendedKeyUsageOID.CLIENT_AUTH
    )
    files["stranger_cert"], files["stranger_key"] = other_ca.leaf(
        "intruder", ExtendedKeyUsageOID.CLIENT_AUTH
    )
    paths = {}
    for name, data in files.items():
        paths[name] = d / f"{name}.pem"
        paths[name].write_bytes(data)
    return Pki(dir=d, **paths)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, pki: Pki) -> Iterator[Daemon]:
    criu_or_skip()
    base = tmp_path_factory.mktemp("mtls-daemon")
    address = f"127.0.0.1:{free_port()}"
    pid_file = base / "svc.pid"
    nodes = Nodes(base)
    node = nodes.make(
        "a",
        extra_config=(
            f'[[workload]]\nname = "svc"\npid_file = "{pid_file}"\n\n'
            f'[daemon.tcp]\nlisten = "{address}"\ncert_file = "{pki.server_cert}"\n'
            f'key_file = "{pki.server_key}"\nclient_ca_file = "{pki.client_ca}"\n'
        ),
    )
    try:
        node.start()  # READY=1 comes once the socket and the TCP listener are both bound
        yield Daemon(node, address, pki, pid_file)
    finally:
        nodes.close()


def _cli() -> Cli:
    return Cli(dict(_CLEAN_ENV))


def _tls(
    pki: Pki, *, ca: Path | None = None, cert: Path | None = None, key: Path | None = None
) -> list[str]:
    return [
        "--tls-ca",
        str(ca or pki.server_ca),
        "--tls-cert",
        str(cert or pki.client_cert),
        "--tls-key",
        str(key or pki.client_key),
    ]


def _over_tcp(d: Daemon, *args: str) -> Result:
    return _cli()("--address", d.address, *_tls(d.pki), *args)


def _one_error_line(result: Result, code: int) -> str:
    """The single ``gpusnap: error: ...`` line of a failed command (and no traceback)."""
    assert result.rc == code, str(result)
    assert result.err.count("\n") == 1 and result.err.startswith("gpusnap: error: "), str(result)
    assert "Traceback" not in result.err
    return result.err


# --- over the listener -------------------------------------------------------------------------


@pytest.mark.criu
def test_status_workloads_and_jobs_reach_the_real_daemon_over_mutual_tls(
    daemon: Daemon, tmp_path: Path
) -> None:
    status = _over_tcp(daemon, "status", "--json")
    assert status.rc == EXIT_OK, str(status) + daemon.node.log()
    assert status.json()["node_id"] == "a"
    assert daemon.node.proc is not None and status.json()["pid"] == daemon.node.proc.pid
    assert status.json()["capabilities"]["store"] == "reachable"

    w = workloads.start_counter(tmp_path / "run", steps=0)
    try:
        daemon.pid_file.write_text(f"{w.pid}\n")
        w.wait_steps(2)
        # --wait follows the job over the Watch stream: a streaming call over TLS too.
        ck = _over_tcp(
            daemon, "checkpoint", "--workload", "svc", "--leave-running", "--wait", "--json"
        )
        assert ck.rc == EXIT_OK, str(ck) + daemon.node.log()
        assert ck.json()["state"] == "succeeded"
        checkpoint_id = ck.json()["checkpoint_id"]
    finally:
        w.kill()

    jobs = _over_tcp(daemon, "jobs", "--json")
    assert jobs.rc == EXIT_OK, str(jobs)
    states = {j["id"]: j["state"] for j in jobs.json()["jobs"]}
    assert states[ck.json()["job_id"]] == "succeeded", states
    # The same daemon, asked over its socket, says the same.
    assert daemon.node.cli("jobs", "--json").json == jobs.json()

    listed = _over_tcp(daemon, "workloads", "--json")
    assert listed.rc == EXIT_OK, str(listed)
    (svc,) = listed.json()["workloads"]
    assert svc["name"] == "svc" and svc["last_checkpoint_id"] == checkpoint_id
    human = _over_tcp(daemon, "jobs")
    assert human.rc == EXIT_OK and ck.json()["job_id"] in human.out, str(human)


@pytest.mark.criu
def test_the_daemons_error_kinds_come_back_over_tls(daemon: Daemon) -> None:
    daemon.pid_file.unlink(missing_ok=True)
    got = _over_tcp(daemon, "checkpoint", "--workload", "svc", "--json")
    assert got.rc == EXIT_NOT_FOUND, str(got)
    assert got.json()["kind"] == "not_found" and "svc.pid" in got.json()["error"]


@pytest.mark.criu
def test_address_and_tls_files_from_the_environment(daemon: Daemon) -> None:
    pki = daemon.pki
    env = {
        "GPUSNAP_ADDRESS": daemon.address,
        "GPUSNAP_TLS_CA": str(pki.server_ca),
        "GPUSNAP_TLS_CERT": str(pki.client_cert),
        "GPUSNAP_TLS_KEY": str(pki.client_key),
    }
    got = _cli()("status", "--json", env=env)
    assert got.rc == EXIT_OK, str(got)
    assert got.json()["node_id"] == "a"
    # An option beats a variable: --socket picks the socket although GPUSNAP_ADDRESS is set,
    # and --address the listener although GPUSNAP_SOCKET is set.
    by_socket = _cli()("--socket", str(daemon.node.socket), "status", "--json", env=env)
    assert by_socket.rc == EXIT_OK, str(by_socket)
    by_address = _cli()(
        "--address", daemon.address, "status", "--json",
        env={**env, "GPUSNAP_ADDRESS": "", "GPUSNAP_SOCKET": "/nonexistent/gpusnapd.sock"},
    )  # fmt: skip
    assert by_address.rc == EXIT_OK, str(by_address)


@pytest.mark.criu
def test_server_name_to_verify_can_be_given(daemon: Daemon) -> None:
    # The daemon's certificate names localhost and 127.0.0.1, not gpusnapd.example.
    good = _over_tcp(daemon, "--tls-server-name", "localhost", "status", "--json")
    assert good.rc == EXIT_OK, str(good)
    assert good.json()["node_id"] == "a"
    wrong = _over_tcp(daemon, "--tls-server-name", "gpusnapd.example", "status")
    line = _one_error_line(wrong, EXIT_DAEMON_UNREACHABLE)
    assert f"cannot reach gpusnapd at {daemon.address}: " in line
    assert "--tls-server-name" in line  # the hint


# --- refused: exit 5, one line naming the address ----------------------------------------------


@pytest.mark.criu
def test_a_client_cert_of_another_ca_is_refused_by_the_daemon(daemon: Daemon) -> None:
    pki = daemon.pki
    got = _cli()(
        "--address", daemon.address,
        *_tls(pki, cert=pki.stranger_cert, key=pki.stranger_key), "status", "--json",
    )  # fmt: skip
    _one_error_line(got, EXIT_DAEMON_UNREACHABLE)
    assert got.json()["exit_code"] == EXIT_DAEMON_UNREACHABLE
    assert got.json()["kind"] == "unreachable"
    assert got.json()["error"].startswith(f"cannot reach gpusnapd at {daemon.address}: ")
    assert "node_id" not in got.out


@pytest.mark.criu
def test_a_daemon_certificate_the_ca_did_not_sign_is_refused_by_us(daemon: Daemon) -> None:
    got = _cli()("--address", daemon.address, *_tls(daemon.pki, ca=daemon.pki.other_ca), "jobs")
    line = _one_error_line(got, EXIT_DAEMON_UNREACHABLE)
    assert line.startswith(f"gpusnap: error: cannot reach gpusnapd at {daemon.address}: ")
    assert "CERTIFICATE_VERIFY_FAILED" in line and "--tls-ca" in line
    assert got.out == ""


def test_nothing_listening_at_the_address_is_exit_5(pki: Pki) -> None:
    address = f"127.0.0.1:{free_port()}"
    got = _cli()("--address", address, *_tls(pki), "status")
    line = _one_error_line(got, EXIT_DAEMON_UNREACHABLE)
    assert line.startswith(f"gpusnap: error: cannot reach gpusnapd at {address}: ")
    assert "Connection refused" in line


# --- the client's own mistakes: exit 2 before any connection --------------------------------


@pytest.mark.parametrize("left_out", ["--tls-ca", "--tls-cert", "--tls-key"])
def test_address_without_all_three_tls_files_is_a_usage_error(pki: Pki, left_out: str) -> None:
    args = _tls(pki)
    i = args.index(left_out)
    del args[i : i + 2]
    # Nothing listens there: had the CLI tried to connect at all, this would be exit 5.
    got = _cli()("--address", f"127.0.0.1:{free_port()}", *args, "status")
    line = _one_error_line(got, EXIT_USAGE)
    assert "never plaintext TCP" in line and f"missing {left_out} " in line
    assert got.out == ""


def test_address_alone_names_every_missing_file(pki: Pki) -> None:
    got = _cli()("--address", "127.0.0.1:7443", "status", "--json")
    line = _one_error_line(got, EXIT_USAGE)
    for option in ("--tls-ca", "--tls-cert", "--tls-key"):
        assert option in line
    assert got.json()["exit_code"] == EXIT_USAGE and got.json()["kind"] == "invalid_argument"


def test_a_missing_cert_file_is_a_usage_error_naming_it(pki: Pki, tmp_path: Path) -> None:
    gone = tmp_path / "no-such-client.pem"
    got = _cli()("--address", "127.0.0.1:7443", *_tls(pki, cert=gone), "status")
    line = _one_error_line(got, EXIT_USAGE)
    assert f"cannot read --tls-cert file {gone}: No such file or directory" in line


def test_tls_files_that_cannot_be_used_are_usage_errors_naming_them(
    pki: Pki, tmp_path: Path
) -> None:
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    cases = [
        ({"ca": garbage}, f"--tls-ca file {garbage} holds no PEM certificate"),
        ({"cert": pki.client_key}, f"--tls-cert file {pki.client_key} holds no PEM certificate"),
        ({"key": pki.client_cert}, f"--tls-key file {pki.client_cert} holds no PEM private key"),
        ({"key": pki.stranger_key}, f"--tls-key file {pki.stranger_key} is not the key of"),
        ({"ca": tmp_path}, f"cannot read --tls-ca file {tmp_path}: Is a directory"),
    ]
    for files, message in cases:
        got = _cli()("--address", "127.0.0.1:7443", *_tls(pki, **files), "status")
        assert message in _one_error_line(got, EXIT_USAGE), str(got)


def test_an_unreadable_variable_file_is_named_with_its_variable(pki: Pki, tmp_path: Path) -> None:
    gone = tmp_path / "gone.key"
    env = {
        "GPUSNAP_ADDRESS": "127.0.0.1:7443",
        "GPUSNAP_TLS_CA": str(pki.server_ca),
        "GPUSNAP_TLS_CERT": str(pki.client_cert),
        "GPUSNAP_TLS_KEY": str(gone),
    }
    got = _cli()("status", env=env)
    assert f"cannot read GPUSNAP_TLS_KEY file {gone}" in _one_error_line(got, EXIT_USAGE)


def test_socket_and_address_together_is_a_usage_error(pki: Pki, tmp_path: Path) -> None:
    got = _cli()(
        "--socket", str(tmp_path / "s.sock"), "--address", "127.0.0.1:7443", *_tls(pki),
        "status", "--json",
    )  # fmt: skip
    line = _one_error_line(got, EXIT_USAGE)
    assert "--socket or --address, not both" in line
    assert got.json()["exit_code"] == EXIT_USAGE


def test_socket_and_address_both_in_the_environment_is_a_usage_error(pki: Pki) -> None:
    env = {"GPUSNAP_SOCKET": "/run/x.sock", "GPUSNAP_ADDRESS": "127.0.0.1:7443"}
    line = _one_error_line(_cli()(*_tls(pki), "status", env=env), EXIT_USAGE)
    assert "GPUSNAP_SOCKET and GPUSNAP_ADDRESS" in line


def test_tls_options_without_an_address_are_a_usage_error(pki: Pki, tmp_path: Path) -> None:
    got = _cli()("--socket", str(tmp_path / "s.sock"), "--tls-ca", str(pki.server_ca), "jobs")
    assert "--tls-ca needs --address" in _one_error_line(got, EXIT_USAGE)


@pytest.mark.parametrize(
    "address", ["127.0.0.1", "127.0.0.1:", ":7443", "127.0.0.1:99999", "::1:7443", "unix:/x.sock"]
)
def test_a_malformed_address_is_a_usage_error(pki: Pki, address: str) -> None:
    got = _cli()("--address", address, *_tls(pki), "status")
    assert "--address must be HOST:PORT" in _one_error_line(got, EXIT_USAGE)


def test_ipv6_and_host_name_addresses_are_accepted(pki: Pki) -> None:
    for address in (f"[::1]:{free_port()}", f"localhost:{free_port()}"):
        got = _cli()("--address", address, *_tls(pki), "status")
        # Well formed: the CLI tries, finds nothing listening, and says where it looked.
        line = _one_error_line(got, EXIT_DAEMON_UNREACHABLE)
        assert f"cannot reach gpusnapd at {address}: " in line
