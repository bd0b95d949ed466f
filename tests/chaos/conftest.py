"""Fixtures of the chaos suite: the seed and the number of rounds, the fault proxy in front of
the suite's one moto server (``tests/conftest.py``), stores.

The seed comes from ``GPUSNAP_CHAOS_SEED`` (default: a new one each run, printed by every
test and named in every failure, so that a failure replays with that variable set); the
rounds of each fault from ``GPUSNAP_CHAOS_ROUNDS`` (default 3, a size for CI; the long run
is ``bench/chaos_bench.py --chaos-rounds N``).
"""

from __future__ import annotations

import os
import random
import secrets
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.chaos.harness import ChaosStore
from tests.chaos.scenarios import ChaosProxy
from tests.support.moto_server import MotoServer

DEFAULT_ROUNDS = 3


@dataclass(frozen=True)
class ChaosRun:
    seed: int
    rounds: int

    def rng(self, scenario: str) -> random.Random:
        """The random choices of one scenario: its own stream, from the run's seed."""
        return random.Random(f"{self.seed}/{scenario}")


_SEED = int(os.environ.get("GPUSNAP_CHAOS_SEED") or secrets.randbelow(2**31))
_ROUNDS = int(os.environ.get("GPUSNAP_CHAOS_ROUNDS") or DEFAULT_ROUNDS)


@pytest.fixture
def chaos(record_property: Callable[[str, object], None]) -> ChaosRun:
    record_property("chaos_seed", _SEED)
    print(f"chaos seed {_SEED} (replay: GPUSNAP_CHAOS_SEED={_SEED}), {_ROUNDS} rounds")
    return ChaosRun(_SEED, _ROUNDS)


@pytest.fixture
def proxy(moto_server: MotoServer) -> Iterator[ChaosProxy]:
    """The fault-injecting proxy in front of the suite's one moto server."""
    chaos_proxy = ChaosProxy(moto_server.endpoint_url)
    chaos_proxy.start()
    try:
        yield chaos_proxy
    finally:
        chaos_proxy.stop()


@pytest.fixture
def file_store(tmp_path: Path, chaos: ChaosRun) -> ChaosStore:
    return ChaosStore.on_file(tmp_path, chaos.seed)


@pytest.fixture
def s3_store(
    tmp_path: Path, chaos: ChaosRun, moto_server: MotoServer, proxy: ChaosProxy
) -> ChaosStore:
    bucket = f"chaos-{uuid.uuid4().hex[:12]}"
    return ChaosStore.on_s3(tmp_path, chaos.seed, moto_server, bucket, proxy.endpoint_url)
