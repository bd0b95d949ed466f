"""The compatibility gate's host rules: may a checkpoint's stamp be restored on this node?

``POLICY`` is the one table of compatibility rules: stamp field -> rule -> message. The gate
(``check_compat``) evaluates every row and returns every mismatch, never just the first;
``docs/compat.md`` carries the same table and a test checks the two agree. GPU rules live with
the GPU code (``daemon/gpu/compat.py``, through ``GpuAdapter.compat_reasons``); ``Node.reasons``
asks both.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpusnap.daemon.config.file import WorkloadConfig
from gpusnap.daemon.gate.model_digest import DigestCache, short
from gpusnap.daemon.gate.stamp import ENGINE_PACKAGES
from gpusnap.daemon.gate.verdict import Reason

log = logging.getLogger(__name__)


def python_packages_of(
    executable: str, packages: Iterable[str] = ENGINE_PACKAGES
) -> dict[str, str]:
    """Versions of ``packages`` installed for the Python at ``executable`` on this node.

    Used by the gate for a workload whose engine is ``probed``: it asks the interpreter the
    checkpoint recorded. Not a Python, or not there: an empty dict.
    """
    if not os.path.basename(executable).startswith("python") or not os.access(executable, os.X_OK):
        return {}
    code = (
        "import importlib.metadata as m, json, sys\n"
        "out = {}\n"
        "for p in sys.argv[1:]:\n"
        "    try: out[p] = m.version(p)\n"
        "    except Exception: pass\n"
        "print(json.dumps(out))\n"
    )
    try:
        proc = subprocess.run(
            [executable, "-I", "-c", code, *packages],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        data = json.loads(proc.stdout or "{}")
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        log.warning("cannot ask %s for its package versions: %s", executable, exc)
        return {}
    return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}


@dataclass(frozen=True)
class NodeFacts:
    """What the gate compares a stamp with: this node, and this node's config for the workload."""

    host: Mapping[str, Any]
    gpusnap: Mapping[str, Any]
    workload: WorkloadConfig | None
    # Probes the local interpreter for a probed engine; injectable for tests.
    python_packages: Callable[[str], dict[str, str]] = python_packages_of
    # Digests a model directory (model_digest.py); the node's passes its state dir's cache.
    model_digest: Callable[[Path], str] = lambda d: DigestCache(None).directory_digest(d).digest


Check = Callable[[Mapping[str, Any], NodeFacts], list[Reason]]


@dataclass(frozen=True)
class Rule:
    field: str  # the stamp field, dotted
    rule: str  # the rule, in the words docs/compat.md uses
    message: str  # the message template (str.format with expected=, actual=, and extras)
    check: Check


def _get(stamp: Mapping[str, Any], dotted: str) -> Any:
    cur: Any = stamp
    for part in dotted.split("."):
        if not isinstance(cur, Mapping):
            return None
        cur = cur.get(part)
    return cur


def _equal(field: str, node_value: Callable[[NodeFacts], Any], message: str) -> Check:
    def check(stamp: Mapping[str, Any], node: NodeFacts) -> list[Reason]:
        expected = _get(stamp, field)
        actual = node_value(node)
        if expected == actual:
            return []
        e, a = _show(expected), _show(actual)
        return [Reason(field, e, a, message.format(expected=e, actual=a))]

    return check


def _show(value: Any) -> str:
    return "(none)" if value is None else str(value)


def _criu_major(version: Any) -> str | None:
    if not isinstance(version, str) or not version:
        return None
    return version.split(".", 1)[0]


def _check_criu(stamp: Mapping[str, Any], node: NodeFacts) -> list[Reason]:
    expected = _get(stamp, "host.criu_version")
    actual = node.host.get("criu_version")
    if _criu_major(expected) is not None and _criu_major(expected) == _criu_major(actual):
        return []
    e, a = _show(expected), _show(actual)
    return [
        Reason("host.criu_version", e, a, _RULES["host.criu_version"].format(expected=e, actual=a))
    ]


