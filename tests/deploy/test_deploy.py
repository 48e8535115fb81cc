"""Deployment files that can be checked offline: the systemd units (systemd-analyze verify and security), compose,
the Containerfile. Kubernetes: test_k8s.py; the dashboard and alert rules: test_observability.py."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

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


SERVICES = [u for u in UNITS if u.suffix == ".service"]
EXPOSURE_LIMIT = 2.0


def _systemd_version() -> int | None:
    """systemd-analyze's major version (`systemd 252 (252.38-1~deb12u1)`), None when it is not installed."""
    if shutil.which("systemd-analyze") is None:
        return None
    out = subprocess.run(["systemd-analyze", "--version"], capture_output=True, text=True, check=False).stdout
    return int(out.split()[1]) if out.startswith("systemd ") else None


@pytest.mark.skipif((_systemd_version() or 0) < 252,
                    reason="needs systemd-analyze >= 252 for `security --offline=true` (apt-get install systemd)")
@pytest.mark.parametrize("unit", SERVICES, ids=lambda p: p.name)
def test_systemd_unit_exposure_is_at_most_two(unit: Path) -> None:
    """`systemd-analyze security --offline=true` rates each service's sandbox at <= 2.0 (0 = fully locked down,
    10 = none; the units shipped at 5.8 and 6.5 before issue 54)."""
    import re

    res = subprocess.run(["systemd-analyze", "security", "--offline=true", "--no-pager", str(unit)],
                         capture_output=True, text=True, check=False)
    found = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", res.stdout)
    assert found, res.stdout + res.stderr
    assert float(found.group(1)) <= EXPOSURE_LIMIT, res.stdout


def _directives(unit: Path) -> dict[str, list[str]]:
    """A unit's [Service] settings: each key with its values in order (a key may repeat)."""
    settings: dict[str, list[str]] = {}
    section = ""
    for line in unit.read_text().splitlines():
        line = line.strip()
        if line.startswith("[") and line.endswith("]"):
            section = line
        elif section == "[Service]" and line and not line.startswith("#") and "=" in line:
            key, value = line.split("=", 1)
            settings.setdefault(key, []).append(value)
    return settings


@pytest.mark.parametrize("unit", SERVICES, ids=lambda p: p.name)
def test_systemd_units_carry_the_hardening_the_operator_asked_for(unit: Path) -> None:
    """The settings issue 54 names, on every service (the exposure score alone would let some trade for others),
    and never MemoryDenyWriteExecute=yes: each of these units may start a JVM (the timer's job, or the daemon's
    [snapshots] scheduler), whose JIT needs writable and executable memory."""
    settings = _directives(unit)
    expected = {"SystemCallArchitectures": "native", "CapabilityBoundingSet": "", "ProtectClock": "yes",
                "ProtectKernelLogs": "yes", "ProtectHostname": "yes", "RestrictSUIDSGID": "yes",
                "RestrictRealtime": "yes", "ProtectProc": "invisible", "UMask": "0077", "NoNewPrivileges": "yes",
                "DynamicUser": "yes", "ProtectSystem": "strict"}
    wrong = {k: settings.get(k) for k, v in expected.items() if settings.get(k, [None])[-1] != v}
    assert not wrong, wrong
    assert settings["SystemCallFilter"][0] == "@system-service", settings["SystemCallFilter"]
    assert settings.get("MemoryDenyWriteExecute", ["no"])[-1] == "no"
    assert any(v.startswith("kafka-password:") for v in settings["LoadCredential"])
    state = settings["StateDirectory"][-1]
    assert settings["WorkingDirectory"][-1] == f"%S/{state}"


def test_systemd_state_directories_are_not_shared() -> None:
    """Each unit's StateDirectory= is its own: two dynamic users on one directory would take its ownership from
    each other at every start."""
    dirs = [_directives(u)["StateDirectory"][-1] for u in SERVICES]
    assert len(set(dirs)) == len(dirs), dirs


CONTAINER = ROOT / "deploy" / "container"


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


def _host_path(service: dict[str, Any], path: str) -> Path:
    """Where a path inside a compose service's container comes from in the repository (its bind mounts)."""
    for volume in service.get("volumes", []):
        source, target, *_ = str(volume).split(":")
        if path == target or path.startswith(target.rstrip("/") + "/"):
            return (CONTAINER / source).resolve() / path[len(target):].lstrip("/")
    raise AssertionError(f"{path} is not mounted into the container")


