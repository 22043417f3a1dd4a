"""Every README recipe runs as written against the demo store (issue 24): the Python blocks that
read ``results/demo/scores.parquet``, the SQL block (through duckdb, as it says), and the metric
API block on the demo cache's view. The probe API block needs a PathoROB-sized cohort (camelyon:
16+ slides of 300 tiles per cell) and is exercised by ``tests/test_probe_sweep_parity.py``
instead; shell blocks are the CLI, which ``tests/test_cli.py`` runs."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from cachescore.cache import Cache

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```(\w*)\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)


def _store_blocks(lang: str) -> list[str]:
    return [body for kind, body in BLOCKS if kind == lang and "results/demo/scores.parquet" in body]


def _run_last_expression(code: str, scope: dict):
    """Run ``code`` and return the value of its last expression (statements split on newlines
    and semicolons, as a notebook cell would show it)."""
    statements = [s for line in code.strip().splitlines() for s in line.split(";") if s.strip()]
    exec("\n".join(s.strip() for s in statements[:-1]) + f"\n_result = {statements[-1].strip()}", scope)
    return scope["_result"]


def test_the_readme_has_the_recipes_this_file_runs():
    kinds = [kind for kind, _ in BLOCKS]
    assert len(_store_blocks("python")) == 2 and len(_store_blocks("sql")) == 1
    assert kinds.count("python") == 4 and kinds.count("sql") == 1  # a new block gets a test here too


def test_every_python_recipe_on_the_store_runs_as_written(demo):
    for code in _store_blocks("python"):
        code = code.replace("results/demo/scores.parquet", str(demo.store / "scores.parquet"))
        out = _run_last_expression(code, {})
        assert len(out) > 0 and "encoder" in (list(out.columns) + list(out.index.names))


def test_the_sql_recipe_runs_in_duckdb(demo):
    duckdb = pytest.importorskip("duckdb", reason="pip install duckdb (in the test extra) runs the README's SQL")
    [query] = _store_blocks("sql")
    rows = duckdb.sql(query.replace("results/demo/scores.parquet", str(demo.store / "scores.parquet"))).fetchall()
    assert rows and all(r[-1] is not None for r in rows)  # only defined, hence ranked, scores


def test_the_metric_api_block_runs_on_the_demo_view(demo):
    [code] = [body for kind, body in BLOCKS if kind == "python" and "RI.compute(" in body]
    cache = Cache(demo.cache)
    manifest = cache.read_view("centre_all").rename(columns={"centre": "center"})
    features = cache.load_rows("enc0", cache.view_spec("centre_all").tileset, manifest["row"].to_numpy(np.int64))
    scope = {"features": features, "manifest": manifest.drop(columns="row")}
    exec(code, scope)
    assert 0.5 < scope["ri"].value <= 1.0 and np.isfinite(scope["croma"].value)
