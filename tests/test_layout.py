"""Pins the package layout (ADR-0008): the import rules of ``tools/import_graph.py --check``.

No circle between packages or between the modules of a package; no package imports another's
private names or the package root; ``jobs`` imports nothing from ``pipeline``; the only
function-local imports defer a heavy or optional import and say so; ``pipeline`` holds no search
engine (nothing in it submits a neighbour search of its own: the engines live in ``neighbors``).
"""

from __future__ import annotations

import importlib.util
import re
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


def _classes_and_imports(path: Path):
    import ast

    tree = ast.parse(path.read_text())
    classes = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
    imported = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    return classes, imported


#: The neighbour kernels: only engines (in ``neighbors``) and the metrics call them.
_KERNELS = ("neighbors.exact", "neighbors.typed", "neighbors.ann", "neighbors.blocked", "neighbors.partition",
            "neighbors.exact_search")


def test_pipeline_holds_no_engine():
    """A rule, not a file list: no module of ``pipeline/`` defines a class with the engine methods
    (``cross`` and ``typed``) or imports a neighbour kernel; engines come from ``neighbors``
    (registry, out-of-core engine)."""
    pipeline = ROOT / "src" / "cachescore" / "pipeline"
    for path in sorted(pipeline.glob("*.py")):
        classes, imported = _classes_and_imports(path)
        for c in classes:
            methods = {f.name for f in c.body if hasattr(f, "name")}
            assert not {"cross", "typed"} <= methods, f"{path.name}: class {c.name} is a neighbour engine"
        kernels = [m for m in imported if m.lstrip(".").endswith(_KERNELS)]
        assert not kernels, f"{path.name} imports neighbour kernels {kernels}"


#: A family name compared (``== "croma"``, ``in ("ri", "mari")``) or compared against.
_FAMILY_COMPARISON = re.compile(
    r"""(==|!=|\bin\b)\s*\(?\s*['"](ri|mari|croma|apd|nipd)['"]|['"](ri|mari|croma|apd|nipd)['"]\s*(==|!=)""")


def test_family_names_are_not_compared_outside_the_table():
    """Issue 23: no module outside ``metrics/`` compares or dispatches on a metric-family name."""
    pattern = _FAMILY_COMPARISON
    hits = []
    for path in (ROOT / "src" / "cachescore").rglob("*.py"):
        if "metrics" in path.relative_to(ROOT / "src" / "cachescore").parts:
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line):
                hits.append(f"{path.name}:{i}: {line.strip()}")
    assert hits == []


def test_the_family_rule_sees_a_comparison(tmp_path):
    pattern = _FAMILY_COMPARISON
    assert pattern.search('if metric == "croma":') and pattern.search("x in ('ri', 'mari')")
    assert not pattern.search('"families": ["ri"]') and not pattern.search("__all__ = ['apd']")


SRC = ROOT / "src" / "cachescore"
#: Issue 23's size rules: the god-module stays split, pipeline functions stay readable.
_EXECUTE_MAX_LINES = 300
_PIPELINE_MAX_FUNCTION_LINES = 60
_PIPELINE_MAX_COMPLEXITY = 15
_SRC_MAX_COMPLEXITY = 30


def _measure(text: str):
    """``(name, lines, cyclomatic complexity)`` of every function and method in ``text`` (radon)."""
    from radon.complexity import cc_visit

    for b in cc_visit(text):  # functions, classes and (again, flat) their methods
        if b.letter in ("F", "M"):
            yield b.name, b.endline - b.lineno + 1, b.complexity


def test_size_rules_hold():
    """``pipeline/execute.py`` ≤ 300 lines; no ``pipeline/`` function longer than 60 lines or of
    cyclomatic complexity above 15; no function in ``src/`` above 30 (radon)."""
    assert len((SRC / "pipeline" / "execute.py").read_text().splitlines()) <= _EXECUTE_MAX_LINES
    long, complex_pipeline, complex_src = [], [], []
    for path in sorted(SRC.rglob("*.py")):
        in_pipeline = path.parent.name == "pipeline"
        for name, lines, cc in _measure(path.read_text()):
            where = f"{path.relative_to(SRC)}:{name}"
            if in_pipeline and lines > _PIPELINE_MAX_FUNCTION_LINES:
                long.append((where, lines))
            if in_pipeline and cc > _PIPELINE_MAX_COMPLEXITY:
                complex_pipeline.append((where, cc))
            if cc > _SRC_MAX_COMPLEXITY:
                complex_src.append((where, cc))
    assert long == [] and complex_pipeline == [] and complex_src == []


def test_the_size_rules_see_a_long_complex_method():
    body = "".join(f"        if x == {i}:\n            return {i}\n" for i in range(40))
    [(name, lines, cc)] = list(_measure("class C:\n    def f(self, x):\n" + body))
    assert name == "f" and lines > _PIPELINE_MAX_FUNCTION_LINES and cc > _SRC_MAX_COMPLEXITY
