"""The sidecar image, built and run for real: podman builds deploy/container/Containerfile FROM a Debian base made
with debootstrap, and the container (host network) runs deploy/container/kafold.toml against the session's broker
and PostgreSQL: projection rows, a webhook reaching a receiver on the host, /ready, and a clean exit on SIGTERM."""

from __future__ import annotations

import importlib.util
import json
import re
import threading
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest

from kafold import config
from kafold.client import CommandClient
from tests.deploy.containers import ContainerSetupError, Podman, container_pg, install_tools
from tests.support import EXAMPLES, ROOT, free_port, wait_for

CONTAINER = ROOT / "deploy" / "container"
IMAGE = "localhost/kafold-test:latest"
CONFIG = "/etc/kafold/kafold.toml"


def _receiver_module() -> Any:
    """deploy/container/receiver.py (compose's `receiver` service), here the webhook target on the host."""
    spec = importlib.util.spec_from_file_location("kafold_container_receiver", CONTAINER / "receiver.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def container_config(prefix: str, receiver_url: str) -> str:
    """The container example's config with this test's own names (aggregate, topics, table) and webhook target."""
    text = (CONTAINER / "kafold.toml").read_text()
    for old, new in ((r'^name = "account"$', f'name = "{prefix}account"'),
                     (r'"account\.events"', f'"{prefix}account.events"'),
                     (r'^table = "accounts"$', f'table = "{prefix.replace("-", "_")}accounts"'),
                     (r'^url = "http://receiver:8089/account-events"$', f'url = "{receiver_url}"')):
        text, n = re.subn(old, new, text, flags=re.MULTILINE)
        assert n, f"{old} not in deploy/container/kafold.toml"
    return text


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except OSError:
        return 0


@pytest.fixture(scope="module")
def podman() -> Podman:
    reason = install_tools()
    if reason:
        pytest.skip(reason)
    return Podman()


@pytest.fixture(scope="module")
def image(podman: Podman) -> str:
    """kafold's image from the repository's source, FROM the local Debian base: lean (no Spark, no Java)."""
    base = podman.base_image()
    return podman.build(ROOT, CONTAINER / "Containerfile", IMAGE,
                        {"BASE_IMAGE": base, "EXTRAS": "daemon,registry,tracing", "WITH_JAVA": "0"})


@pytest.mark.timeout(900)
def test_sidecar_container_projects_delivers_reports_ready_and_stops_cleanly(
        podman: Podman, image: str, kafka_bootstrap: str, pg_url: str, tmp_path: Path) -> None:
    prefix = f"ct{uuid.uuid4().hex[:8]}-"
    table = f"{prefix.replace('-', '_')}accounts"
    deliveries: list[dict[str, Any]] = []
    receiver = _receiver_module().make_server("127.0.0.1", free_port(), deliveries.append)
    threading.Thread(target=receiver.serve_forever, name="webhook-receiver", daemon=True).start()
    http_port = free_port()

    conf_dir = tmp_path / "etc"
    conf_dir.mkdir(mode=0o755)
    conf_dir.chmod(0o755)  # read by the image's non-root user through the bind mount
    cfg_file = conf_dir / "kafold.toml"
    cfg_file.write_text(container_config(prefix, f"http://127.0.0.1:{receiver.server_address[1]}/account-events"))
    cfg_file.chmod(0o644)
    inside_pg, pg_options = container_pg(pg_url)
    run = ["run", "--network", "host", "-v", f"{conf_dir}:/etc/kafold:ro",
           "-v", f"{EXAMPLES / 'bank'}:/opt/kafold-example:ro", *pg_options,
           "-e", f"KAFOLD_KAFKA__BOOTSTRAP_SERVERS={kafka_bootstrap}", "-e", f"KAFOLD_POSTGRES__URL={inside_pg}",
           "-e", f"KAFOLD_DAEMON__HTTP_PORT={http_port}", "-e", f"KAFOLD_DAEMON__GROUP_PREFIX={prefix}kafold",
           "-e", "KAFOLD_SNAPSHOTS__ENABLED=false"]  # the lean image has no Spark
    name = f"kafold-test-{prefix.rstrip('-')}"
    # compose.yaml's init job, then its sidecar (the image's default command).
    podman(*run, "--rm", "--entrypoint", "sh", image, "-c",
           f"kafold topics ensure -c {CONFIG} && kafold db upgrade -c {CONFIG}")
    podman(*run, "-d", "--name", name, image)
    try:
        ready = f"http://127.0.0.1:{http_port}/ready"
        wait_for(lambda: _status(ready) == 200, f"{ready} to answer 200", timeout=120)
        # The image's init: tini is PID 1 (it reaps the orphans of task processes and JVMs), kafold its child.
        init = podman("exec", name, "cat", "/proc/1/comm").stdout.strip()
        assert init == "tini", init

        host_cfg = config.parse(cfg_file.read_text(), cfg_file, {"KAFOLD_KAFKA__BOOTSTRAP_SERVERS": kafka_bootstrap})
        with CommandClient(host_cfg.config.kafka, host_cfg.config.aggregates[0]) as client:
            results = client.send_many([client.command("acc-1", "OpenAccount", {"owner": "ada"}),
                                        client.command("acc-1", "Deposit", {"amount": 700}),
                                        client.command("acc-2", "OpenAccount", {"owner": "grace"})], timeout=60)
        assert len(results) == 3 and all(r.accepted for r in results.values()), results

        def rows() -> dict[str, tuple[Any, ...]]:
            try:
                with psycopg.connect(pg_url, autocommit=True) as conn:
                    found = conn.execute(f'SELECT account_id, owner, balance FROM "{table}"').fetchall()
            except psycopg.errors.UndefinedTable:
                return {}
            return {r[0]: tuple(r) for r in found}

        wait_for(lambda: rows() == {"acc-1": ("acc-1", "ada", 700), "acc-2": ("acc-2", "grace", 0)},
                 f"the projection rows in {table}", timeout=90)
        wait_for(lambda: len({d["webhook_id"] for d in deliveries}) >= 3, "three webhook deliveries", timeout=90)
        assert all(d["path"] == "/account-events" and d["webhook_id"] for d in deliveries), deliveries

        podman("stop", "--time", "30", name, timeout=60)
        state = json.loads(podman("inspect", "--format", "{{json .State}}", name).stdout)
        assert state["ExitCode"] == 0, (state, _logs(podman, name))
    except (AssertionError, ContainerSetupError) as e:
        raise AssertionError(f"{e}\n--- container log ---\n{_logs(podman, name)}") from e
    finally:
        receiver.shutdown()
        try:
            podman("rm", "--force", "--time", "5", name, timeout=60)
        except ContainerSetupError:
            pass


def _logs(podman: Podman, name: str) -> str:
    try:
        res = podman("logs", "--tail", "60", name, timeout=30)
    except ContainerSetupError as e:
        return str(e)
    return res.stdout + res.stderr
