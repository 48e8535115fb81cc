"""The deployment files checked offline: systemd units, compose, Kubernetes, the container install, Grafana."""
