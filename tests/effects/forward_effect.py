"""A python effect for the fresh-database test: POSTs each event to the URL in KT_FORWARD_URL (a real receiver)."""

from __future__ import annotations

import os
import urllib.request

from kafold.envelope import Event, body_json


def forward(event: Event) -> None:
    req = urllib.request.Request(os.environ["KT_FORWARD_URL"], data=body_json(event), method="POST",
                                 headers={"content-type": "application/json", "webhook-id": event.event_id})
    with urllib.request.urlopen(req, timeout=10) as resp:
        resp.read()
