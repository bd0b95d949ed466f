"""deploy/kubernetes/ validated offline: every manifest against the Kubernetes API schemas
(kubernetes-validate, strict: unknown fields are errors) for each supported version, the
kustomization naming exactly the manifests there, and the DaemonSet holding what gpusnapd
needs. No cluster runs here (docs/kubernetes.md)."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

kubernetes_validate = pytest.importorskip("kubernetes_validate")

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
# The Kubernetes versions the manifests are supported on (docs/kubernetes.md).
VERSIONS = ("1.30.0", "1.31.0", "1.32.0", "1.33.0", "1.34.0", "1.35.0", "1.36.0", "1.37.0")
MANIFESTS = sorted(p for p in DEPLOY.glob("*.yaml") if p.name != "kustomization.yaml")


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _daemonset() -> dict[str, Any]:
    return next(d for p in MANIFESTS for d in _docs(p) if d["kind"] == "DaemonSet")


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_every_manifest_validates_strictly_against_the_api_schema(path: Path, version: str) -> None:
    docs = _docs(path)
    assert docs, f"{path.name} holds no resource"
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)


def test_a_manifest_with_an_unknown_field_is_rejected() -> None:
    ds = _daemonset()
    ds["spec"]["template"]["spec"]["hostPid"] = True  # the real field is hostPID
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(ds, VERSIONS[-1], strict=True)


def test_the_kustomization_names_every_manifest_and_nothing_else() -> None:
    k = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    assert k["kind"] == "Kustomization"
    assert sorted(k["resources"]) == [p.name for p in MANIFESTS]


def test_the_daemonset_runs_gpusnapd_with_what_it_needs_on_gpu_nodes() -> None:
    pod = _daemonset()["spec"]["template"]["spec"]
    assert pod["hostPID"] is True and pod["hostNetwork"] is True
    assert pod["terminationGracePeriodSeconds"] >= 150  # the daemon's own stop budget
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
    (c,) = pod["containers"]
    assert c["securityContext"]["privileged"] is True
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["exec"]["command"] == ["gpusnap", "status"]
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    for path in ("/var/lib/gpusnap", "/run/gpusnap", "/sys/fs/cgroup", "/run/containerd"):
        assert volumes[mounts[path]]["hostPath"]["path"] == path
    assert volumes[mounts["/etc/gpusnap/keys"]]["secret"]["secretName"] == "gpusnap-signing-key"
    assert volumes[mounts["/etc/gpusnap/gpusnapd.toml"]]["configMap"]["name"] == "gpusnapd-config"


def test_the_shipped_config_is_a_config_gpusnapd_accepts() -> None:
    from gpusnap.daemon.config.file import parse_config  # noqa: PLC0415

    cm = next(d for p in MANIFESTS for d in _docs(p) if d["kind"] == "ConfigMap")
    data = tomllib.loads(cm["data"]["gpusnapd.toml"])
    config = parse_config(data)
    ds = _daemonset()
    (c,) = ds["spec"]["template"]["spec"]["containers"]
    keys_dir = next(m["mountPath"] for m in c["volumeMounts"] if m["name"] == "signing-key")
    assert str(config.store.key_file).startswith(keys_dir + "/")
    assert str(config.daemon.socket).startswith("/run/gpusnap/")
