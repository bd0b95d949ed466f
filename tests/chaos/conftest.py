"""Fixtures of the chaos suite: the seed and the number of rounds, and stores (on S3 through the
shared ``proxy``, a fault proxy in front of the suite's one moto server).

The seed comes from ``GPUSNAP_CHAOS_SEED`` (default: a new one each run, printed by every
test and named in every failure, so that a failure replays with that variable set); the
rounds of each fault from ``GPUSNAP_CHAOS_ROUNDS`` (default 3, a size for CI; the long run
is ``bench/chaos_bench.py --chaos-rounds N``).
"""

from __future__ import annotations

import os
import secrets
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.chaos.harness import ChaosRun, ChaosStore
from tests.support.faultproxy import FaultProxy
from tests.support.moto_server import MotoServer

DEFAULT_ROUNDS = 3


_SEED = int(os.environ.get("GPUSNAP_CHAOS_SEED") or secrets.randbelow(2**31))
_ROUNDS = int(os.environ.get("GPUSNAP_CHAOS_ROUNDS") or DEFAULT_ROUNDS)


@pytest.fixture
def chaos(record_property: Callable[[str, object], None]) -> ChaosRun:
    record_property("chaos_seed", _SEED)
    print(f"chaos seed {_SEED} (replay: GPUSNAP_CHAOS_SEED={_SEED}), {_ROUNDS} rounds")
    return ChaosRun(_SEED, _ROUNDS)


@pytest.fixture
def file_store(tmp_path: Path, chaos: ChaosRun) -> ChaosStore:
    return ChaosStore.on_file(tmp_path, chaos.seed)


@pytest.fixture
def s3_store(
    tmp_path: Path, chaos: ChaosRun, moto_server: MotoServer, proxy: FaultProxy
) -> ChaosStore:
    bucket = f"chaos-{uuid.uuid4().hex[:12]}"
    return ChaosStore.on_s3(tmp_path, chaos.seed, moto_server, bucket, proxy.endpoint_url)
