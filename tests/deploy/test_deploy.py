"""Deployment files that can be checked offline: the systemd units pass systemd-analyze verify."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.support import ROOT

UNITS = sorted((ROOT / "deploy" / "systemd").glob("*.service")) + sorted((ROOT / "deploy" / "systemd").glob("*.timer"))


@pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                    reason="systemd-analyze missing: apt-get install systemd")
@pytest.mark.parametrize("unit", UNITS, ids=lambda p: p.name)
def test_systemd_unit_verifies(unit: Path, tmp_path: Path) -> None:
    """Each unit passes `systemd-analyze verify` with its ExecStart pointing at a real kafold."""
    kafold = Path(sys.executable).with_name("kafold")
    for other in UNITS:  # a timer verifies together with the service it triggers
        text = other.read_text().replace("/opt/kafold/venv/bin/kafold", str(kafold))
        (tmp_path / other.name).write_text(text)
    res = subprocess.run(["systemd-analyze", "verify", "--man=no", str(tmp_path / unit.name)],
                         capture_output=True, text=True, check=False)
    problems = [line for line in res.stderr.splitlines()
                if str(tmp_path) in line or "kafold" in line]  # ignore warnings about the host's own units
    assert res.returncode == 0 and not problems, res.stderr


CONTAINER = ROOT / "deploy" / "container"
K8S = ROOT / "deploy" / "k8s"


def test_compose_file_matches_the_compose_spec() -> None:
    """compose.yaml validates against the Compose specification schema (vendored by check-jsonschema)."""
    exe = Path(sys.executable).with_name("check-jsonschema")
    res = subprocess.run([str(exe), "--builtin-schema", "vendor.compose-spec", str(CONTAINER / "compose.yaml")],
                         capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stdout + res.stderr


def test_compose_runs_apache_kafka_postgres_sidecar_and_snapshot_job() -> None:
    import yaml

    services = yaml.safe_load((CONTAINER / "compose.yaml").read_text())["services"]
    assert services["kafka"]["image"].startswith("apache/kafka:")
    assert services["kafka"]["environment"]["KAFKA_PROCESS_ROLES"] == "broker,controller"  # KRaft
    assert services["kafold"]["environment"]["KAFOLD_POSTGRES__PASSWORD_FILE"].startswith("/run/secrets/")
    assert services["snapshot"]["command"][:2] == ["snapshot", "run"]


@pytest.mark.parametrize("manifest", sorted(K8S.glob("*.yaml")), ids=lambda p: p.name)
def test_kubernetes_manifests_validate(manifest: Path) -> None:
    """Each manifest validates against the Kubernetes OpenAPI schemas bundled by kubernetes-validate."""
    import kubernetes_validate
    import yaml

    for doc in yaml.safe_load_all(manifest.read_text()):
        kubernetes_validate.validate(doc, "1.30.0", strict=True)


def test_sidecar_probes_and_credentials() -> None:
    """Readiness on /ready, liveness on /health, credentials from the Secret as read-only files."""
    import yaml

    spec = yaml.safe_load((K8S / "deployment.yaml").read_text())["spec"]["template"]["spec"]
    sidecar = next(c for c in spec["containers"] if c["name"] == "kafold")
    assert sidecar["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert sidecar["livenessProbe"]["httpGet"]["path"] == "/health"
    secret_volume = next(v for v in spec["volumes"] if "secret" in v)
    assert secret_volume["secret"]["defaultMode"] == 0o400
    assert spec["securityContext"]["runAsNonRoot"] is True


def test_configmap_config_is_valid_apart_from_its_mounted_secrets(tmp_path: Path) -> None:
    """The kafold.toml in the ConfigMap validates; the only problems are the secret files not mounted here."""
    import yaml

    from kafold import config
    from kafold.errors import ConfigError

    text = yaml.safe_load((K8S / "configmap.yaml").read_text())["data"]["kafold.toml"]
    with pytest.raises(ConfigError) as info:
        config.parse(text, tmp_path / "kafold.toml", {})
    assert info.value.problems
    assert all("secret file '/run/secrets/kafold/" in p for p in info.value.problems), info.value.problems


@pytest.mark.slow
def test_containerfile_install_steps_produce_a_working_kafold(tmp_path: Path) -> None:
    """The Containerfile's build (a wheel of the tree, installed into a venv) yields every kafold package."""
    wheels = tmp_path / "wheels"
    # Built from a copy of the tree: setuptools reuses the checkout's build/lib, which would still ship a module
    # that moved since the last build there.
    tree = tmp_path / "tree"
    shutil.copytree(ROOT, tree, ignore=shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "__pycache__",
                                                              ".*_cache"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
                    "--wheel-dir", str(wheels), str(tree)], check=True, capture_output=True)
    (wheel,) = wheels.glob("kafold-*.whl")
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", "--target", str(target),
                    str(wheel)], check=True, capture_output=True)
    for package in ("daemon", "connectors", "spark_jobs", "migrations"):
        assert (target / "kafold" / package / "__init__.py").is_file(), package
        assert not (target / package).exists(), f"bare top-level {package!r} shipped"
    # Each module of the tree once, where the package-dir mapping puts it, and nothing else.
    with zipfile.ZipFile(wheel) as zf:
        shipped = sorted(n for n in zf.namelist() if n.endswith(".py"))
    expected = sorted(
        [str(p.relative_to(ROOT)) for p in (ROOT / "kafold").rglob("*.py") if "__pycache__" not in p.parts]
        + [f"kafold/{p.relative_to(ROOT)}" for d in ("daemon", "connectors", "spark_jobs", "migrations")
           for p in (ROOT / d).rglob("*.py") if "__pycache__" not in p.parts])
    assert shipped == expected
    env = {"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"}
    res = subprocess.run([sys.executable, "-c", "import kafold, kafold.cli, kafold.daemon.runner; "
                          "print(kafold.__file__); kafold.cli.build_parser()"],
                         env=env, cwd=tmp_path, capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().startswith(str(target))


def test_grafana_dashboard_uses_only_metrics_the_daemon_exports() -> None:
    """Every metric the dashboard queries is one the daemon's registry or a built-in connector declares."""
    import json
    import re

    from kafold.connectors import registry as connectors
    from kafold.daemon.metrics import DaemonMetrics

    registry = DaemonMetrics(lambda: []).registry
    exported = set()
    for family in registry.collect():
        exported.add(family.name)
        exported.update(sample.name for sample in family.samples)
    exported.update(m.name for name in connectors.available() for m in connectors.resolve(name).metrics)
    exported |= {f"{name}_total" for name in exported} | {f"{name}_bucket" for name in exported}
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "kafold-dashboard.json").read_text())
    queried = {m for p in dashboard["panels"] for t in p["targets"] for m in re.findall(r"\bkafold_[a-z_]+", t["expr"])}
    assert queried and queried <= exported, queried - exported
