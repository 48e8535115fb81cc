"""The Kubernetes manifests (deploy/k8s), offline: each file and each overlay's `kustomize build` against the
Kubernetes OpenAPI schemas (kubernetes-validate), every pod of every overlay against the restricted Pod Security
Standard (pod_security.py), and what the pieces must agree on: images, addresses, Secret keys, labels, ports.

Overlays render with `kubectl kustomize` or `kustomize build`, whichever is on PATH (Debian packages neither; the
tests that need one skip and say so)."""

from __future__ import annotations

import copy
import functools
import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from kafold import config
from kafold.daemon import http
from kafold.errors import ConfigError
from tests.deploy import pod_security
from tests.support import ROOT

K8S = ROOT / "deploy" / "k8s"
BASE = K8S / "base"
OVERLAYS = sorted(p.parent for p in (K8S / "overlays").glob("*/kustomization.yaml"))
# Kinds the Kubernetes schemas do not know (CRDs): checked field by field below instead.
CUSTOM_KINDS = frozenset({("monitoring.coreos.com/v1", "ServiceMonitor")})
KUBERNETES = "1.30.0"
PLACEHOLDER_IMAGES = {"accounts", "kafold"}
ENDPOINT_KEYS = {"KAFOLD_KAFKA__BOOTSTRAP_SERVERS", "KAFOLD_POSTGRES__URL"}


def _kustomize() -> list[str] | None:
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    return None


needs_kustomize = pytest.mark.skipif(_kustomize() is None,
                                     reason="neither kustomize nor kubectl on PATH to render the overlays")


@functools.cache
def render(folder: Path) -> tuple[dict[str, Any], ...]:
    cmd = _kustomize()
    assert cmd is not None
    res = subprocess.run([*cmd, str(folder)], capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr
    return tuple(d for d in yaml.safe_load_all(res.stdout) if d)


def _files() -> list[Path]:
    """Every plain manifest: the base's (apart from its kustomization) and the example Secret."""
    return sorted(p for p in [*BASE.glob("*.yaml"), K8S / "secret.example.yaml"] if p.name != "kustomization.yaml")


def _validate(doc: dict[str, Any]) -> None:
    import kubernetes_validate

    kubernetes_validate.validate(doc, KUBERNETES, strict=True)


@pytest.mark.parametrize("manifest", _files(), ids=lambda p: p.name)
def test_each_manifest_file_validates(manifest: Path) -> None:
    """Each file of the base validates by itself (strict: an unknown or misspelt field fails)."""
    for doc in yaml.safe_load_all(manifest.read_text()):
        _validate(doc)


@needs_kustomize
@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.name)
def test_overlay_renders_and_validates(overlay: Path) -> None:
    docs = render(overlay)
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Job", "CronJob", "PodDisruptionBudget", "Service", "ConfigMap"} <= kinds, kinds
    for doc in docs:
        if (doc["apiVersion"], doc["kind"]) not in CUSTOM_KINDS:
            _validate(doc)


def _pods(docs: tuple[dict[str, Any], ...]) -> list[tuple[str, dict[str, Any]]]:
    return [(f"{d['kind']}/{d['metadata']['name']}", spec) for d in docs for spec in pod_security.pod_specs(d)]


@needs_kustomize
@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.name)
def test_every_pod_meets_the_restricted_pod_security_standard(overlay: Path) -> None:
    pods = _pods(render(overlay))
    assert {name.split("/")[0] for name, _ in pods} == {"Deployment", "Job", "CronJob"}, pods
    problems = {name: pod_security.violations(spec) for name, spec in pods}
    assert not any(problems.values()), problems


def test_every_pod_of_the_base_meets_the_restricted_pod_security_standard() -> None:
    """The same over the base's files as written, where no kustomize renders the overlays."""
    pods = _pods(tuple(d for f in _files() for d in yaml.safe_load_all(f.read_text())))
    assert len(pods) == 3, pods
    problems = {name: pod_security.violations(spec) for name, spec in pods}
    assert not any(problems.values()), problems


