"""``[triggers]`` parsing and provider auto-detection against loopback servers."""

from __future__ import annotations

import pytest

from gpusnap.daemon.reclaim.aws import AwsImdsWatcher
from gpusnap.daemon.reclaim.azure import AzureScheduledEventsWatcher
from gpusnap.daemon.reclaim.config import (
    TriggersConfig,
    build_watchers,
    detect_provider,
    parse_triggers_config,
)
from gpusnap.daemon.reclaim.gcp import GcpMetadataWatcher
from gpusnap.errors import InvalidArgument
from tests.support.metadata_servers import (
    AwsImdsServer,
    AzureEventsServer,
    GcpMetadataServer,
    dead_url,
)

pytestmark = pytest.mark.timeout(60)


def test_defaults_and_values() -> None:
    assert parse_triggers_config({}) == TriggersConfig()
    cfg = parse_triggers_config(
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
        parse_triggers_config(table)


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
