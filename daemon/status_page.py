"""GET /ui: the daemon's status as a read-only HTML page, from the report /status answers with (daemon/status.py).

Plain HTML, no script: a meta refresh reloads it. Every value in it comes from outside (connector and aggregate
names, topics, states, reasons) and goes through `html.escape`, text and attributes alike; a Content-Security-Policy
that allows no script and only this page's own style is the second line should one slip through.
"""

from __future__ import annotations

import base64
import hashlib
import time
from collections.abc import Iterable, Sequence
from html import escape
from typing import Any

from faust.web import Request, Response

from kafold.daemon import status
from kafold.daemon.http import PAGE_PATH, HostView

REFRESH_S = 10
STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#1d1d1f;background:#fff}
h1{font-size:1.4em;margin:0 0 .2em} h2{font-size:1.1em;margin:1.6em 0 .4em;border-bottom:1px solid #ccc}
h3{font-size:.95em;margin:.9em 0 .3em;color:#333}
p.meta{color:#555;margin:0} p.empty{color:#777;font-style:italic}
table{border-collapse:collapse;margin:.3em 0} th,td{padding:.25em .7em;text-align:left;border-bottom:1px solid #eee}
th{background:#f4f4f6;font-weight:600} td.n{text-align:right;font-variant-numeric:tabular-nums}
.ok{color:#176b2c;font-weight:600} .warn{color:#8a5a00;font-weight:600} .bad{color:#b00020;font-weight:600}
"""
# The CSP names the style by its hash: no inline style or script but this one runs, whatever a value smuggles in.
STYLE_HASH = base64.b64encode(hashlib.sha256(STYLE.encode()).digest()).decode()
HEADERS = {
    "Content-Security-Policy": f"default-src 'none'; style-src 'sha256-{STYLE_HASH}'; base-uri 'none'; "
                               "form-action 'none'; frame-ancestors 'none'",
    "Cache-Control": "no-store",  # the page is behind the token: no shared or disk cache keeps a copy
    "Referrer-Policy": "no-referrer",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
}
GOOD = {"RUNNING", "LIVE", "closed"}
BAD = {"FAILED", "STOPPED", "open"}


class StatusPage(HostView):
    """The page (PAGE_PATH); the token guard also takes the token as HTTP Basic's password here (daemon/http.py)."""

    async def get(self, request: Request, **kwargs: Any) -> Response:
        return self.html(render(await status.report(self.host)), headers=HEADERS)


def render(report: dict[str, Any], now: float | None = None) -> str:
    """The page for one /status report."""
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(time.time() if now is None else now))
    parts = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        f'<meta http-equiv="refresh" content="{REFRESH_S}">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>kafold status — {_e(report.get('worker_id'))}</title><style>{STYLE}</style></head><body>",
        "<h1>kafold status</h1>",
        f'<p class="meta">worker {_e(report.get("worker_id"))} · {_e(when)} · reloads every {REFRESH_S} s · '
        "the same report as <code>/status</code></p>",
        "<h2>Connectors</h2>", _connectors(report.get("partitions", []), _rates(report, "connectors")),
        "<h2>Records per partition</h2>", _table(report.get("accounting", []), (
            "connector", "task", "topic", "partition", "seen", "applied", "duplicates", "stale", "dead_lettered",
            "skipped", "unaccounted"), "no records seen yet"),
        "<h2>Effects and parked keys</h2>", _table(report.get("effects", []), (
            "connector", "task", "endpoint", "circuit", "waiting", "in_flight", "fetch_paused", "parked_keys"),
            "no effect connector"),
        "<h2>Aggregates</h2>", _aggregates(report.get("aggregates", []), _rates(report, "aggregates")),
        "<h2>Dead letters</h2>", _dead_letters(report.get("dead_letters")),
        "</body></html>",
    ]
    return "\n".join(parts)


def _rates(report: dict[str, Any], kind: str) -> dict[str, Any]:
    """Per connector (records/s) or aggregate (commands/s) over the last minute; empty in the first seconds."""
    rates = report.get("rates") or {}
    return dict(rates.get(kind) or {})


def _rate(rates: dict[str, Any], name: str) -> str:
    return f'<td class="n rate">{_e(rates[name])}</td>' if name in rates else '<td class="n rate">…</td>'


def _connectors(rows: list[dict[str, Any]], rates: dict[str, Any]) -> str:
    summary: dict[str, dict[str, Any]] = {}
    for r in rows:
        s = summary.setdefault(str(r.get("connector")), {"states": set(), "lag": 0, "lag_seconds": 0.0, "parts": 0})
        s["states"].add(str(r.get("state")))
        if r.get("partition") is not None:
            s["parts"] += 1
            s["lag"] += r.get("lag") or 0
            s["lag_seconds"] = max(s["lag_seconds"], r.get("lag_seconds") or 0.0)
    if not summary:
        return '<p class="empty">no connector runs in this daemon</p>'
    head = _head(("connector", "state", "partitions", "records/s (last minute)", "lag (records)", "lag (s, oldest)"))
    body = "".join(f"<tr><td>{_e(name)}</td><td>{', '.join(_state(x) for x in sorted(s['states']))}</td>"
                   f"{_num(s['parts'])}{_rate(rates, name)}{_num(s['lag'])}{_num(s['lag_seconds'])}</tr>"
                   for name, s in sorted(summary.items()))
    detail = _table(rows, ("connector", "task", "state", "topic", "partition", "committed", "end_offset", "lag",
                           "lag_seconds", "caught_up"), "")
    return f"<table>{head}{body}</table>\n<h3>Per partition</h3>{detail}"


def _aggregates(rows: list[dict[str, Any]], rates: dict[str, Any]) -> str:
    if not rows:
        return '<p class="empty">no aggregate runs in this daemon</p>'
    # position and end are the recovery's (the gate's): where its replay stopped and the end it had to reach
    head = _head(("aggregate", "partition", "state", "recovered to", "end at start", "snapshot", "events replayed"))
    body = []
    for r in rows:
        snap = r.get("snapshot_version")
        restored = "none (full replay)" if snap is None else \
            f"covers events up to offset {_e(snap)}, tail from {_e(r.get('start'))}"
        # A fold error's text may quote an event's data: the page says where, `kafold status` says what.
        why = ' <span class="bad">fold error (text in <code>kafold status</code>)</span>' if r.get("fold_error") else ""
        body.append(f"<tr><td>{_e(r.get('aggregate'))}</td>{_num(r.get('partition'))}"
                    f"<td>{_state(r.get('phase'))}{why}</td>{_num(r.get('position'))}{_num(r.get('captured_end'))}"
                    f"<td>{restored}</td>{_num(r.get('events_replayed'))}</tr>")
    names = sorted({str(r.get("aggregate")) for r in rows})
    per_aggregate = _head(("aggregate", "commands/s (last minute)")) + "".join(
        f"<tr><td>{_e(n)}</td>{_rate(rates, n)}</tr>" for n in names)
    return f"<table>{per_aggregate}</table>\n<table>{head}{''.join(body)}</table>"


def _dead_letters(section: dict[str, Any] | None) -> str:
    if section is None:
        return '<p class="empty">no connector of this daemon uses PostgreSQL, where dead letters are listed ' \
               '(each connector\'s DLQ topic holds its own)</p>'
    if "error" in section:
        return f'<p class="bad">PostgreSQL could not be read ({_e(section["error"])})</p>'
    opened = section.get("open", {})
    if not opened:
        return '<p class="empty">no open dead letters</p>'
    counts = _table([{"connector": c, "open": n} for c, n in sorted(opened.items())], ("connector", "open"), "")
    newest = _table(section.get("newest", []), status.DEAD_LETTER_FIELDS, "")
    return (f"{counts}\n<h3>Newest (coordinates and reason; the record itself: <code>kafold dlq show ID</code>)</h3>"
            f"{newest}")


def _table(rows: Sequence[dict[str, Any]], columns: Sequence[str], empty: str) -> str:
    if not rows:
        return f'<p class="empty">{_e(empty)}</p>'
    body = "".join("<tr>" + "".join(_cell(c, r.get(c)) for c in columns) + "</tr>" for r in rows)
    return f"<table>{_head(columns)}{body}</table>"


def _head(columns: Iterable[str]) -> str:
    return "<tr>" + "".join(f"<th>{_e(c.replace('_', ' '))}</th>" for c in columns) + "</tr>"


def _cell(column: str, value: Any) -> str:
    if column in ("state", "circuit", "phase"):
        return f"<td>{_state(value)}</td>"
    if isinstance(value, bool) or value is None:
        return f"<td>{'' if value is None else _e('yes' if value else 'no')}</td>"
    return _num(value) if isinstance(value, int | float) else f"<td>{_e(value)}</td>"


def _state(value: Any) -> str:
    css = "ok" if str(value) in GOOD else "bad" if str(value) in BAD else "warn"
    return f'<span class="{css}">{_e(value)}</span>'


def _num(value: Any) -> str:
    return f'<td class="n">{"" if value is None else _e(value)}</td>'


def _e(value: Any) -> str:
    return escape("" if value is None else str(value), quote=True)


ROUTES: dict[str, type[HostView]] = {PAGE_PATH: StatusPage}