def test_compose_init_job_ensures_topics_and_applies_migrations() -> None:
    """The one-shot init job runs `kafold topics ensure` and `kafold db upgrade` on the mounted config."""
    import yaml

    init = yaml.safe_load((CONTAINER / "compose.yaml").read_text())["services"]["kafold-init"]
    script = " ".join([*init.get("entrypoint", []), *init["command"]])
    assert "kafold topics ensure -c /etc/kafold/kafold.toml" in script, script
    assert "kafold db upgrade -c /etc/kafold/kafold.toml" in script, script
    assert script.index("topics ensure") < script.index("db upgrade") and "&&" in script, script


def test_compose_config_webhook_targets_a_service_of_the_project() -> None:
    """The config the sidecar mounts is valid, its modules are mounted, and each webhook URL names a compose service
    that exists (127.0.0.1 inside a container is the container itself: nothing would receive)."""
    from urllib.parse import urlsplit

    import yaml

    from kafold import config

    services = yaml.safe_load((CONTAINER / "compose.yaml").read_text())["services"]
    sidecar = services["kafold"]
    loaded = config.load_file(_host_path(sidecar, "/etc/kafold/kafold.toml"),
                              {"KAFOLD_KAFKA__BOOTSTRAP_SERVERS": "kafka:9092",
                               "KAFOLD_POSTGRES__URL": "postgresql://kafold@postgres:5432/app"})
    for folder in loaded.config.daemon.python_path:
        assert (_host_path(sidecar, str(Path("/etc/kafold", folder))) / "bank_domain.py").is_file(), folder
    webhooks = [c for c in loaded.config.connectors if c.connector_class == "webhook"]
    assert webhooks
    for con in webhooks:
        host = urlsplit(con.config["url"]).hostname
        assert host in services and host != "kafold", (con.name, con.config["url"])
        receiver = services[host]
        assert receiver["image"] == services["kafold"]["image"]
        script = _host_path(receiver, receiver["entrypoint"][1])
        assert script == CONTAINER / "receiver.py" and script.is_file()
        assert str(urlsplit(con.config["url"]).port) in receiver["entrypoint"]
    assert sidecar["depends_on"]["kafold-init"]["condition"] == "service_completed_successfully"


def test_containerfile_base_image_is_a_build_argument() -> None:
    """Both stages build FROM the BASE_IMAGE argument (a local base in tests), by default a public Python image."""
    import re

    text = (CONTAINER / "Containerfile").read_text()
    (default,) = re.findall(r"^ARG BASE_IMAGE=(\S+)$", text, flags=re.MULTILINE)
    assert default.startswith("python:3.")
    froms = re.findall(r"^FROM (\S+)", text, flags=re.MULTILINE)
    assert froms == ["${BASE_IMAGE}", "${BASE_IMAGE}"], froms


