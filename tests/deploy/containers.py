"""Podman where no container engine runs and no image registry is reachable: the tools from Debian's packages, a
base image imported from a debootstrap root (cached), kafold's image built FROM it, and `podman` with the options
this sandbox needs (runc, cgroupfs, no default ulimits). See ../shared/ENVIRONMENT.md, "Containers"."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import tarfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlencode, urlsplit, urlunsplit

CACHE = Path(os.environ.get("KAFOLD_CONTAINER_CACHE") or Path.home() / ".cache" / "kafold-container")
TOOLS = ("podman", "runc", "debootstrap")
SUITE = "bookworm"  # Python 3.11
INCLUDE = ("python3", "python3-venv", "ca-certificates")
MIRROR = os.environ.get("KAFOLD_TEST_DEBIAN_MIRROR") or "http://deb.debian.org/debian"
# The host's trust anchors go into the base image: pip inside the build must trust what the host trusts (a TLS
# proxy's CA here). They belong to this machine, not to the product's Containerfile.
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
# The sandbox refuses setrlimit, which podman applies by default; crun fails on it and on the hybrid cgroups.
CONTAINERS_CONF = "[containers]\ndefault_ulimits = []\n"
PG_SOCKET_DIR = "/run/kafold-pg"
# On the base image, hence on every image and build step made FROM it: what the cleanup may remove.
LABEL = "org.kafold.test-base"


class ContainerSetupError(RuntimeError):
    """A step of the container setup failed; the message carries the command's output."""


def _run(cmd: Sequence[str], *, env: Mapping[str, str] | None = None, timeout: float = 600,
         stdin: Any = None) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, env=dict(env or os.environ),
                         check=False, stdin=stdin)
    if res.returncode != 0:
        raise ContainerSetupError(f"{' '.join(cmd)} exited {res.returncode}:\n{res.stdout[-3000:]}\n"
                                  f"{res.stderr[-3000:]}")
    return res


