"""The Prometheus endpoint over real HTTP on loopback."""

from __future__ import annotations

import threading
import urllib.error
import urllib.request

import pytest

from gpusnap.daemon.infra.metrics import (
    CONTENT_TYPE,
    MetricsRegistry,
    parse_address,
    start_metrics_server,
)


def _scrape(url: str) -> tuple[str, str]:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return resp.headers["Content-Type"], resp.read().decode()


def _samples(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_jobs_bytes_and_checkpoint_age_are_exposed() -> None:
    now = [1_700_000_100.0]
    reg = MetricsRegistry(clock=lambda: now[0])
    reg.observe_job("checkpoint", "succeeded", 7.5, bytes_uploaded=100, bytes_total=1000)
    reg.observe_job("checkpoint", "succeeded", 45.0, bytes_uploaded=50, bytes_total=1000)
    reg.observe_job("restore", "failed", 0.5)
    reg.set_last_checkpoint("llm", 1_700_000_000.0)
    reg.set_last_checkpoint("llm", 1_600_000_000.0)  # older: ignored
    reg.set_last_checkpoint('we"ird\nname', 1_700_000_050.0)
    server = start_metrics_server("127.0.0.1:0", reg)
    try:
        host, port = server.address
        content_type, text = _scrape(f"http://{host}:{port}/metrics")
        with pytest.raises(urllib.error.HTTPError) as info:
            _scrape(f"http://{host}:{port}/other")
        assert info.value.code == 404
        info.value.close()
    finally:
        server.close()
    assert content_type == CONTENT_TYPE
    s = _samples(text)
    ck = 'kind="checkpoint",outcome="succeeded"'
    assert s[f"gpusnap_jobs_total{{{ck}}}"] == 2
    assert s['gpusnap_jobs_total{kind="restore",outcome="failed"}'] == 1
    assert s[f'gpusnap_job_duration_seconds_bucket{{{ck},le="10"}}'] == 1
    assert s[f'gpusnap_job_duration_seconds_bucket{{{ck},le="60"}}'] == 2
    assert s[f'gpusnap_job_duration_seconds_bucket{{{ck},le="+Inf"}}'] == 2
    assert s[f"gpusnap_job_duration_seconds_sum{{{ck}}}"] == 52.5
    assert s[f"gpusnap_job_duration_seconds_count{{{ck}}}"] == 2
    assert s['gpusnap_bytes_uploaded_total{kind="checkpoint"}'] == 150
    assert s['gpusnap_bytes_total{kind="checkpoint"}'] == 2000
    assert s['gpusnap_last_checkpoint_timestamp_seconds{workload="llm"}'] == 1_700_000_000
    assert s['gpusnap_last_checkpoint_age_seconds{workload="llm"}'] == 100
    assert 'gpusnap_last_checkpoint_age_seconds{workload="we\\"ird\\nname"} 50' in text
    for name in ("gpusnap_jobs_total", "gpusnap_job_duration_seconds", "gpusnap_bytes_total"):
        assert f"# TYPE {name} " in text


def test_registry_is_safe_from_many_threads() -> None:
    reg = MetricsRegistry()

    def work() -> None:
        for _ in range(500):
            reg.observe_job("checkpoint", "succeeded", 1.0, bytes_uploaded=1, bytes_total=2)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    s = _samples(reg.render())
    assert s['gpusnap_jobs_total{kind="checkpoint",outcome="succeeded"}'] == 4000
    assert s['gpusnap_bytes_uploaded_total{kind="checkpoint"}'] == 4000


def test_parse_address() -> None:
    assert parse_address("127.0.0.1:9464") == ("127.0.0.1", 9464)
    assert parse_address("[::1]:9464") == ("::1", 9464)
    assert parse_address(":9464") == ("", 9464)
    for bad in ("9464", "host:", "host:99999", "host:http"):
        with pytest.raises(ValueError):
            parse_address(bad)