def test_containerfile_runs_kafold_under_tini() -> None:
    """The runtime stage installs Debian's tini and the ENTRYPOINT starts kafold through it (PID 1 reaps the orphans
    of task processes and JVMs); tini runs without -g, so SIGTERM reaches kafold alone, which stops its children."""
    import json
    import re

    runtime = (CONTAINER / "Containerfile").read_text().rsplit("\nFROM ", 1)[1]
    installs = re.findall(r"apt-get install -y --no-install-recommends ([^\\&\n;]+)", runtime)
    assert any("tini" in line.split() for line in installs), installs
    (entrypoint,) = re.findall(r"^ENTRYPOINT (.+)$", runtime, flags=re.MULTILINE)
    assert json.loads(entrypoint)[:3] == ["/usr/bin/tini", "--", "kafold"], entrypoint


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
    res = subprocess.run([sys.executable, "-c", "import kafold, kafold.tools.cli, kafold.daemon.runner; "
                          "print(kafold.__file__); kafold.tools.cli.build_parser()"],
                         env=env, cwd=tmp_path, capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().startswith(str(target))


PROMETHEUS_CONFIGS = [CONTAINER / "prometheus.yml", ROOT / "deploy" / "k8s" / "prometheus" / "scrape-config.yaml"]


def _promtool_knows_kubernetes_sd(tmp_path: Path) -> bool:
    probe = tmp_path / "probe.yml"
    probe.write_text("scrape_configs:\n  - job_name: probe\n    kubernetes_sd_configs: [{role: pod}]\n")
    res = subprocess.run(["promtool", "check", "config", str(probe)], capture_output=True, text=True, check=False)
    return "kubernetes_sd_configs not found" not in res.stdout + res.stderr


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool missing: apt-get install prometheus")
@pytest.mark.parametrize("path", PROMETHEUS_CONFIGS, ids=lambda p: p.parent.name)
def test_prometheus_scrape_configs_pass_promtool(path: Path, tmp_path: Path) -> None:
    """Each scrape example is a valid Prometheus configuration (`promtool check config`), its credentials file
    pointed at a real file here (promtool checks that the file exists). Debian's promtool is built without
    Kubernetes service discovery: there the kubernetes_sd_configs block becomes a static target, and the rest (the
    authorization, the relabelling) is checked all the same."""
    import yaml

    conf = yaml.safe_load(path.read_text())
    token = tmp_path / "api-token"
    token.write_text("t0ken")
    with_k8s_sd = _promtool_knows_kubernetes_sd(tmp_path)
    for job in conf["scrape_configs"]:
        job["authorization"]["credentials_file"] = str(token)
        if "kubernetes_sd_configs" in job and not with_k8s_sd:
            del job["kubernetes_sd_configs"]
            job["static_configs"] = [{"targets": ["kafold.example:8083"]}]
    for name in conf.get("rule_files", []):  # resolved beside the config, where compose.yaml mounts them
        shutil.copy(ROOT / "deploy" / "prometheus" / name, tmp_path / name)
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(conf))
    res = subprocess.run(["promtool", "check", "config", str(tmp_path / "prometheus.yml")],
                         capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.parametrize("path", PROMETHEUS_CONFIGS, ids=lambda p: p.parent.name)
def test_prometheus_scrape_configs_send_the_api_token(path: Path) -> None:
    """/metrics is behind the API token (daemon/http.py), so every scrape job of the examples sends it."""
    import yaml

    from kafold.daemon import http

    assert "/metrics" not in http.OPEN_PATHS
    for job in yaml.safe_load(path.read_text())["scrape_configs"]:
        assert job["authorization"]["type"] == "Bearer" and job["authorization"]["credentials_file"], job
        assert job.get("metrics_path", "/metrics") == "/metrics"


def test_compose_prometheus_reads_the_token_the_sidecar_checks() -> None:
    """The sidecar's API token file and Prometheus's credentials file are the same compose secret, and Prometheus
    scrapes the sidecar's service and port."""
    import yaml

    services = yaml.safe_load((CONTAINER / "compose.yaml").read_text())["services"]
    token_file = services["kafold"]["environment"]["KAFOLD_DAEMON__API_TOKEN_FILE"]
    assert token_file == "/run/secrets/api-token" and "api-token" in services["kafold"]["secrets"]
    assert "api-token" in services["prometheus"]["secrets"]
    (job,) = yaml.safe_load((CONTAINER / "prometheus.yml").read_text())["scrape_configs"]
    assert job["authorization"]["credentials_file"] == token_file
    (target,) = job["static_configs"][0]["targets"]
    assert target == f"kafold:{services['kafold']['ports'][0].rsplit(':', 1)[1]}"
    mounts = dict(reversed(v.split(":")[:2]) for v in services["prometheus"]["volumes"])
    assert mounts["/etc/prometheus/prometheus.yml"] == "./prometheus.yml"
    rules = yaml.safe_load((CONTAINER / "prometheus.yml").read_text())["rule_files"]
    assert rules == ["kafold-rules.yaml"]  # the alert rules, mounted from deploy/prometheus beside the config
    mounted_rules = (CONTAINER / mounts["/etc/prometheus/kafold-rules.yaml"]).resolve()
    assert mounted_rules == ROOT / "deploy" / "prometheus" / rules[0]


# The units' sandbox, tried on what runs inside it (no systemd needed): the system-call filter, loaded by
# seccomp_exec.py with Debian's python3-seccomp, around a JVM and around kafold's Python spawning a child.
SYSTEM_PYTHON = Path("/usr/bin/python3")
SECCOMP_EXEC = Path(__file__).with_name("seccomp_exec.py")


def _seccomp_missing() -> str | None:
    if shutil.which("systemd-analyze") is None:
        return "systemd-analyze missing: apt-get install systemd"
    res = subprocess.run([str(SYSTEM_PYTHON), "-c", "import seccomp"], capture_output=True, check=False) \
        if SYSTEM_PYTHON.exists() else None
    if res is None or res.returncode != 0:
        return "Debian's python3-seccomp missing: apt-get install python3-seccomp"
    return None


def _syscall_set(group: str) -> set[str]:
    """The system calls of a systemd group (`@system-service`), its nested groups expanded, or a single call."""
    if not group.startswith("@"):
        return {group}
    out = subprocess.run(["systemd-analyze", "syscall-filter", "--no-pager", group], capture_output=True,
                         text=True, check=True).stdout
    calls: set[str] = set()
    for line in out.splitlines()[1:]:
        name = line.strip()
        if name and not name.startswith("#"):
            calls |= _syscall_set(name)
    return calls


def _unit_filter(unit: Path) -> list[str]:
    """The allow list a unit's SystemCallFilter= lines add up to: the first (an allow list), minus each `~` line."""
    allowed: set[str] = set()
    for value in _directives(unit)["SystemCallFilter"]:
        names = value.removeprefix("~").split()
        calls = set().union(*(_syscall_set(n) for n in names))
        allowed = allowed - calls if value.startswith("~") else allowed | calls
    return sorted(allowed)


def _sandboxed(spec: dict[str, Any], command: list[str]) -> subprocess.CompletedProcess[str]:
    """`command` under `spec` (seccomp_exec.py), in a scratch directory: a JVM that fails writes hs_err_pid*.log
    into its working directory."""
    import json
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        return subprocess.run([str(SYSTEM_PYTHON), str(SECCOMP_EXEC), json.dumps(spec), "--", *command],
                              capture_output=True, text=True, timeout=300, check=False, cwd=scratch)


@pytest.mark.skipif(_seccomp_missing() is not None, reason=str(_seccomp_missing()))
@pytest.mark.skipif(shutil.which("java") is None, reason="no java: apt-get install openjdk-17-jre-headless")
def test_the_jvm_runs_under_the_snapshot_units_system_call_filter() -> None:
    """Java starts and JIT-compiles every method it runs (-Xcomp) inside kafold-snapshot.service's filter; and the
    filter is not a no-op: without `@process` (clone, fork) the same JVM cannot start its threads."""
    unit = ROOT / "deploy" / "systemd" / "kafold-snapshot.service"
    allowed = _unit_filter(unit)
    res = _sandboxed({"allow": allowed}, ["java", "-Xcomp", "-version"])
    assert res.returncode == 0, res.stderr[-2000:]
    assert "openjdk version" in res.stderr.lower() or "java version" in res.stderr.lower(), res.stderr
    crippled = sorted(set(allowed) - _syscall_set("@process"))
    assert _sandboxed({"allow": crippled}, ["java", "-version"]).returncode != 0


@pytest.mark.skipif(_seccomp_missing() is not None, reason=str(_seccomp_missing()))
@pytest.mark.parametrize("unit", [u for u in SERVICES if "snapshot" not in u.name], ids=lambda p: p.name)
def test_kafold_spawns_and_talks_under_the_daemon_units_system_call_filter(unit: Path) -> None:
    """kafold's Python inside the daemon unit's filter: its daemon modules import, it spawns a Python child the way
    task processes start (subprocess, a pipe), and asyncio serves and connects over TCP."""
    script = (
        "import asyncio, subprocess, sys\n"
        "import kafold.tools.cli, kafold.daemon.runner, kafold.daemon.task_process\n"
        "child = subprocess.run([sys.executable, '-c', 'print(6 * 7)'], capture_output=True, text=True, check=True)\n"
        "assert child.stdout.strip() == '42', child\n"
        "async def main():\n"
        "    async def echo(r, w):\n"
        "        w.write(await r.readline()); await w.drain(); w.close()\n"
        "    server = await asyncio.start_server(echo, '127.0.0.1', 0)\n"
        "    r, w = await asyncio.open_connection(*server.sockets[0].getsockname()[:2])\n"
        "    w.write(b'ping\\n'); await w.drain()\n"
        "    assert await r.readline() == b'ping\\n'\n"
        "    server.close()\n"
        "asyncio.run(main())\n"
        "print('ok')\n")
    res = _sandboxed({"allow": _unit_filter(unit)}, [sys.executable, "-c", script])
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-2000:]


@pytest.mark.skipif(_seccomp_missing() is not None, reason=str(_seccomp_missing()))
@pytest.mark.skipif(shutil.which("java") is None, reason="no java: apt-get install openjdk-17-jre-headless")
def test_the_jvm_fails_without_write_execute_memory() -> None:
    """Why no unit sets MemoryDenyWriteExecute=yes: the JVM refuses to start when memory cannot become writable and
    executable (here the kernel's PR_SET_MDWE, the same refusal)."""
    res = _sandboxed({"mdwe": True}, ["java", "-version"])
    if res.returncode == 77:
        pytest.skip("the kernel has no PR_SET_MDWE (Linux >= 6.3)")
    assert res.returncode != 0 and "executable" in res.stdout + res.stderr, res.stdout + res.stderr