def install_tools() -> str | None:
    """Install podman, runc and debootstrap with apt-get when one is missing; None when they are all there, else
    why they cannot be (a reason to skip)."""
    missing = [t for t in TOOLS if shutil.which(t) is None and not Path("/usr/sbin", t).exists()]
    if not missing:
        return None
    how = "apt-get install -y podman runc debootstrap"
    if os.geteuid() != 0:
        return f"{', '.join(missing)} missing and not running as root to install them ({how})"
    if shutil.which("apt-get") is None:
        return f"{', '.join(missing)} missing and no apt-get to install them (needs Debian's {how})"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", *TOOLS]
    try:
        _run(install, env=env)
    except ContainerSetupError:
        try:  # a fresh machine's package lists may be missing or stale
            _run(["apt-get", "update", "-q"], env=env)
            _run(install, env=env)
        except ContainerSetupError as e:
            return f"could not install {', '.join(missing)}: {e}"
    still = [t for t in TOOLS if shutil.which(t) is None and not Path("/usr/sbin", t).exists()]
    return f"{', '.join(still)} still missing after {how}" if still else None


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """One builder at a time (two pytest sessions on one machine share the cache and podman's store)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class Podman:
    """`podman` with this machine's options; builds (or finds cached) the base image and kafold's image."""

    def __init__(self, cache: Path = CACHE) -> None:
        self.cache = cache
        cache.mkdir(parents=True, exist_ok=True)
        self.conf = cache / "containers.conf"
        self.conf.write_text(CONTAINERS_CONF)
        self.env = {**os.environ, "CONTAINERS_CONF": str(self.conf)}

    def __call__(self, *args: str, timeout: float = 600, stdin: Any = None) -> subprocess.CompletedProcess[str]:
        return _run(["podman", "--runtime", "runc", "--cgroup-manager=cgroupfs", *args], env=self.env,
                    timeout=timeout, stdin=stdin)

    def exists(self, image: str) -> bool:
        try:
            self("image", "exists", image)
        except ContainerSetupError:
            return False
        return True

    def image_id(self, image: str) -> str | None:
        return self("image", "inspect", "--format", "{{.Id}}", image).stdout.strip() if self.exists(image) else None

    def base_image(self) -> str:
        """A Debian image with Python 3.11 and venv, imported from a debootstrap root; cached in podman's store,
        and its root's tarball in the cache folder (a re-import takes seconds, a debootstrap about a minute)."""
        ca = HOST_CA_BUNDLE.read_bytes() if HOST_CA_BUNDLE.is_file() else b""
        digest = hashlib.sha256(repr((SUITE, INCLUDE, MIRROR, LABEL)).encode() + ca).hexdigest()[:12]
        image = f"localhost/kafold-test-base:{SUITE}-{digest}"
        with _locked(self.cache / "build.lock"):
            if self.exists(image):
                return image
            tarball = self.cache / f"{SUITE}-{digest}.tar"
            if not tarball.is_file():
                self._debootstrap(tarball, ca)
            with tarball.open("rb") as f:
                self("import", "--change", f"LABEL {LABEL}={SUITE}", "-", image, stdin=f)
        return image

    def _debootstrap(self, tarball: Path, ca: bytes) -> None:
        root = self.cache / "root.tmp"
        shutil.rmtree(root, ignore_errors=True)
        _run(["debootstrap", "--variant=minbase", f"--include={','.join(INCLUDE)}", SUITE, str(root), MIRROR],
             timeout=900)
        if ca:
            (root / "etc/ssl/certs/ca-certificates.crt").write_bytes(ca)
            (root / "etc/pip.conf").write_text("[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n")
        shutil.rmtree(root / "var/cache/apt/archives", ignore_errors=True)
        partial = tarball.with_suffix(".partial")
        with tarfile.open(partial, "w") as tar:
            tar.add(root, arcname=".")
        partial.rename(tarball)
        shutil.rmtree(root, ignore_errors=True)

    def build(self, context: Path, containerfile: Path, tag: str, build_args: Mapping[str, str]) -> str:
        """`podman build` (host network: the build's pip reaches the index as the host does). Unchanged steps come
        from the layer cache; the images of earlier builds that this one no longer uses are removed, so repeated
        runs do not pile up images."""
        with _locked(self.cache / "build.lock"):
            args = [a for k, v in build_args.items() for a in ("--build-arg", f"{k}={v}")]
            out = self("build", "--network", "host",
                       "--ignorefile", str(containerfile.with_name(containerfile.name + ".dockerignore")),
                       "-f", str(containerfile), "-t", tag, *args, str(context), timeout=900).stdout
            used = [line.split()[-1] for line in out.splitlines() if line.startswith("-->")]  # short or full ids
            stale = self("images", "--quiet", "--no-trunc", "--filter", "dangling=true",
                         "--filter", f"label={LABEL}").stdout.split()
            for image_id in stale:
                if not any(image_id.removeprefix("sha256:").startswith(u) for u in used):
                    with contextlib.suppress(ContainerSetupError):
                        self("rmi", image_id)
        return tag


def container_pg(url: str) -> tuple[str, list[str]]:
    """(the URL as the container sees it, the `podman run` options it needs): a PostgreSQL reached by a Unix socket
    (the dev stack's) gets that socket file bind-mounted, since the host network shares TCP ports, not sockets."""
    parts = urlsplit(url)
    query = parse_qs(parts.query)
    host = (query.get("host") or [""])[0]
    if not host.startswith("/"):
        return url, []
    port = (query.get("port") or ["5432"])[0]
    socket = f".s.PGSQL.{port}"
    query["host"] = [PG_SOCKET_DIR]
    inside = urlunsplit(parts._replace(query=urlencode({k: v[0] for k, v in query.items()})))
    return inside, ["-v", f"{host}/{socket}:{PG_SOCKET_DIR}/{socket}"]
