"""Error kinds cross the wire intact: the gRPC code from ERROR_TABLE, the kind in trailing
metadata, and the client raises the same kind again."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import cast

import grpc
import pytest

from gpusnap.cli._client import DaemonClient
from gpusnap.errors import ERROR_TABLE, KINDS, Internal, NotFound
from gpusnap.proto.gpusnap.v1 import ERROR_KIND_METADATA_KEY
from gpusnap.proto.gpusnap.v1 import gpusnap_pb2 as pb
from gpusnap.proto.gpusnap.v1 import gpusnap_pb2_grpc as pb_grpc

ALL_KINDS = sorted(ERROR_TABLE)


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_kind_maps_to_its_grpc_code_and_metadata(server: Path, kind: str) -> None:
    with grpc.insecure_channel(f"unix:{server}") as channel:
        stub = pb_grpc.JobsStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.Get(pb.GetJobRequest(job_id=f"raise:{kind}"), timeout=30)
    err = info.value
    assert err.code() == getattr(grpc.StatusCode, ERROR_TABLE[kind].grpc_code)
    # grpc-stubs type RpcError's metadata as objects; the channel's are (key, value) pairs,
    # as cli/_client.py reads them.
    metadata = cast("Iterable[tuple[str, str | bytes]]", err.trailing_metadata())
    assert (ERROR_KIND_METADATA_KEY, kind) in list(metadata)
    assert err.details() == f"asked to fail with {kind}"


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_client_reraises_the_same_kind(server: Path, kind: str) -> None:
    client = DaemonClient.for_socket(server)
    with pytest.raises(KINDS[kind]) as info:
        client.get_job(f"raise:{kind}")
    assert type(info.value) is KINDS[kind]
    assert str(info.value) == f"asked to fail with {kind}"


@pytest.mark.parametrize("kind", ["not_found", "unavailable", "corrupt"])
def test_every_service_calls_errors_are_translated(server: Path, kind: str) -> None:
    client = DaemonClient.for_socket(server)
    calls = [
        lambda: client.checkpoint(workload=f"raise:{kind}"),
        lambda: client.restore(checkpoint_id=f"raise:{kind}"),
        lambda: client.compat(f"raise:{kind}"),
        lambda: client.cancel_job(f"raise:{kind}"),
        lambda: client.list_checkpoints(f"raise:{kind}"),
        lambda: client.show_checkpoint(f"raise:{kind}"),
        lambda: list(client.watch_job(f"raise:{kind}")),
    ]
    for call in calls:
        with pytest.raises(KINDS[kind]):
            call()


def test_a_bug_in_the_service_is_internal_with_one_line(server: Path) -> None:
    client = DaemonClient.for_socket(server)
    with pytest.raises(Internal) as info:
        client.get_job("raise:bug")
    assert "RuntimeError: a bug in the service" in str(info.value)
    assert "\n" not in str(info.value)


def test_unknown_job_in_watch_is_not_found(server: Path) -> None:
    with pytest.raises(NotFound):
        list(DaemonClient.for_socket(server).watch_job("job-nope"))