def test_the_pod_security_check_catches_what_the_manifests_used_to_do() -> None:
    """The check is not vacuous: the Deployment as it was before issue 54 (no seccompProfile, a container without a
    securityContext) fails it, and so do a hostPath volume, a root user and an added capability."""
    (deployment,) = yaml.safe_load_all((BASE / "deployment.yaml").read_text())
    spec = deployment["spec"]["template"]["spec"]
    assert pod_security.violations(spec) == []
    old = copy.deepcopy(spec)
    del old["securityContext"]["seccompProfile"]
    del old["containers"][0]["securityContext"]
    assert set(pod_security.violations(old)) == {
        "container app: seccompProfile is not RuntimeDefault or Localhost",
        "container app: capabilities do not drop ALL",
        "container app: allowPrivilegeEscalation is not false",
        "container kafold: seccompProfile is not RuntimeDefault or Localhost"}
    worse = copy.deepcopy(spec)
    worse["volumes"].append({"name": "host", "hostPath": {"path": "/"}})
    worse["containers"][1]["securityContext"] = {**worse["containers"][1]["securityContext"], "runAsUser": 0,
                                                 "capabilities": {"drop": ["ALL"], "add": ["SYS_ADMIN"]}}
    assert set(pod_security.violations(worse)) == {
        "volume host: type ['hostPath']", "container kafold: runAsUser 0",
        "container kafold: adds capabilities ['SYS_ADMIN']"}


def _kafold_containers(docs: tuple[dict[str, Any], ...], image: str) -> list[dict[str, Any]]:
    return [c for _, spec in _pods(docs) for c in [*spec.get("initContainers", []), *spec["containers"]]
            if c["image"].split(":")[0] == image]


def _overlay_settings(overlay: Path) -> tuple[dict[str, str], dict[str, str]]:
    """(placeholder → image, endpoint variable → value) as the overlay's kustomization sets them."""
    kustomization = yaml.safe_load((overlay / "kustomization.yaml").read_text())
    images = {i["name"]: f"{i['newName']}:{i['newTag']}" for i in kustomization["images"]}
    (endpoints,) = [g for g in kustomization["configMapGenerator"] if g["name"] == "kafold-endpoints"]
    return images, dict(line.split("=", 1) for line in endpoints["literals"])


@needs_kustomize
@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.name)
def test_an_overlay_sets_the_images_the_broker_and_the_database_everywhere(overlay: Path) -> None:
    """The three values of an overlay reach every pod: both images replace their placeholders, and every kafold
    container (sidecar, init job, snapshot job) reads the overlay's broker and database through the one ConfigMap."""
    images, endpoints = _overlay_settings(overlay)
    assert set(images) == PLACEHOLDER_IMAGES and set(endpoints) == ENDPOINT_KEYS
    docs = render(overlay)
    used = {c["image"] for _, spec in _pods(docs) for c in [*spec.get("initContainers", []), *spec["containers"]]}
    assert used == set(images.values()), used
    (rendered,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("kafold-endpoints")]
    assert rendered["data"] == endpoints
    kafold = _kafold_containers(docs, images["kafold"].split(":")[0])
    assert len(kafold) == 4, [c["name"] for c in kafold]  # sidecar, topics, migrations, snapshot
    for c in kafold:
        assert c["envFrom"] == [{"configMapRef": {"name": rendered["metadata"]["name"]}}], c["name"]
        assert not ENDPOINT_KEYS & {e["name"] for e in c.get("env", [])}, c["name"]  # nothing overrides them


@needs_kustomize
def test_overlays_differ_from_each_other_in_the_three_values() -> None:
    """dev and prod are not copies: each points at its own images, broker and database."""
    settings = [_overlay_settings(o) for o in OVERLAYS]
    assert len(settings) >= 2
    for key in PLACEHOLDER_IMAGES:
        assert len({s[0][key] for s in settings}) == len(settings), key
    for key in ENDPOINT_KEYS:
        assert len({s[1][key] for s in settings}) == len(settings), key


@needs_kustomize
@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.name)
def test_kafold_containers_keep_the_images_init(overlay: Path) -> None:
    """No kafold container sets `command`: it would replace the image's ENTRYPOINT, and with it tini as PID 1."""
    images, _ = _overlay_settings(overlay)
    for c in _kafold_containers(render(overlay), images["kafold"].split(":")[0]):
        assert "command" not in c, c["name"]
    entrypoint = re.search(r"^ENTRYPOINT (.+)$", (ROOT / "deploy/container/Containerfile").read_text(), re.MULTILINE)
    assert entrypoint and "tini" in entrypoint.group(1)


def _base(kind: str) -> dict[str, Any]:
    (doc,) = [d for f in _files() for d in yaml.safe_load_all(f.read_text()) if d["kind"] == kind]
    return doc


def test_init_job_ensures_topics_then_applies_migrations() -> None:
    """Like compose's kafold-init: `topics ensure` (an init container, so it finishes first), then `db upgrade`."""
    spec = _base("Job")["spec"]["template"]["spec"]
    (topics,) = spec["initContainers"]
    (migrations,) = spec["containers"]
    assert topics["args"] == ["topics", "ensure", "-c", "/etc/kafold/kafold.toml"]
    assert migrations["args"] == ["db", "upgrade", "-c", "/etc/kafold/kafold.toml"]
    assert topics["volumeMounts"] == migrations["volumeMounts"] and topics["envFrom"] == migrations["envFrom"]
    assert spec["restartPolicy"] == "OnFailure"


