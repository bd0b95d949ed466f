"""Each watcher against a loopback server speaking its provider's documented protocol."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import pytest

from gpusnap.daemon.reclaim.aws import AwsImdsWatcher
from gpusnap.daemon.reclaim.azure import AzureScheduledEventsWatcher
from gpusnap.daemon.reclaim.config import TriggersConfig
from gpusnap.daemon.reclaim.gcp import GcpMetadataWatcher
from gpusnap.daemon.reclaim.manager import TriggerManager, Watcher
from gpusnap.daemon.reclaim.notice import Notice
from gpusnap.errors import Corrupt, NotFound, Unavailable
from tests.support.metadata_servers import (
    SERVERS,
    AwsImdsServer,
    AzureEventsServer,
    GcpMetadataServer,
    dead_url,
)

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def aws() -> Iterator[AwsImdsServer]:
    with AwsImdsServer() as server:
        yield server


@pytest.fixture
def gcp() -> Iterator[GcpMetadataServer]:
    with GcpMetadataServer() as server:
        yield server


@pytest.fixture
def azure() -> Iterator[AzureEventsServer]:
    with AzureEventsServer() as server:
        yield server


# --- AWS ------------------------------------------------------------------------------------


def test_aws_no_notice_is_404_and_uses_a_token(aws: AwsImdsServer) -> None:
    w = AwsImdsWatcher(TriggersConfig(aws_imds_url=aws.url, http_timeout=2))
    assert w.poll() == []
    puts = aws.requests_to("/latest/api/token", "PUT")
    assert len(puts) == 1
    assert puts[0].headers["x-aws-ec2-metadata-token-ttl-seconds"] == "21600"
    gets = aws.requests_to("/latest/meta-data/", "GET")
    assert {g.path for g in gets} == {
        "/latest/meta-data/spot/instance-action",
        "/latest/meta-data/events/recommendations/rebalance",
    }
    # Both GETs carry the one token the PUT was answered with (the body of its reply).
    assert [g.headers["x-aws-ec2-metadata-token"] for g in gets] == aws.issued * 2


def test_aws_instance_action_gives_a_reclaim_with_the_notice_time(aws: AwsImdsServer) -> None:
    at = aws.announce_reclaim("terminate", time.time() + 120)
    notices = AwsImdsWatcher(TriggersConfig(aws_imds_url=aws.url)).poll()
    assert [n.kind for n in notices] == ["reclaim"]
    assert notices[0].deadline == at
    assert notices[0].provider == "aws"
    assert notices[0].trigger == "reclaim:aws"


def test_aws_same_notice_twice_has_the_same_key_and_a_new_one_differs(aws: AwsImdsServer) -> None:
    aws.announce_reclaim("stop", time.time() + 100)
    w = AwsImdsWatcher(TriggersConfig(aws_imds_url=aws.url))
    first, second = w.poll()[0], w.poll()[0]
    assert first.key == second.key
    aws.announce_reclaim("terminate", time.time() + 100)
    assert w.poll()[0].key != first.key


def test_aws_hibernate_deadline_is_now(aws: AwsImdsServer) -> None:
    aws.announce_reclaim("hibernate", time.time() + 120)
    before = time.time()
    notice = AwsImdsWatcher(TriggersConfig(aws_imds_url=aws.url)).poll()[0]
    assert notice.deadline is not None and notice.deadline <= time.time() + 1
    assert notice.deadline >= before - 1


def test_aws_rebalance_is_an_early_signal_without_deadline(aws: AwsImdsServer) -> None:
    aws.recommend_rebalance()
    notices = AwsImdsWatcher(TriggersConfig(aws_imds_url=aws.url)).poll()
    assert [(n.kind, n.deadline) for n in notices] == [("rebalance", None)]


def test_aws_refetches_the_token_on_401(aws: AwsImdsServer) -> None:
    w = AwsImdsWatcher(TriggersConfig(aws_imds_url=aws.url))
    assert w.poll() == []
    aws.expire_tokens()
    aws.announce_reclaim()
    notices = w.poll()
    assert [n.kind for n in notices] == ["reclaim"]
    assert len(aws.requests_to("/latest/api/token", "PUT")) == 2
    asks = aws.requests_to("/latest/meta-data/spot/instance-action")
    # The first poll and the one answered 401 carry the old token; the retry, the new one.
    old, new = aws.issued
    assert [r.headers["x-aws-ec2-metadata-token"] for r in asks] == [old, old, new]


def test_aws_refreshes_the_token_before_it_expires(aws: AwsImdsServer) -> None:
    w = AwsImdsWatcher(
        TriggersConfig(aws_imds_url=aws.url), token_ttl=2
    )  # refresh margin is a quarter: 0.5 s
    w.poll()
    time.sleep(1.6)
    w.poll()
    assert len(aws.requests_to("/latest/api/token", "PUT")) == 2
    assert len(aws.requests_to("/latest/meta-data/", "GET")) == 4  # no 401 round trip


def test_aws_garbage_is_corrupt(aws: AwsImdsServer) -> None:
    aws.announce_reclaim()
    aws.instance_action = {"action": "explode", "time": "soon"}
    with pytest.raises(Corrupt):
        AwsImdsWatcher(TriggersConfig(aws_imds_url=aws.url)).poll()


# --- GCP ------------------------------------------------------------------------------------


def test_gcp_first_poll_returns_at_once_with_false(gcp: GcpMetadataServer) -> None:
    w = GcpMetadataWatcher(TriggersConfig(gcp_metadata_url=gcp.url, gcp_wait_timeout=30))
    t0 = time.monotonic()
    assert w.poll() == []
    assert time.monotonic() - t0 < 10  # last_etag=NONE must not wait for a change
    req = gcp.requests_to("/computeMetadata/v1/instance/preempted")[0]
    assert req.headers["metadata-flavor"] == "Google"
    assert "wait_for_change=true" in req.path and "last_etag=NONE" in req.path
    assert "timeout_sec=30" in req.path
    assert w.etag == gcp.etags["preempted"]


def test_gcp_long_poll_resumes_from_the_etag_and_wakes_on_change(gcp: GcpMetadataServer) -> None:
    w = GcpMetadataWatcher(TriggersConfig(gcp_metadata_url=gcp.url, gcp_wait_timeout=20))
    w.poll()
    result: list[list[Notice]] = []
    t = threading.Thread(target=lambda: result.append(w.poll()))
    t.start()
    time.sleep(0.5)
    assert t.is_alive()  # blocked in the long poll: nothing changed
    gcp.preempt()
    t.join(10)
    assert not t.is_alive()
    (notice,) = result[0]
    assert notice.kind == "reclaim" and notice.event_id == "preempted"
    assert notice.deadline is not None
    assert abs(notice.deadline - (notice.received_at + 30)) < 0.01
    second = gcp.requests_to("/computeMetadata/v1/instance/preempted")[1]
    assert "last_etag=" in second.path and "last_etag=NONE" not in second.path


def test_gcp_maintenance_terminate_is_a_notice(gcp: GcpMetadataServer) -> None:
    gcp.set("maintenance-event", "TERMINATE_ON_HOST_MAINTENANCE")
    notices = GcpMetadataWatcher(
        TriggersConfig(gcp_metadata_url=gcp.url, gcp_wait_timeout=5), "maintenance-event"
    ).poll()
    assert [n.kind for n in notices] == ["maintenance"]


def test_gcp_reply_without_flavor_header_is_rejected(gcp: GcpMetadataServer) -> None:
    gcp.send_flavor = False
    gcp.preempt()
    with pytest.raises(Corrupt, match="Metadata-Flavor"):
        GcpMetadataWatcher(TriggersConfig(gcp_metadata_url=gcp.url, gcp_wait_timeout=5)).poll()


def test_gcp_garbage_value_is_corrupt(gcp: GcpMetadataServer) -> None:
    gcp.set("preempted", "MAYBE")
    with pytest.raises(Corrupt):
        GcpMetadataWatcher(TriggersConfig(gcp_metadata_url=gcp.url, gcp_wait_timeout=5)).poll()


def test_gcp_missing_key_is_not_found(gcp: GcpMetadataServer) -> None:
    del gcp.values["maintenance-event"]
    with pytest.raises(NotFound):
        GcpMetadataWatcher(
            TriggersConfig(gcp_metadata_url=gcp.url, gcp_wait_timeout=5), "maintenance-event"
        ).poll()


# --- Azure ----------------------------------------------------------------------------------


def test_azure_no_events(azure: AzureEventsServer) -> None:
    w = AzureScheduledEventsWatcher(TriggersConfig(azure_metadata_url=azure.url))
    assert w.poll() == []
    req = azure.requests_to("/metadata/scheduledevents")[0]
    assert req.headers["metadata"] == "true"
    assert "api-version=2020-07-01" in req.path


def test_azure_preempt_deadline_is_not_before(azure: AzureEventsServer) -> None:
    nb = float(int(time.time()) + 40)
    eid = azure.schedule("Preempt", not_before=nb)
    azure.schedule("Freeze")
    (notice,) = AzureScheduledEventsWatcher(TriggersConfig(azure_metadata_url=azure.url)).poll()
    assert (notice.kind, notice.event_id, notice.deadline) == ("reclaim", eid, nb)


def test_azure_terminate_without_not_before_gets_30s(azure: AzureEventsServer) -> None:
    azure.schedule("Terminate")
    azure.events[0]["NotBefore"] = ""
    (notice,) = AzureScheduledEventsWatcher(TriggersConfig(azure_metadata_url=azure.url)).poll()
    assert notice.deadline == pytest.approx(notice.received_at + 30)


def test_azure_ignores_events_for_other_vms(azure: AzureEventsServer) -> None:
    azure.schedule("Preempt", resources=["someone-else"])
    assert AzureScheduledEventsWatcher(TriggersConfig(azure_metadata_url=azure.url)).poll() == []


def test_azure_ack_posts_start_requests(azure: AzureEventsServer) -> None:
    eid = azure.schedule("Preempt")
    (notice,) = AzureScheduledEventsWatcher(TriggersConfig(azure_metadata_url=azure.url)).poll()
    assert azure.approvals == []  # polling never approves
    notice.ack()
    post = azure.requests_to("/metadata/scheduledevents", "POST")[0]
    assert json.loads(post.body) == {"StartRequests": [{"EventId": eid}]}
    assert post.headers["metadata"] == "true"
    assert [a[0] for a in azure.approvals] == [eid]


def test_azure_garbage_is_corrupt(azure: AzureEventsServer) -> None:
    azure.mode = "garbage"
    with pytest.raises(Corrupt):
        AzureScheduledEventsWatcher(
            TriggersConfig(azure_metadata_url=azure.url), vm_name="gpu-node-a"
        ).poll()


# --- misbehaving services, through the manager ----------------------------------------------


def _watchers(name: str, url: str, timeout: float) -> Watcher:
    if name == "aws":
        return AwsImdsWatcher(
            TriggersConfig(aws_imds_url=url, http_timeout=timeout, poll_interval=0.05)
        )
    if name == "gcp":
        w = GcpMetadataWatcher(
            TriggersConfig(gcp_metadata_url=url, gcp_wait_timeout=1),
            http_margin_s=timeout,
            min_poll_interval=0.05,
        )
        return w
    return AzureScheduledEventsWatcher(
        TriggersConfig(azure_metadata_url=url, http_timeout=timeout, azure_poll_interval=0.05)
    )


@pytest.mark.parametrize("provider", ["aws", "gcp", "azure"])
@pytest.mark.parametrize("mode", ["drop", "slow", "garbage", "error"])
def test_misbehaving_service_reports_error_and_no_notice(provider: str, mode: str) -> None:
    with SERVERS[provider]() as server:
        server.mode = mode
        server.slow_s = 3.0
        got: list[Notice] = []
        w = _watchers(provider, server.url, timeout=0.3)
        mgr = TriggerManager([w], got.append, max_backoff=0.1)
        for _ in range(2):
            assert mgr.poll_once(w) is False
        (state,) = mgr.state()
        assert state.failures == 2
        assert state.last_error
        assert state.last_error_kind in ("unavailable", "corrupt")
        assert state.to_dict()["last_poll_ok"] is False
        assert got == []


@pytest.mark.parametrize("provider", ["aws", "gcp", "azure"])
def test_service_that_is_down_reports_unavailable(provider: str) -> None:
    w = _watchers(provider, dead_url(), timeout=0.5)
    with pytest.raises(Unavailable):
        w.poll()


@pytest.mark.parametrize("provider", ["aws", "gcp", "azure"])
def test_flapping_service_with_a_notice_delivers_it_once(provider: str) -> None:
    with SERVERS[provider]() as server:
        server.reclaim()
        server.flap = True
        got: list[Notice] = []
        lock = threading.Lock()

        def handler(n: Notice) -> None:
            with lock:
                got.append(n)

        w = _watchers(provider, server.url, timeout=1.0)
        if isinstance(w, GcpMetadataWatcher):
            w.wait_timeout_s = 0  # the value never changes again: return at once
        mgr = TriggerManager([w], handler, max_backoff=0.05)
        mgr.start()
        try:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                st = mgr.state()[0]
                if st.polls >= 12 and st.last_notice is not None and st.failures == 0:
                    break
                time.sleep(0.05)
        finally:
            mgr.stop()
        st = mgr.state()[0]
        assert st.polls >= 12
        assert st.errors > 0  # the service did flap on the way
        assert st.last_notice is not None
        assert [n.kind for n in got] == ["reclaim"]


def test_manager_survives_a_handler_that_raises(aws: AwsImdsServer) -> None:
    aws.announce_reclaim()
    calls: list[Notice] = []

    def handler(n: Notice) -> None:
        calls.append(n)
        raise RuntimeError("boom")

    w = AwsImdsWatcher(TriggersConfig(aws_imds_url=aws.url))
    mgr = TriggerManager([w], handler)
    assert mgr.poll_once(w) is True
    assert mgr.poll_once(w) is True
    assert len(calls) == 1
    assert mgr.state_dict()["watchers"][0]["last_notice"]["kind"] == "reclaim"


def test_manager_submit_dedups_by_key() -> None:
    got: list[Notice] = []
    mgr = TriggerManager([], got.append)
    n = Notice("drill", "reclaim", time.time() + 60, "drill-1")
    assert mgr.submit(n) is True
    assert mgr.submit(Notice("drill", "reclaim", time.time() + 90, "drill-1")) is False
    assert got == [n]
