"""Helpers for the planner's tests: the shipped configs, a plan made as the CLI makes one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gpusnap.cli.plan import engines, families
from gpusnap.cli.plan.estimate import Plan, make_plan
from gpusnap.cli.plan.shapes import Kind

CONFIGS = Path(__file__).parent / "configs"
GiB = 1 << 30


def config(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((CONFIGS / f"{name}.json").read_text())
    return data


def plan_for(
    name: str | dict[str, Any],
    *,
    engine: str = "vllm",
    tp: int = 1,
    kv_dtype: str = "auto",
    context: int = 32768,
    sessions: int | None = 1,
    block_size: int | None = None,
) -> Plan:
    data = config(name) if isinstance(name, str) else name
    model = families.shape_from_config(data, str(name) if isinstance(name, str) else "inline")
    resolved = engines.resolve(model, engine, tp=tp, kv_dtype=kv_dtype, block_size=block_size)
    return make_plan(
        model_path=str(name),
        model=model,
        engine=resolved,
        context=context,
        sessions=sessions,
        weights=None,
        gpu_memory=None,
        overhead=0,
        host_bytes=0,
        bandwidth=None,
        bandwidth_source=None,
    )


def kind(plan: Plan, k: Kind) -> Any:
    """The per-kind figures of ``k`` (per GPU)."""
    matches = [f for f in plan.kinds if f.kind == k]
    assert len(matches) == 1, f"{k} not in {[f.kind for f in plan.kinds]}"
    return matches[0]
