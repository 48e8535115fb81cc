"""The "restricted" Pod Security Standard (https://kubernetes.io/docs/concepts/security/pod-security-standards/,
policy version v1.30: baseline's controls plus restricted's) as a check over one pod spec, so the tests hold every
pod of the manifests to it without a cluster's admission controller."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

# Restricted: only these volume types.
ALLOWED_VOLUMES = frozenset({"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                             "projected", "secret"})
SAFE_SYSCTLS = frozenset({
    "kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes"})
SELINUX_TYPES = frozenset({"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"})
POD_KINDS = ("Pod", "Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job", "CronJob")


def pod_specs(doc: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The pod spec(s) inside a workload manifest (a CronJob's sits under its jobTemplate)."""
    kind = doc.get("kind")
    if kind == "Pod":
        yield doc["spec"]
    elif kind == "CronJob":
        yield doc["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    elif kind in POD_KINDS:
        yield doc["spec"]["template"]["spec"]


def violations(spec: dict[str, Any]) -> list[str]:
    """Every way `spec` breaks the restricted standard (empty when it meets it)."""
    found: list[str] = []
    pod_ctx = spec.get("securityContext") or {}
    containers = [*spec.get("initContainers", []), *spec.get("containers", []), *spec.get("ephemeralContainers", [])]
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(key):
            found.append(f"pod: {key}")
    for volume in spec.get("volumes", []):
        kinds = set(volume) - {"name"}
        if not kinds <= ALLOWED_VOLUMES:
            found.append(f"volume {volume['name']}: type {sorted(kinds - ALLOWED_VOLUMES)}")
    for sysctl in pod_ctx.get("sysctls", []):
        if sysctl["name"] not in SAFE_SYSCTLS:
            found.append(f"pod: sysctl {sysctl['name']}")
    found += _common("pod", pod_ctx)
    pod_non_root = pod_ctx.get("runAsNonRoot") is True
    pod_seccomp = (pod_ctx.get("seccompProfile") or {}).get("type")
    for c in containers:
        where = f"container {c['name']}"
        ctx = c.get("securityContext") or {}
        found += _common(where, ctx)
        if ctx.get("privileged"):
            found.append(f"{where}: privileged")
        if any(p.get("hostPort") for p in c.get("ports", [])):
            found.append(f"{where}: hostPort")
        if ctx.get("procMount", "Default") != "Default":
            found.append(f"{where}: procMount {ctx['procMount']}")
        if ctx.get("allowPrivilegeEscalation") is not False:
            found.append(f"{where}: allowPrivilegeEscalation is not false")
        if ctx.get("runAsNonRoot") is False or not (pod_non_root or ctx.get("runAsNonRoot") is True):
            found.append(f"{where}: runAsNonRoot is not true")
        if (ctx.get("seccompProfile") or {}).get("type", pod_seccomp) not in ("RuntimeDefault", "Localhost"):
            found.append(f"{where}: seccompProfile is not RuntimeDefault or Localhost")
        caps = ctx.get("capabilities") or {}
        if "ALL" not in caps.get("drop", []):
            found.append(f"{where}: capabilities do not drop ALL")
        if set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
            found.append(f"{where}: adds capabilities {sorted(set(caps['add']) - {'NET_BIND_SERVICE'})}")
    return found


def _common(where: str, ctx: dict[str, Any]) -> list[str]:
    """The controls a pod's and a container's securityContext share."""
    found = []
    if ctx.get("runAsUser") == 0:
        found.append(f"{where}: runAsUser 0")
    if (ctx.get("seccompProfile") or {}).get("type") == "Unconfined":
        found.append(f"{where}: seccompProfile Unconfined")
    if (ctx.get("appArmorProfile") or {}).get("type") == "Unconfined":
        found.append(f"{where}: appArmorProfile Unconfined")
    selinux = ctx.get("seLinuxOptions") or {}
    if selinux.get("type", "") not in SELINUX_TYPES or selinux.get("user") or selinux.get("role"):
        found.append(f"{where}: seLinuxOptions {selinux}")
    return found
