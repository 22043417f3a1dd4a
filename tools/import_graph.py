"""The package import graph of ``src/cachescore``: circles, upward arrows, private names, lines.

    python tools/import_graph.py            # report
    python tools/import_graph.py --check    # exit 1 if a layering rule is broken

A *package* is a first-level sub-package of ``cachescore`` (``cache``, ``metrics``, ...); a
top-level module (``cli``, ``report``, ``types``, ...) is its own package; ``cachescore/__init__``
is ``<root>``. Every ``import`` / ``from ... import`` in the source is read with :mod:`ast`
(relative imports resolved); ``local`` counts imports inside a function body.

Rules checked by ``--check`` (and by ``tests/test_layout.py``):

- no circle between packages, and none between the modules of one package (module-level,
  ``TYPE_CHECKING`` and function-level imports together);
- no package imports a private name (``_x``, or a private module ``_x``) of another package;
  ``cachescore._version``, ``_finite`` and the other ``cachescore._*`` shared helpers are exempt
  as modules, their members must still be public;
- no package imports ``<root>`` (``from cachescore import ...`` / ``from .. import ...``);
- ``jobs`` imports nothing from ``pipeline``;
- every function-local import names a module in :data:`DEFERRED` (heavy imports deferred on
  purpose) and carries a comment on its line or the line above saying so.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "cachescore"

#: Modules that may be imported inside a function: heavy or optional, deferred on purpose.
DEFERRED = ("numba", "pynndescent", "bokeh", "h5py", "croma", "torch", "matplotlib",
            "distributed.diagnostics", "dask_jobqueue", "dask_kubernetes", "kubernetes",
            # imported where used so that every command starts at once (issue 25): scipy (the
            # bootstrap's Spearman), dask.array (lazy cache embeddings), and the CLI's heavy commands
            "scipy", "sklearn", "dask.array", "dask.base", "dask.highlevelgraph",
            "cachescore.report", "cachescore.pipeline.run", "cachescore.pipeline.watch",
            # the out-of-core reductions (distributed, pyarrow), loaded when a large unit is scored
            "cachescore.metrics.large",
            # a cache at a URL (issue 27): pathlib over fsspec and the file systems, only for a
            # remote cache (the job schema parses a URL without loading the cache package
            # otherwise); Zarr only for Zarr shards
            "upath", "fsspec", "zarr", "cachescore.cache.location")

#: Layer order, lowest first: a package may import only packages at its own level or below.
LAYERS = [
    {"_version", "_finite", "_jsonsafe", "_hashing", "_threads", "_taskkeys", "_warncapture", "_keys", "_atomic", "_missing", "_futures", "types",
     "errors"},
    {"fingerprint", "manifest"},
    {"store", "alignment"},
    {"cache"},
    {"neighbors"},
    {"metrics"},
    {"probe", "downstream"},
    {"jobs", "results", "monitoring"},
    {"pipeline"},
    {"report", "report_figures"},
    {"cli", "<root>"},
]


def _package(module: str) -> str:
    parts = module.split(".")
    if parts[0] != "cachescore":
        return ""
    if len(parts) == 1:
        return "<root>"
    return parts[1]


def _module_name(path: Path, src: Path = SRC) -> str:
    rel = path.relative_to(src.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _resolve(module: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    if not is_pkg:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def scan(src: Path = SRC):
    """Yield (module, line, target module, imported names, local?, source line, line above)."""
    for path in sorted(src.rglob("*.py")):
        module = _module_name(path, src)
        text = path.read_text()
        lines = text.splitlines()
        tree = ast.parse(text)
        is_pkg = path.name == "__init__.py"
        func_lines = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for sub in ast.walk(node):
                    if isinstance(sub, (ast.Import, ast.ImportFrom)):
                        func_lines.add(sub.lineno)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [(a.name, []) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                targets = [(_resolve(module, is_pkg, node), [a.name for a in node.names])]
            else:
                continue
            local = node.lineno in func_lines
            src_line = lines[node.lineno - 1]
            above = lines[node.lineno - 2] if node.lineno >= 2 else ""
            for target, names in targets:
                yield module, node.lineno, target, names, local, src_line, above, path


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def analyse(src: Path = SRC) -> dict:
    edges = defaultdict(set)          # package -> packages it imports
    mod_edges = defaultdict(set)      # module -> modules it imports (within cachescore)
    modules = {_module_name(p, src) for p in src.rglob("*.py")}
    violations = []
    local_imports = 0
    for module, line, target, names, local, src_line, above, path in scan(src):
        where = f"{path.relative_to(src.parent)}:{line}"
        if local:
            local_imports += 1
            if not any(target == d or target.startswith(d + ".") for d in DEFERRED):
                violations.append(f"{where}: function-local import of {target} (not a deferred heavy import)")
            elif "#" not in src_line and not above.strip().startswith("#"):
                violations.append(f"{where}: deferred import of {target} without a comment saying why")
        a, b = _package(module), _package(target)
        if not b:
            continue
        for t in [target] + [f"{target}.{n}" for n in names]:
            if t in modules and t != module:
                mod_edges[module].add(t)
        # `from cachescore import x` names a sub-module (or a root re-export).
        if b == "<root>" and names:
            subs = {n for n in names if (src / n).is_dir() or (src / f"{n}.py").exists()}
            if subs and len(subs) == len(names):
                for n in subs:
                    if n != a:
                        edges[a].add(n)
                continue
        if a == b:
            continue
        edges[a].add(b)
        if b == "<root>":
            violations.append(f"{where}: {a} imports the package root")
        if a == "jobs" and b == "pipeline":
            violations.append(f"{where}: jobs imports pipeline")
        tail = target.split(".")[2:]
        if any(_is_private(p) for p in tail):
            violations.append(f"{where}: {a} imports private module {target}")
        for n in names:
            if _is_private(n):
                violations.append(f"{where}: {a} imports private name {target}.{n}")
    circles = _circles(edges)
    for c in circles:
        violations.append("circle: " + " -> ".join(c + [c[0]]))
    # a package's __init__ importing its own modules is not a circle of theirs
    inner = {m: {t for t in ts if not (t == m.rsplit(".", 1)[0])} for m, ts in mod_edges.items()}
    module_circles = _circles(inner)
    for c in module_circles:
        violations.append("module circle: " + " -> ".join(c + [c[0]]))
    level = {p: i for i, layer in enumerate(LAYERS) for p in layer}
    upward = sorted((a, b) for a, bs in edges.items() for b in bs
                    if a in level and b in level and level[b] > level[a])
    for a, b in upward:
        violations.append(f"upward arrow: {a} -> {b}")
    sizes = defaultdict(int)
    for path in src.rglob("*.py"):
        sizes[_package(_module_name(path, src))] += len(path.read_text().splitlines())
    return {"edges": {k: sorted(v) for k, v in sorted(edges.items())}, "circles": circles,
            "module_circles": module_circles,
            "upward": upward, "violations": violations, "local_imports": local_imports,
            "lines": dict(sorted(sizes.items()))}


def _circles(edges) -> list[list[str]]:
    """Strongly connected components of more than one package (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(set(edges) | {w for ws in edges.values() for w in ws}):
        if v not in index:
            visit(v)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="cachescore package import graph")
    ap.add_argument("--check", action="store_true", help="exit 1 if a layering rule is broken")
    args = ap.parse_args(argv)
    r = analyse()
    print("package edges:")
    for a, bs in r["edges"].items():
        print(f"  {a:12s} -> {', '.join(bs)}")
    print(f"circles: {r['circles'] or 'none'}")
    print(f"module circles: {r['module_circles'] or 'none'}")
    print(f"upward arrows: {r['upward'] or 'none'}")
    print(f"function-local imports: {r['local_imports']}")
    print("lines per package: " + ", ".join(f"{k} {v}" for k, v in r["lines"].items()))
    print(f"violations: {len(r['violations'])}")
    for v in r["violations"]:
        print("  " + v)
    return 1 if (args.check and r["violations"]) else 0


if __name__ == "__main__":
    sys.exit(main())
