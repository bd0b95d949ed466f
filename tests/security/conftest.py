"""Fixtures for the security suite: the storage suite's stores and keys (file:// and S3 over
a moto server) and the end-to-end daemons (``nodes``), reused as they are."""

from __future__ import annotations

from tests.e2e.conftest import _subreaper, nodes
from tests.storage.conftest import checkpoint_store, keys, store

__all__ = ["_subreaper", "checkpoint_store", "keys", "nodes", "store"]
