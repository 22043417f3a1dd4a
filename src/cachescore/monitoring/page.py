"""The live status page at ``<dashboard>/cachescore`` (a route on the scheduler's HTTP server).

``GET /cachescore`` is one self-contained HTML page (no external assets) with the units as they
are when it is served (so it reads without JavaScript); its script fetches
``GET /cachescore/units.json`` (the run board's snapshot, :meth:`~.board.RunBoard.snapshot`)
every second and redraws the table of units (encoder, view, design, metric, state, duration, value,
recall, error) and the run's counts. Values are inserted as text, never as HTML. Both answer 200
with an empty board when no run has started on this scheduler.
"""

from __future__ import annotations

import html
import json

from distributed.http.utils import RequestHandler

from .._jsonsafe import json_safe

__all__ = ["StatusPageHandler", "UnitsJsonHandler", "PAGE_PATH", "add_routes", "current_board"]

#: Path of the page on the scheduler's HTTP server (the JSON is at ``PAGE_PATH + "/units.json"``).
PAGE_PATH = "/cachescore"

_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>cachescore run</title>
<style>
body{font:14px system-ui,sans-serif;margin:1.5em;color:#222}
table{border-collapse:collapse;margin-top:1em}
th,td{border-bottom:1px solid #ddd;padding:.25em .6em;text-align:left}
td.num{text-align:right;font-variant-numeric:tabular-nums}
.pending{color:#777}.running{color:#b36b00;font-weight:600}.done{color:#1a7f37}.failed,.not_run{color:#c00}
.skipped{color:#555}#counts span{margin-right:1em}
</style></head>
<body>
<h1>cachescore <span id="run">__RUN__</span></h1>
<p><a href="__PREFIX__/status">Dask dashboard</a> · state: <b id="state">-</b> <span id="reason"></span></p>
<p id="counts"></p>
<table id="units"><thead><tr><th>encoder</th><th>view</th><th>design</th><th>metric</th><th>state</th>
<th>seconds</th><th>value</th><th>recall</th><th>error</th></tr></thead><tbody>__ROWS__</tbody></table>
<p><small>updated <span id="updated">never</span></small></p>
<script>
function num(v, d){ return (v === null || v === undefined || v !== v) ? "" : Number(v).toFixed(d); }
function cell(tr, text, cls){ const td = document.createElement("td"); td.textContent = text;
  if (cls) td.className = cls; tr.appendChild(td); }
async function refresh(){
  try {
    const r = await fetch("__PREFIX__/cachescore/units.json", {cache: "no-store"});
    const b = await r.json();
    document.getElementById("run").textContent = b.run.run_id ? b.run.job + " · run " + b.run.run_id : "(no run yet)";
    document.getElementById("state").textContent = b.run.state || "-";
    document.getElementById("reason").textContent = b.run.reason || "";
    const counts = document.getElementById("counts"); counts.textContent = "";
    for (const [s, n] of Object.entries(b.counts || {})) { const sp = document.createElement("span");
      sp.className = s; sp.textContent = s + ": " + n; counts.appendChild(sp); }
    const body = document.querySelector("#units tbody"); body.textContent = "";
    for (const u of b.units) { const tr = document.createElement("tr"); tr.dataset.fingerprint = u.fingerprint;
      cell(tr, u.encoder); cell(tr, u.view); cell(tr, u.design); cell(tr, u.metric); cell(tr, u.state, u.state);
      cell(tr, num(u.seconds, 1), "num"); cell(tr, num(u.value, 4), "num"); cell(tr, num(u.recall, 3), "num");
      cell(tr, u.error || ""); body.appendChild(tr); }
    document.getElementById("updated").textContent = new Date().toLocaleTimeString();
  } catch (e) { document.getElementById("updated").textContent = "error: " + e; }
}
refresh(); setInterval(refresh, 1000);
</script></body></html>
"""


def _num(v, digits: int) -> str:
    return "" if v is None or v != v else f"{float(v):.{digits}f}"


def _row(u: dict) -> str:
    """The first render of one unit (the script redraws the table from the JSON afterwards)."""
    cells = [(u["encoder"], ""), (u["view"], ""), (u["design"], ""), (u["metric"], ""), (u["state"], u["state"]),
             (_num(u["seconds"], 1), "num"), (_num(u["value"], 4), "num"), (_num(u["recall"], 3), "num"),
             (u["error"] or "", "")]
    return "<tr>" + "".join(f'<td class="{c}">{html.escape(str(t))}</td>' for t, c in cells) + "</tr>"


def _run_title(run: dict) -> str:
    return html.escape(f"{run.get('job')} · run {run['run_id']}") if run.get("run_id") else "(no run yet)"


def _prefix(server) -> str:
    prefix = getattr(server, "http_prefix", None) or ""
    return "/" + prefix.strip("/") if prefix.strip("/") else ""


def current_board(scheduler):
    """The run board of ``scheduler``'s ``cachescore`` plugin, or None (no run registered it)."""
    plugin = getattr(scheduler, "plugins", {}).get("cachescore")
    return None if plugin is None else plugin.board


class StatusPageHandler(RequestHandler):
    """``GET /cachescore``: the HTML page."""

    def get(self):
        board = current_board(self.server)
        snap = board.snapshot() if board is not None else {"run": {}, "units": []}
        self.set_header("Content-Type", "text/html; charset=utf-8")
        self.set_header("Cache-Control", "no-store")
        self.write(_PAGE.replace("__PREFIX__", _prefix(self.server)).replace("__RUN__", _run_title(snap["run"]))
                   .replace("__ROWS__", "".join(_row(u) for u in snap["units"])))


class UnitsJsonHandler(RequestHandler):
    """``GET /cachescore/units.json``: the board's snapshot as JSON."""

    def get(self):
        board = current_board(self.server)
        snap = board.snapshot() if board is not None else {"run": {}, "units": [], "counts": {}}
        self.set_header("Content-Type", "application/json")
        self.set_header("Cache-Control", "no-store")
        self.write(json.dumps(json_safe(snap), default=str))


def add_routes(scheduler) -> bool:
    """Add the page's routes to ``scheduler``'s HTTP server once; False when it has none."""
    app = getattr(scheduler, "http_application", None)
    if app is None:
        return False
    if not getattr(scheduler, "_cachescore_routes", False):
        prefix = _prefix(scheduler)
        app.add_handlers(r".*$", [(prefix + PAGE_PATH + r"/units\.json", UnitsJsonHandler, {"dask_server": scheduler}),
                                  (prefix + PAGE_PATH + r"/?", StatusPageHandler, {"dask_server": scheduler})])
        scheduler._cachescore_routes = True
    return True
