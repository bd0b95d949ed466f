"""A store the trigger and migration tests open, in this process or another."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gpusnap.storage.backend import BackendOptions
from gpusnap.storage.store import CheckpointStore, open_store
from tests.support.moto_server import TEST_REGION


@dataclass(frozen=True)
class StoreSpec:
    """Enough to open the same store again, in this process or another."""

    url: str
    key_file: Path
    endpoint_url: str | None

    def options(self) -> BackendOptions:
        return BackendOptions(
            endpoint_url=self.endpoint_url,
            region=TEST_REGION,
            addressing_style="path",
            retry_attempts=3,
            retry_base_delay=0.01,
            retry_max_delay=0.1,
        )

    def open(self, cache_dir: Path) -> CheckpointStore:
        return open_store(
            self.url, key_file=self.key_file, options=self.options(), cache_dir=cache_dir
        )