def test_disruption_budget_covers_the_deployments_pods() -> None:
    deployment, pdb = _base("Deployment"), _base("PodDisruptionBudget")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    # maxUnavailable 1: drains go one pod at a time and a one-replica overlay can still be drained.
    assert pdb["spec"] == {"maxUnavailable": 1, "selector": pdb["spec"]["selector"]}


def test_sidecar_probes_and_credentials() -> None:
    """Readiness on /ready, liveness on /health (the daemon's open paths), credentials from the Secret as read-only
    files, no service-account token."""
    spec = _base("Deployment")["spec"]["template"]["spec"]
    sidecar = next(c for c in spec["containers"] if c["name"] == "kafold")
    assert {sidecar["readinessProbe"]["httpGet"]["path"], sidecar["livenessProbe"]["httpGet"]["path"]} \
        <= http.OPEN_PATHS
    secret_volume = next(v for v in spec["volumes"] if "secret" in v)
    assert secret_volume["secret"]["defaultMode"] == 0o400
    assert spec["automountServiceAccountToken"] is False


def test_base_config_is_valid_apart_from_its_mounted_secrets(tmp_path: Path) -> None:
    """base/kafold.toml validates; the only problems are the secret files not mounted here."""
    text = (BASE / "kafold.toml").read_text()
    with pytest.raises(ConfigError) as info:
        config.parse(text, tmp_path / "kafold.toml", {})
    assert info.value.problems
    assert all("secret file '/run/secrets/kafold/" in p for p in info.value.problems), info.value.problems


def test_domain_code_comes_from_an_image_layer_not_a_configmap() -> None:
    """Nothing is mounted at the config's python_path (a ConfigMap there was the old way); Containerfile.domain copies
    the modules there, and its default folder holds every module the config names."""
    settings = tomllib.loads((BASE / "kafold.toml").read_text())
    (folder,) = settings["daemon"]["python_path"]
    for name, spec in _pods(tuple(yaml.safe_load((BASE / f).read_text()) for f in
                                  ("deployment.yaml", "job-init.yaml", "cronjob.yaml"))):
        for c in [*spec.get("initContainers", []), *spec["containers"]]:
            mounts = [m["mountPath"] for m in c.get("volumeMounts", [])]
            assert not any(folder == m or folder.startswith(m.rstrip("/") + "/") for m in mounts), (name, mounts)
    text = (K8S / "Containerfile.domain").read_text()
    (default,) = re.findall(r"^ARG DOMAIN=(\S+)$", text, flags=re.MULTILINE)
    (copy_line,) = re.findall(r"^COPY (.+)$", text, flags=re.MULTILINE)
    assert copy_line.split()[-1].rstrip("/") == folder
    modules = {ref.split(":")[0] for agg in settings["aggregates"] for ref in
               (agg["initial"], agg["evolve"], agg["decide"])}
    assert all((ROOT / default / f"{m}.py").is_file() for m in modules), modules


def test_metrics_scrape_sends_the_api_token() -> None:
    """/metrics is behind the token (daemon/http.py), so no pod asks for an annotation scrape (it got 401), and the
    ServiceMonitor sends the token from the very Secret key the daemon reads, to the Service's port."""
    assert "/metrics" not in http.OPEN_PATHS
    for kind in ("Deployment", "Job"):
        annotations = _base(kind)["spec"]["template"]["metadata"].get("annotations", {})
        assert not any(k.startswith("prometheus.io/") for k in annotations), (kind, annotations)
    settings = tomllib.loads((BASE / "kafold.toml").read_text())
    token_file = Path(settings["daemon"]["api_token_file"])
    spec = _base("Deployment")["spec"]["template"]["spec"]
    sidecar = next(c for c in spec["containers"] if c["name"] == "kafold")
    (mount,) = [m for m in sidecar["volumeMounts"] if Path(m["mountPath"]) == token_file.parent]
    (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    service = _base("Service")
    (monitor,) = yaml.safe_load_all((K8S / "components/servicemonitor/servicemonitor.yaml").read_text())
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert service["spec"]["selector"].items() <= _base("Deployment")["spec"]["template"]["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert endpoint["path"] == "/metrics"
    assert endpoint["authorization"] == {"type": "Bearer", "credentials": {
        "name": volume["secret"]["secretName"], "key": token_file.name}}
    secret = yaml.safe_load((K8S / "secret.example.yaml").read_text())
    assert token_file.name in secret["stringData"] and secret["metadata"]["name"] == volume["secret"]["secretName"]