def _check_cpu(stamp: Mapping[str, Any], node: NodeFacts) -> list[Reason]:
    recorded = _get(stamp, "host.cpu_features")
    if not isinstance(recorded, list):
        return [
            Reason(
                "host.cpu_features",
                "(none)",
                "",
                "the checkpoint records no CPU features; cannot tell whether this CPU can run it",
            )
        ]
    have = set(node.host.get("cpu_features") or ())
    missing = sorted(str(f) for f in recorded if f not in have)
    if not missing:
        return []
    e = " ".join(missing)
    return [
        Reason("host.cpu_features", e, "", _RULES["host.cpu_features"].format(missing=e, actual=""))
    ]


def _declared(section: str, key: str) -> Callable[[Mapping[str, Any], NodeFacts], list[Reason]]:
    """Engine/model fields: this node's config for the workload versus the stamp."""

    def check(stamp: Mapping[str, Any], node: NodeFacts) -> list[Reason]:
        field = f"{section}.{key}"
        w = node.workload
        spec = None if w is None else (w.engine if section == "engine" else w.model)
        if spec is None:
            if section == "engine" and w is not None and w.engine_probed:
                return _check_probed_engine(stamp, node, key)
            return []  # this node declares nothing to compare with
        expected = _get(stamp, field)
        actual = getattr(spec, key)
        if expected == actual:
            return []
        e, a = _show(expected), _show(actual)
        return [Reason(field, e, a, _RULES[field].format(expected=e, actual=a))]

    return check


def _check_probed_engine(stamp: Mapping[str, Any], node: NodeFacts, key: str) -> list[Reason]:
    if key != "version":
        return []
    name = _get(stamp, "engine.name")
    exe = _get(stamp, "launch.exe")
    if not isinstance(name, str) or not isinstance(exe, str):
        return []
    have = node.python_packages(exe).get(name)
    expected = _get(stamp, "engine.version")
    if have == expected:
        return []
    e, a = _show(expected), _show(have)
    msg = _RULES["engine.version"].format(expected=f"{name} {e}", actual=f"{name} {a}")
    return [Reason("engine.version", e, a, msg)]


def _check_model_digest(stamp: Mapping[str, Any], node: NodeFacts) -> list[Reason]:
    expected = _get(stamp, "model.digest")
    if not isinstance(expected, str):
        return []  # a checkpoint that records no model directory, or one older than the field
    recorded = _get(stamp, "model.dir")
    configured = node.workload.model_dir if node.workload is not None else None
    if configured is None and not isinstance(recorded, str):
        return []
    directory = configured or Path(str(recorded))
    try:
        actual = node.model_digest(directory)
    except OSError as exc:
        msg = _RULES["model.missing"].format(dir=directory, error=exc)
        return [Reason("model.digest", short(expected), "missing", msg)]
    if actual == expected:
        return []
    e, a = short(expected), short(actual)
    return [
        Reason(
            "model.digest", e, a, _RULES["model.digest"].format(dir=directory, expected=e, actual=a)
        )
    ]


def _check_files(stamp: Mapping[str, Any], node: NodeFacts) -> list[Reason]:
    files = stamp.get("files")
    out: list[Reason] = []
    if not isinstance(files, list):
        return out
    for f in files:
        if not isinstance(f, Mapping):
            continue
        path, size, mtime = f.get("path"), f.get("size"), f.get("mtime_ns")
        kind = f.get("kind", "mapped")
        if not isinstance(path, str):
            continue
        try:
            st = os.stat(path)
        except OSError:
            out.append(Reason("files", path, "missing", _RULES["files.missing"].format(path=path)))
            continue
        # Files the process writes are its own data: it may have grown them since (a
        # leave-running checkpoint), and CRIU reopens append-mode files at their end.
        if kind == "open-append":
            continue
        what = ""
        if st.st_size != size:
            what = f"size {size} -> {st.st_size}"
        elif kind != "open-rw" and st.st_mtime_ns != mtime:
            what = "mtime changed"
        if what:
            out.append(
                Reason(
                    "files",
                    f"{path} size={size} mtime_ns={mtime}",
                    f"size={st.st_size} mtime_ns={st.st_mtime_ns}",
                    _RULES["files.changed"].format(path=path, what=what),
                )
            )
    return out


