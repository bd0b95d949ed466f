"""``[cache]`` and ``[migration] prefetch*``: defaults, values, and bad values naming the key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gpusnap.daemon.config.file import CacheSection, parse_config
from tests.support.config_errors import STORE, config_error


def test_the_cache_is_on_in_the_state_dir_and_seeded_by_default() -> None:
    c = parse_config({"store": STORE, "daemon": {"state_dir": "/srv/g"}})
    assert c.cache == CacheSection(enabled=True, dir=None, max_bytes=None, seed=True)
    assert c.cache.directory(c.daemon.state_dir) == Path("/srv/g/cache")


def test_cache_keys_parse() -> None:
    c = parse_config(
        {
            "store": STORE,
            "cache": {"enabled": False, "dir": "/nvme/cache", "max_bytes": 1 << 40, "seed": False},
        }
    )
    assert c.cache == CacheSection(
        enabled=False, dir=Path("/nvme/cache"), max_bytes=1 << 40, seed=False
    )
    assert c.cache.directory(c.daemon.state_dir) == Path("/nvme/cache")


@pytest.mark.parametrize(
    ("table", "needle"),
    [
        ({"enabled": "yes"}, "[cache]: key 'enabled': must be true or false"),
        ({"dir": "cache"}, "[cache]: key 'dir': must be an absolute path"),
        ({"dir": ""}, "[cache]: key 'dir'"),
        ({"max_bytes": 0}, "[cache]: key 'max_bytes': must be at least 1"),
        ({"max_bytes": "10GiB"}, "[cache]: key 'max_bytes': must be an integer"),
        ({"max_bytes": 1.5e9}, "[cache]: key 'max_bytes': must be an integer"),
        ({"seed": 1}, "[cache]: key 'seed': must be true or false"),
        ({"max_byte": 10}, "'max_byte'"),
    ],
)
def test_a_bad_cache_value_is_refused_naming_the_key(table: dict[str, Any], needle: str) -> None:
    assert needle in config_error({"cache": table})


def test_prefetch_is_off_by_default_with_a_bandwidth_cap_and_every_workload() -> None:
    m = parse_config({"store": STORE}).migration
    assert (m.prefetch, m.prefetch_bandwidth, m.prefetch_workloads) == (False, 100e6, ())


def test_prefetch_keys_parse() -> None:
    m = parse_config(
        {
            "store": STORE,
            "migration": {
                "standby": True,
                "prefetch": True,
                "prefetch_bandwidth": 25_000_000,
                "prefetch_workloads": ["llm", "tts.v2"],
            },
        }
    ).migration
    assert (m.prefetch, m.prefetch_bandwidth, m.prefetch_workloads) == (
        True,
        25e6,
        ("llm", "tts.v2"),
    )


@pytest.mark.parametrize(
    ("table", "needle"),
    [
        ({"prefetch": "true"}, "[migration] prefetch must be true or false"),
        ({"prefetch_bandwidth": 0}, "[migration] prefetch_bandwidth must be greater than 0"),
        ({"prefetch_bandwidth": -1.0}, "[migration] prefetch_bandwidth must be greater than 0"),
        ({"prefetch_bandwidth": "1GB/s"}, "[migration] prefetch_bandwidth must be a number"),
        ({"prefetch_workloads": "llm"}, "[migration] prefetch_workloads must be a list"),
        ({"prefetch_workloads": [1]}, "[migration] prefetch_workloads must be a list"),
        ({"prefetch_workloads": ["../x"]}, "[migration] prefetch_workloads: '../x' is not a"),
        ({"prefetch_workloads": ["a", "a"]}, "[migration] prefetch_workloads names a workload"),
        ({"prefetch_workload": ["a"]}, "unknown key 'prefetch_workload'"),
    ],
)
def test_a_bad_prefetch_value_is_refused_naming_the_key(table: dict[str, Any], needle: str) -> None:
    assert needle in config_error({"migration": table})
