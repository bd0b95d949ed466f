"""The ``[triggers]``, ``[migration]`` and policy tables, and provider auto-detection against
loopback servers."""

from __future__ import annotations

import pytest

from gpusnap.daemon.reclaim.aws import AwsImdsWatcher
from gpusnap.daemon.reclaim.azure import AzureScheduledEventsWatcher
from gpusnap.daemon.reclaim.config import (
    TriggersConfig,
    parse_migration,
    parse_triggers,
    parse_workload_policy,
)
from gpusnap.daemon.reclaim.gcp import GcpMetadataWatcher
from gpusnap.daemon.reclaim.providers import build_watchers, detect_provider
from gpusnap.errors import InvalidArgument
from tests.support.metadata_servers import (
    AwsImdsServer,
    AzureEventsServer,
    GcpMetadataServer,
    dead_url,
)

pytestmark = pytest.mark.timeout(60)


def test_defaults_and_values() -> None:
    assert parse_triggers({}) == TriggersConfig()
    cfg = parse_triggers(
        {"provider": "gcp", "gcp_metadata_url": "http://127.0.0.1:8080/", "gcp_wait_timeout": 30}
    )
    assert (cfg.provider, cfg.gcp_metadata_url, cfg.gcp_wait_timeout) == (
        "gcp",
        "http://127.0.0.1:8080",
        30,
    )


@pytest.mark.parametrize(
    ("table", "needle"),
    [
        ({"provder": "aws"}, "'provder'"),
        ({"provider": "oracle"}, "provider"),
        ({"aws_imds_url": "https://169.254.169.254"}, "aws_imds_url"),
        ({"azure_metadata_url": "http://x/metadata"}, "azure_metadata_url"),
        ({"poll_interval": 0}, "poll_interval"),
        ({"poll_interval": True}, "poll_interval"),
        ({"gcp_wait_timeout": 1.5}, "gcp_wait_timeout"),
        ({"logind": "yes"}, "logind"),
    ],
)
def test_invalid_tables_name_the_key(table: dict[str, object], needle: str) -> None:
    with pytest.raises(InvalidArgument, match=needle):
        parse_triggers(table)


def test_the_migration_table_is_parsed_strictly() -> None:
    cfg = parse_migration({"standby": True, "cold_start_after": 30, "node_id": "n1"})
    assert (cfg.standby, cfg.cold_start_after, cfg.node_id) == (True, 30.0, "n1")
    with pytest.raises(InvalidArgument, match="'standbye'"):
        parse_migration({"standbye": True})
    with pytest.raises(InvalidArgument, match="claim_timeout"):
        parse_migration({"claim_timeout": 0})


def test_a_workload_reads_its_policy_keys_and_only_those() -> None:
    p = parse_workload_policy("llm", {"on_notice": "none", "checkpoint_interval": 600, "cmd": "x"})
    assert (p.on_notice, p.checkpoint_interval, p.checkpoint_on_rebalance) == ("none", 600.0, True)
    with pytest.raises(InvalidArgument, match="on_notice"):
        parse_workload_policy("llm", {"on_notice": "panic"})
    with pytest.raises(InvalidArgument, match="checkpoint_interval"):
        parse_workload_policy("llm", {"checkpoint_interval": -1})


def _cfg(aws: str, gcp: str, azure: str) -> TriggersConfig:
    return TriggersConfig(
        provider="auto",
        aws_imds_url=aws,
        gcp_metadata_url=gcp,
        azure_metadata_url=azure,
        probe_timeout=0.5,
    )


def test_auto_detects_each_provider_and_none() -> None:
    with AwsImdsServer() as aws, GcpMetadataServer() as gcp, AzureEventsServer() as az:
        dead = dead_url()
        assert detect_provider(_cfg(aws.url, dead, dead)) == "aws"
        assert detect_provider(_cfg(dead, gcp.url, dead)) == "gcp"
        assert detect_provider(_cfg(dead, dead, az.url)) == "azure"
        assert detect_provider(_cfg(dead, dead, dead)) is None
        # A server that is not GCP's (no Metadata-Flavor) and not Azure's is not taken for one.
        assert detect_provider(_cfg(dead, aws.url, aws.url)) is None


def test_build_watchers() -> None:
    with GcpMetadataServer() as gcp:
        dead = dead_url()
        watchers, detail = build_watchers(_cfg(dead, gcp.url, dead))
        assert "gcp (auto-detected)" in detail
        assert [type(w) for w in watchers] == [GcpMetadataWatcher, GcpMetadataWatcher]
        assert [w.name for w in watchers] == ["gcp:preempted", "gcp:maintenance-event"]
    watchers, _ = build_watchers(TriggersConfig(provider="aws"))
    assert [type(w) for w in watchers] == [AwsImdsWatcher]
    watchers, _ = build_watchers(TriggersConfig(provider="azure"))
    assert [type(w) for w in watchers] == [AzureScheduledEventsWatcher]
    assert build_watchers(TriggersConfig(provider="none"))[0] == []
    watchers, detail = build_watchers(_cfg(dead_url(), dead_url(), dead_url()))
    assert watchers == [] and "no metadata service answered" in detail