# Message templates, keyed by the rule's id; shared by POLICY and the checks above.
_RULES: dict[str, str] = {
    "host.arch": "CPU architecture differs: checkpoint {expected}, this node {actual}",
    "gpusnap.store_format": "store format differs: checkpoint {expected}, this node reads {actual}",
    "host.criu_version": "CRIU major version differs: checkpoint {expected}, this node {actual}",
    "host.cpu_features": "this CPU lacks features the checkpointed process may use: {missing}",
    "engine.name": "engine differs: checkpoint {expected}, this node declares {actual}",
    "engine.version": "engine version differs: checkpoint {expected}, this node has {actual}",
    "model.name": "model differs: checkpoint {expected}, this node declares {actual}",
    "model.revision": "model revision differs: checkpoint {expected}, this node declares {actual}",
    "model.digest": "model files differ in {dir}: checkpoint digest {expected}, here {actual}",
    "model.missing": "model directory cannot be read here: {dir} ({error})",
    "files.missing": "file the process had open or mapped is missing here: {path}",
    "files.changed": "file the process had open or mapped changed here: {path} ({what})",
}

POLICY: tuple[Rule, ...] = (
    Rule(
        "host.arch",
        "equal",
        _RULES["host.arch"],
        _equal("host.arch", lambda n: n.host.get("arch"), _RULES["host.arch"]),
    ),
    Rule(
        "gpusnap.store_format",
        "equal",
        _RULES["gpusnap.store_format"],
        _equal(
            "gpusnap.store_format",
            lambda n: n.gpusnap.get("store_format"),
            _RULES["gpusnap.store_format"],
        ),
    ),
    Rule("host.criu_version", "same major version", _RULES["host.criu_version"], _check_criu),
    Rule(
        "host.cpu_features",
        "all present on this node",
        _RULES["host.cpu_features"],
        _check_cpu,
    ),
    Rule(
        "engine.name",
        "equal to this node's config, when declared",
        _RULES["engine.name"],
        _declared("engine", "name"),
    ),
    Rule(
        "engine.version",
        "equal to this node's config, or to what this node has installed when probed",
        _RULES["engine.version"],
        _declared("engine", "version"),
    ),
    Rule(
        "model.name",
        "equal to this node's config, when declared",
        _RULES["model.name"],
        _declared("model", "name"),
    ),
    Rule(
        "model.revision",
        "equal to this node's config, when declared",
        _RULES["model.revision"],
        _declared("model", "revision"),
    ),
    Rule(
        "model.digest",
        "when recorded, the same digest here of the model directory's config and weights "
        "files (the workload's model_dir, else the recorded dir)",
        _RULES["model.digest"] + "; " + _RULES["model.missing"],
        _check_model_digest,
    ),
    Rule(
        "files",
        "each exists; mapped and read-only files with the same size and mtime, "
        "files open for writing with the same size, append-mode files in any size",
        _RULES["files.missing"] + "; " + _RULES["files.changed"],
        _check_files,
    ),
)


def check_compat(stamp: Mapping[str, Any], node: NodeFacts) -> list[Reason]:
    """Every reason ``stamp`` does not fit ``node`` (empty: compatible), GPU rules excepted."""
    reasons: list[Reason] = []
    for rule in POLICY:
        try:
            reasons.extend(rule.check(stamp, node))
        except Exception as exc:  # a malformed stamp must not crash the gate
            log.warning("compat rule %s failed on this stamp: %s", rule.field, exc)
            reasons.append(Reason(rule.field, "?", "?", f"{rule.field}: cannot evaluate: {exc}"))
    return reasons
