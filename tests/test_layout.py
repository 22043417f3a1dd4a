"""Pins the package layout (ADR-0008): the import rules of ``tools/import_graph.py --check``.

No circle between packages or between the modules of a package; no package imports another's
private names or the package root; ``jobs`` imports nothing from ``pipeline``; the only
function-local imports defer a heavy or optional import and say so; ``pipeline`` holds no search
engine (nothing in it submits a neighbour search of its own: the engines live in ``neighbors``).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _tool():
    spec = importlib.util.spec_from_file_location("import_graph", ROOT / "tools" / "import_graph.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["import_graph"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_the_import_rules_hold():
    report = _tool().analyse()
    assert report["violations"] == []
    assert report["circles"] == [] and report["module_circles"] == [] and report["upward"] == []


def test_jobs_does_not_know_the_runner():
    edges = _tool().analyse()["edges"]
    assert "pipeline" not in edges.get("jobs", [])
    assert "pipeline" not in edges.get("probe", []) and "pipeline" not in edges.get("neighbors", [])


def test_the_checker_sees_a_circle_and_a_private_import(tmp_path):
    """The rules are not vacuous: a tree with a circle, a private import and an undocumented local
    import is reported."""
    pkg = tmp_path / "cachescore"
    (pkg / "a").mkdir(parents=True)
    (pkg / "b").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a" / "__init__.py").write_text("from ..b.x import _hidden\n")
    (pkg / "b" / "__init__.py").write_text("")
    (pkg / "b" / "x.py").write_text("_hidden = 1\n\ndef f():\n    from ..a import y\n")
    (pkg / "a" / "y.py").write_text("")
    v = "\n".join(_tool().analyse(pkg)["violations"])
    assert "private name cachescore.b.x._hidden" in v
    assert "circle: a -> b -> a" in v
    assert "function-local import of cachescore.a" in v


def test_pipeline_holds_no_engine():
    pipeline = ROOT / "src" / "cachescore" / "pipeline"
    names = sorted(p.name for p in pipeline.glob("*.py"))
    assert names == ["__init__.py", "cluster.py", "execute.py", "interrupts.py", "plan.py", "probe_unit.py", "prune.py", "status.py",
                     "unit.py", "validate.py", "watch.py"]
