"""Leakage audit of a probe sweep's realised splits.

Spec: ``spec/evaluation.md`` C.3 (rules and their stable critical names), B.2 (severity), Part D.

For every (replicate, split) outcome the audit checks, over the roles ``train``, ``val`` and
``in_domain`` (the sweep's own test rows):

* ``row``: a row index in two roles -- refused at once (LeakageError, whatever ``raise_on_leakage``
  says), like spacr's "index in train and validation".
* ``tile``: a tile key (row identity, e.g. ``sample_id``, or a composite key given as a tuple of
  arrays, so equal tile ids in different slides are different tiles) in two roles.
* ``<level>``: a protected group id (slide / case / patient, names configurable) in two roles.
  Identity levels coarser than the protected one (``protected_level``, default the coarsest of
  patient > case > slide present; :data:`IDENTITY_LEVELS`) are audited too but only warned
  about, with counts and examples (rule 5: a slide-level plan that leaks patients is visible,
  never hidden); they are listed in ``report["coarser_overlaps"]``.
* ``ood_centre``: a confounder of an unseen-confounder test set that appears among the train,
  val or in-domain test rows of the outcome (codes must share the ``confounders`` id space).
* ``group_spans_ood`` (rule 7): a protected group with rows among the in-domain rows and in an
  unseen-confounder test set (one with ``test_set_confounders`` and group ids), whatever the
  plan; a group spanning several centres of the in-domain rows is only a warning.
* ``<level>`` / ``tile`` against each extra test set: a group (or tile) of the test set that also
  appears in train, val or in-domain test.
* ``missing_class:<role>`` (rule 9): a role lacking a class of the task (critical by default;
  ``require_class_coverage=False`` is the explicit, recorded relaxation).
* ``id_centre_unseen`` (rule 6): an in-domain test centre absent from train (critical by
  default; ``require_seen_id_centres=False`` relaxes it, recorded).

Across the sweep: ``test_set_drift`` (in-domain test membership differs between splits of one
replicate), ``replicate_seeds`` (a replicate with two seeds, or two replicates sharing one) and
``conflicting_labels`` (one tile key carrying two classes; several classes in one slide are fine).

Identity values must be present: a missing (None/NaN) or blank id is refused with ``ValueError``
naming the level and the rows (spec rule 10, require_identity on). Every check is vectorised
(factorised integer codes, boolean presence vectors per role); there is no per-row Python loop.

:func:`audit_content` (rule 3) finds byte-identical embedding rows (in the fixed
:data:`CONTENT_DTYPE`, little-endian float64) in two roles of any (replicate, split), test sets
included: critical ``content`` by default, a recorded warning only with ``severity="warning"``.
:func:`combine_leakage` merges the plan audit and the content audit into a bundle's leakage
record (``passed`` None plus ``not_audited`` when either did not run).

The report is a JSON-serialisable dict; ``passed`` is ``True`` only when at least one outcome was
audited and nothing critical was found -- never vacuously.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from .._jsonsafe import json_safe


def _id(v: Any) -> Any:
    """A JSON-safe identity value (numpy scalar -> Python, tuple -> list; NaN kept)."""
    return json_safe(v, nonfinite="keep")

__all__ = [
    "AUDIT_SCHEMA_VERSION",
    "CONTENT_DTYPE",
    "LeakageError",
    "audit_content",
    "audit_cv_folds",
    "audit_sweep",
    "combine_leakage",
]

#: Version of the audit report layout (``report["schema_version"]``).
AUDIT_SCHEMA_VERSION = 1

#: Role names of a sweep outcome's row sets, in report order.
ROLES = ("train", "val", "in_domain")

#: How many example ids / rows a breach lists; counts are always exact.
MAX_EXAMPLE_IDS = 10
MAX_EXAMPLE_ROWS = 20

#: Identity levels from fine to coarse (spec C.3 rule 5). Levels with other names are always
#: protected (critical).
IDENTITY_LEVELS = ("slide", "case", "patient")

_RESERVED_LEVELS = frozenset({"row", "tile", "ood_centre", "test_set_drift", "replicate_seeds",
                              "conflicting_labels"})


class LeakageError(ValueError):
    """A realised split leaks identities between roles.

    ``breaches`` holds one dict per breach: ``level`` (the critical name), ``replicate``,
    ``split``, ``roles``, ``n_ids``, ``ids`` (first 10), ``n_rows``, ``rows`` (first 20).
    ``report`` holds the full audit report when one was built.
    """

    def __init__(self, message: str, breaches: list[dict], report: dict | None = None):
        super().__init__(message)
        self.breaches = breaches
        self.report = report


# ---------------------------------------------------------------------------------------------
# identities


@dataclass(frozen=True)
class _Level:
    name: str
    codes: np.ndarray  # int64 (n_total,), codes over the in-domain rows then each test set
    uniques: Sequence  # JSON-safe id per code (a _Uniques: formatted on access)
    n_groups: int


def _check_ids(values, n: int, *, level: str, where: str) -> np.ndarray:
    arr = np.asarray(values, dtype=object) if not isinstance(values, np.ndarray) else values
    if arr.ndim != 1 or arr.shape[0] != n:
        raise ValueError(
            f"{where}: identity '{level}' must be a 1-D array with one id per row ({n}), "
            f"got shape {np.shape(values)}"
        )
    ser = pd.Series(arr, copy=False)
    missing = np.array(ser.isna().to_numpy(), dtype=bool)
    if ser.dtype == object or pd.api.types.is_string_dtype(ser.dtype):
        blank = ser.astype("string").str.strip().eq("").fillna(True).to_numpy(dtype=bool)
        missing = missing | blank
    if missing.any():
        rows = np.flatnonzero(missing)
        raise ValueError(
            f"{where}: identity '{level}' is missing or blank at rows {rows[:MAX_EXAMPLE_ROWS].tolist()}"
            f" ({rows.size} in all); every row needs a verifiable {level} id "
            f"(unverifiable_{level})"
        )
    return arr


class _Uniques(Sequence):
    """The JSON-safe id of each code of a level, formatted on access.

    Reports only ever show a few ids (:data:`MAX_EXAMPLE_IDS` per breach), so ids are not
    materialised as Python objects for all codes up front (a 1M-row composite key would cost
    seconds): ``uniques[c]`` is ``_id(value)`` for a single key, ``[_id(v0), _id(v1), ...]`` for
    a composite key, exactly what an eagerly built list would hold.

    ``components``: one array of distinct values per key part; ``rows``: (n_codes, n_parts) int64
    indices into them (code ``c`` is the tuple ``components[j][rows[c, j]]``), or None for a
    single key (code ``c`` is ``components[0][c]``).
    """

    def __init__(self, components: list, rows: np.ndarray | None):
        self._components = components
        self._rows = rows

    def __len__(self) -> int:
        return int(self._rows.shape[0]) if self._rows is not None else len(self._components[0])

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i = int(i)
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"code {i} out of range ({len(self)} ids)")
        if self._rows is None:
            return _id(self._components[0][i])
        return [_id(comp[r]) for comp, r in zip(self._components, self._rows[i].tolist())]


def _combined_codes(comp_codes: list[np.ndarray], sizes: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(np.stack(comp_codes, 1), axis=0, return_inverse=True)``, same order and codes.

    Lexicographic row order equals the order of the mixed-radix integer ``c0*n1*n2... + c1*n2...
    + ...`` (each ``c_j < n_j``), so when that integer fits in int64 one 1-D ``np.unique`` replaces
    the (slower) row-wise one; otherwise the row-wise one is used.
    """
    total = 1
    for n in sizes:
        total *= max(1, int(n))
    if total >= 2**62:
        uniq_rows, inv = np.unique(np.stack(comp_codes, axis=1), axis=0, return_inverse=True)
        return uniq_rows.astype(np.int64), inv.reshape(-1).astype(np.int64)
    key = np.zeros(comp_codes[0].shape[0], dtype=np.int64)
    for c, n in zip(comp_codes, sizes):
        key = key * max(1, int(n)) + c
    uniq, inv = np.unique(key, return_inverse=True)
    uniq_rows = np.empty((uniq.shape[0], len(sizes)), dtype=np.int64)
    rest = uniq
    for j in range(len(sizes) - 1, -1, -1):
        rest, uniq_rows[:, j] = np.divmod(rest, max(1, int(sizes[j])))
    return uniq_rows, inv.reshape(-1).astype(np.int64)


def _factorize_key(parts: Sequence[np.ndarray]) -> tuple[np.ndarray, _Uniques]:
    """Codes and (lazily formatted) JSON-safe uniques for a possibly composite key over rows.

    Single key: codes in order of first appearance. Composite key: codes in lexicographic order
    of the per-part first-appearance codes. No Python loop over rows or ids.
    """
    if len(parts) == 1:
        codes, uniques = pd.factorize(pd.Series(parts[0], copy=False), sort=False)
        return codes.astype(np.int64), _Uniques([np.asarray(uniques, dtype=object)], None)
    comp_codes = []
    comp_uniques = []
    for p in parts:
        c, u = pd.factorize(pd.Series(p, copy=False), sort=False)
        comp_codes.append(c.astype(np.int64))
        comp_uniques.append(np.asarray(u, dtype=object))
    uniq_rows, inv = _combined_codes(comp_codes, [len(u) for u in comp_uniques])
    return inv, _Uniques(comp_uniques, uniq_rows)


def _as_parts(key) -> list:
    if isinstance(key, (tuple, list)) and len(key) > 0 and np.ndim(key[0]) == 1:
        return list(key)
    return [key]


def _build_levels(
    n_rows: int,
    groups: Mapping[str, Any],
    tile_ids,
    test_sizes: Mapping[str, int],
    test_set_groups: Mapping[str, Mapping[str, Any]] | None,
) -> tuple[dict[str, _Level], dict[str, list[str]]]:
    """Factorise every level jointly over in-domain rows and the test sets that carry it."""
    levels: dict[str, _Level] = {}
    checked: dict[str, list[str]] = {name: [] for name in test_sizes}
    names = ["tile", *groups]
    for name in names:
        if name != "tile" and name in _RESERVED_LEVELS:
            raise ValueError(f"group level name '{name}' is reserved; choose another (e.g. 'slide')")
        key = tile_ids if name == "tile" else groups[name]
        parts = [
            _check_ids(p, n_rows, level=name, where="embeddings") for p in _as_parts(key)
        ]
        joined = [list(parts)]
        for ts, size in test_sizes.items():
            tg = (test_set_groups or {}).get(ts)
            if tg is None:
                continue
            if name not in tg:
                if name == "tile":
                    continue
                raise ValueError(
                    f"test set '{ts}': test_set_groups lacks the protected level '{name}' "
                    f"(unverifiable_{name}); give ids for every level in groups"
                )
            tparts = [_check_ids(p, size, level=name, where=f"test set '{ts}'") for p in _as_parts(tg[name])]
            if len(tparts) != len(parts):
                raise ValueError(
                    f"test set '{ts}': level '{name}' has a {len(tparts)}-part key, the embeddings a "
                    f"{len(parts)}-part key"
                )
            joined.append(tparts)
            checked[ts].append(name)
        if len(joined) == 1:
            concat = parts
        else:
            concat = [np.concatenate([np.asarray(j[c], dtype=object) for j in joined])
                      for c in range(len(parts))]
        codes, uniques = _factorize_key(concat)
        levels[name] = _Level(name, codes, uniques, len(uniques))
    return levels, checked


# ---------------------------------------------------------------------------------------------
# audit


def _presence(codes: np.ndarray, n_groups: int) -> np.ndarray:
    out = np.zeros(n_groups, dtype=bool)
    out[codes] = True
    return out


def _breach(level, replicate, split, roles, ids_mask, level_obj, rows, extra=None) -> dict:
    ids = np.flatnonzero(ids_mask)
    rows = np.unique(rows)
    d = {
        "level": level,
        "replicate": replicate,
        "split": split,
        "roles": list(roles),
        "n_ids": int(ids.size),
        "ids": [level_obj.uniques[i] for i in ids[:MAX_EXAMPLE_IDS]],
        "n_rows": int(rows.size),
        "rows": rows[:MAX_EXAMPLE_ROWS].tolist(),
    }
    if extra:
        d.update(extra)
    return d


def _protection(groups: Mapping[str, Any], protected_level: str | None) -> tuple[str | None, tuple[str, ...]]:
    """``(protected level, levels coarser than it)`` for rule 5 (see :func:`audit_sweep`); the
    coarser levels in :data:`IDENTITY_LEVELS` order, so the report's warnings come in an order that
    does not depend on the process (a set's order follows the string hash seed)."""
    known = [lv for lv in IDENTITY_LEVELS if lv in groups]
    if protected_level is None:
        return (known[-1] if known else None), ()
    if protected_level not in groups:
        raise ValueError(f"protected_level {protected_level!r} is not among the group levels {sorted(groups)}")
    if protected_level not in IDENTITY_LEVELS:
        return protected_level, ()
    rank = IDENTITY_LEVELS.index(protected_level)
    return protected_level, tuple(lv for lv in known if IDENTITY_LEVELS.index(lv) > rank)


def _check_rows(rows, n_rows: int, *, role: str, replicate, split) -> np.ndarray:
    r = np.asarray(rows)
    if r.ndim != 1 or (r.size and not np.issubdtype(r.dtype, np.integer)):
        raise ValueError(
            f"replicate {replicate}, split {split}: {role} rows must be a 1-D integer index array, "
            f"got shape {r.shape} dtype {r.dtype}"
        )
    r = r.astype(np.int64, copy=False)
    bad = np.flatnonzero((r < 0) | (r >= n_rows))
    if bad.size:
        raise ValueError(
            f"replicate {replicate}, split {split}: {role} rows {r[bad[:MAX_EXAMPLE_ROWS]].tolist()} "
            f"lie outside the {n_rows} embedding rows"
        )
    return r


def _format_breach(b: dict) -> str:
    where = f"replicate {b['replicate']}, split {b['split']}: " if b.get("replicate") is not None else ""
    roles = " / ".join(b["roles"])
    return (
        f"{where}{b['level']} leaks across {roles}: {b['n_ids']} id(s) {b['ids']}"
        f"{' ...' if b['n_ids'] > len(b['ids']) else ''} at {b['n_rows']} row(s) {b['rows']}"
        f"{' ...' if b['n_rows'] > len(b['rows']) else ''}"
    )


def _error_message(breaches: list[dict]) -> str:
    levels = sorted({b["level"] for b in breaches})
    head = f"leakage audit failed ({len(breaches)} breach(es); critical levels: {', '.join(levels)})"
    lines = [_format_breach(b) for b in breaches[:10]]
    more = [f"... and {len(breaches) - 10} more"] if len(breaches) > 10 else []
    fix = ("fix: keep every protected group and tile inside one role (split by group, duplicate "
           "or resample rows only inside a role)")
    return "\n".join([head, *lines, *more, fix])


@dataclass
class _SweepFacts:
    """The validated inputs of one :func:`audit_sweep` call, computed once and read by every rule."""

    n_rows: int
    groups: Mapping[str, Any]
    levels: dict  # name -> _Level over the in-domain rows then each group-audited test set
    ts_levels: dict  # test set -> levels checked for it
    offsets: dict  # test set -> first code position in the joint level codes
    test_set_sizes: dict
    test_set_confounders: Mapping[str, Any] | None
    protected_level: str | None
    coarser: tuple  # levels coarser than the protected one, fine to coarse
    require_class_coverage: bool
    require_seen_id_centres: bool
    lab_codes: np.ndarray | None = None  # labels given: factorised class code per row
    task_classes: np.ndarray | None = None
    task_class_values: list | None = None
    conf_level: _Level | None = None  # test-set confounders given: joint confounder coding
    conf_off: dict | None = None  # test set -> (start, stop) in conf_level.codes
    conf_codes: np.ndarray | None = None  # confounders given: code per in-domain row
    conf_uniques: list | None = None


@dataclass
class _Findings:
    """What the rules found: critical breaches, rule-5 overlaps, warnings, rule-7 spans, and the
    per-replicate state of rules 11 and 12."""

    breaches: list = field(default_factory=list)
    coarse_found: list = field(default_factory=list)
    warnings: list = field(default_factory=list)
    spans: dict = field(default_factory=dict)
    seeds_by_rep: dict = field(default_factory=dict)
    test_ref: dict = field(default_factory=dict)


@dataclass
class _Outcome:
    """One (replicate, split) outcome with its checked row sets and its per-outcome report entry."""

    replicate: Any
    split: Any
    rows: dict  # role -> int64 row indices
    entry: dict  # the outcome's ``per_outcome`` report entry, filled by the rules


def _facts(outcomes, *, n_rows, groups, tile_ids, labels, confounders, test_set_sizes, test_set_groups,
           test_set_confounders, require_class_coverage, require_seen_id_centres, protected_level) -> _SweepFacts:
    """Validate :func:`audit_sweep`'s inputs (messages name the argument and the rows) and code them."""
    if not outcomes:
        raise ValueError("no sweep outcomes to audit; an empty audit never passes")
    n_rows = int(n_rows)
    if not isinstance(groups, Mapping) or not groups:
        raise ValueError("groups must map at least one protected level name (e.g. 'slide') to ids")
    test_set_sizes = dict(test_set_sizes or {})
    for extra, what in ((test_set_groups, "test_set_groups"), (test_set_confounders, "test_set_confounders")):
        unknown = sorted(set(extra or {}) - set(test_set_sizes))
        if unknown:
            raise ValueError(f"{what} names test set(s) {unknown} that are not among {sorted(test_set_sizes)}")
    protected_level, coarser = _protection(groups, protected_level)
    levels, ts_levels = _build_levels(n_rows, groups, tile_ids, test_set_sizes, test_set_groups)
    offsets: dict[str, int] = {}  # offsets of each test set in the jointly factorised code arrays
    off = n_rows
    for ts, size in test_set_sizes.items():
        if (test_set_groups or {}).get(ts) is not None:
            offsets[ts] = off
            off += size
    f = _SweepFacts(n_rows=n_rows, groups=groups, levels=levels, ts_levels=ts_levels, offsets=offsets,
                    test_set_sizes=test_set_sizes, test_set_confounders=test_set_confounders,
                    protected_level=protected_level, coarser=coarser,
                    require_class_coverage=require_class_coverage, require_seen_id_centres=require_seen_id_centres)
    if labels is not None:
        lab = np.asarray(labels)
        if lab.shape != (n_rows,):
            raise ValueError(f"labels must have shape ({n_rows},), got {lab.shape}")
        lab_codes, lab_uniques = pd.factorize(pd.Series(lab), sort=True)
        f.lab_codes, f.task_classes = lab_codes, np.arange(len(lab_uniques))
        f.task_class_values = [_id(u) for u in lab_uniques]
    if test_set_confounders:
        if confounders is None:
            raise ValueError("test_set_confounders needs the in-domain confounders to compare against")
        conf = pd.Series(np.asarray(confounders))
        if conf.shape != (n_rows,):
            raise ValueError(f"confounders must have shape ({n_rows},), got {conf.shape}")
        ts_conf_codes = {}
        for ts, vals in test_set_confounders.items():
            v = np.asarray(vals)
            if v.shape != (test_set_sizes[ts],):
                raise ValueError(
                    f"test set '{ts}': confounders must have one entry per row ({test_set_sizes[ts]}), "
                    f"got shape {v.shape}"
                )
            ts_conf_codes[ts] = v
        all_conf = np.concatenate([conf.to_numpy(dtype=object)] +
                                  [np.asarray(v, dtype=object) for v in ts_conf_codes.values()])
        cc, cu = pd.factorize(pd.Series(all_conf))  # joint coding of confounder values
        f.conf_level = _Level("ood_centre", cc.astype(np.int64), [_id(u) for u in cu], len(cu))
        f.conf_off, o = {}, n_rows
        for ts, v in ts_conf_codes.items():
            f.conf_off[ts] = (o, o + v.shape[0])
            o += v.shape[0]
    if confounders is not None:
        cv = np.asarray(confounders)
        if cv.shape != (n_rows,):
            raise ValueError(f"confounders must have shape ({n_rows},), got {cv.shape}")
        codes, uniques = pd.factorize(pd.Series(cv, copy=False), sort=True)
        f.conf_codes, f.conf_uniques = codes.astype(np.int64), [_id(u) for u in uniques]
    return f


def _outcome(oc, f: _SweepFacts, found: _Findings) -> _Outcome:
    """The outcome's row sets, checked (1-D integer indices inside the embedding rows)."""
    r, s = _id(oc.replicate), _id(oc.split)
    rows = {
        "train": _check_rows(oc.train_rows, f.n_rows, role="train", replicate=r, split=s),
        "val": _check_rows(oc.val_rows, f.n_rows, role="val", replicate=r, split=s),
        "in_domain": _check_rows(oc.test_rows, f.n_rows, role="in_domain", replicate=r, split=s),
    }
    found.seeds_by_rep.setdefault(r, set()).add(_id(getattr(oc, "seed", None)))
    entry = {"replicate": r, "split": s, "seed": _id(getattr(oc, "seed", None)),
             "n_train": int(rows["train"].size), "n_val": int(rows["val"].size),
             "n_in_domain": int(rows["in_domain"].size), "overlap_counts": {},
             "duplicate_tiles_within_role": {}, "missing_classes": {}}
    return _Outcome(replicate=r, split=s, rows=rows, entry=entry)


# ----------------------------------------------------------------------------- sweep-wide rules


def _rule_conflicting_labels(f: _SweepFacts, found: _Findings) -> None:
    """Rule 4: one tile key carries two classes among the in-domain rows (critical)."""
    tile = f.levels["tile"]
    tcodes = tile.codes[: f.n_rows]
    pairs = np.unique(np.stack([tcodes, f.lab_codes], axis=1), axis=0)
    multi = np.bincount(pairs[:, 0], minlength=tile.n_groups) > 1
    if multi.any():
        rows = np.flatnonzero(multi[tcodes])
        found.breaches.append(_breach("conflicting_labels", None, None, ("labels",), multi, tile, rows))


def _rule_unaudited_test_sets(f: _SweepFacts, found: _Findings) -> None:
    """A test set given without group ids is recorded as not group-audited (warning)."""
    for ts in f.test_set_sizes:
        if ts not in f.offsets:
            found.warnings.append(f"test set '{ts}': no group ids given, so its groups were not audited")


def _rule_groups_spanning_centres(f: _SweepFacts, found: _Findings) -> None:
    """Rule 7, warning part: a protected group whose in-domain rows span several centres."""
    for name in f.groups:
        lvl = f.levels[name]
        pairs = np.unique(np.stack([lvl.codes[: f.n_rows], f.conf_codes], axis=1), axis=0)
        multi = np.flatnonzero(np.bincount(pairs[:, 0], minlength=lvl.n_groups) > 1)
        if multi.size:
            found.spans[name] = {"n_groups": int(multi.size),
                                 "examples": [lvl.uniques[i] for i in multi[:MAX_EXAMPLE_IDS]]}
            found.warnings.append(f"{multi.size} {name}(s) span more than one centre, e.g. "
                                  f"{found.spans[name]['examples']}")


def _rule_group_spans_ood(f: _SweepFacts, found: _Findings) -> None:
    """Rule 7, critical part: a protected group with rows among the in-domain rows and in an
    unseen-confounder test set (whatever the plan does with them)."""
    for name in f.groups:
        if name in f.coarser:
            continue
        lvl = f.levels[name]
        id_groups = _presence(lvl.codes[: f.n_rows], lvl.n_groups)
        for ts, o in f.offsets.items():
            if ts not in f.test_set_confounders or name not in f.ts_levels[ts]:
                continue
            tcodes = lvl.codes[o:o + f.test_set_sizes[ts]]
            hit = _presence(tcodes, lvl.n_groups) & id_groups
            if hit.any():
                trows = np.flatnonzero(hit[tcodes])
                found.breaches.append(_breach(
                    "group_spans_ood", None, None, ("in-domain rows", ts), hit, lvl,
                    np.flatnonzero(hit[lvl.codes[: f.n_rows]]),
                    extra={"group_level": name, "test_set_rows": trows[:MAX_EXAMPLE_ROWS].tolist(),
                           "n_test_set_rows": int(trows.size)}))


# ----------------------------------------------------------------------------- per-outcome rules


def _rule_rows_in_one_role(f: _SweepFacts, found: _Findings, oc: _Outcome) -> None:
    """Rule 1: a row index in two roles of one outcome is refused at once (``LeakageError``,
    whatever ``raise_on_leakage`` says)."""
    role_of = np.full(f.n_rows, -1, dtype=np.int64)
    row_breaches = []
    for k, role in enumerate(ROLES):
        rr = np.unique(oc.rows[role])
        clash = rr[role_of[rr] >= 0]
        if clash.size:
            other = sorted({ROLES[i] for i in role_of[clash]})
            row_breaches.append({
                "level": "row", "replicate": oc.replicate, "split": oc.split, "roles": [*other, role],
                "n_ids": int(clash.size), "ids": clash[:MAX_EXAMPLE_IDS].tolist(),
                "n_rows": int(clash.size), "rows": clash[:MAX_EXAMPLE_ROWS].tolist(),
            })
        role_of[rr[role_of[rr] < 0]] = k
    if row_breaches:
        raise LeakageError(_error_message(row_breaches), row_breaches)


def _rule_group_overlaps(f: _SweepFacts, found: _Findings, oc: _Outcome) -> None:
    """Rules 2 and 5: a tile or group id in two roles, or in an in-domain role and an extra test
    set. Critical at the protected levels and finer; coarser levels are recorded for rule 5."""
    rows = oc.rows
    for name, lvl in f.levels.items():
        sink = found.coarse_found if name in f.coarser else found.breaches
        pres = {role: _presence(lvl.codes[rows[role]], lvl.n_groups) for role in ROLES}
        any_hit = np.zeros(lvl.n_groups, dtype=bool)
        for i in range(len(ROLES)):
            for j in range(i + 1, len(ROLES)):
                a, b = ROLES[i], ROLES[j]
                hit = pres[a] & pres[b]
                if hit.any():
                    both = np.concatenate([rows[a], rows[b]])
                    both = both[hit[lvl.codes[both]]]
                    sink.append(_breach(name, oc.replicate, oc.split, (a, b), hit, lvl, both))
                    any_hit |= hit
        used = pres["train"] | pres["val"] | pres["in_domain"]
        for ts, o in f.offsets.items():  # extra test sets against every in-domain role
            if name not in f.ts_levels[ts]:
                continue
            tcodes = lvl.codes[o:o + f.test_set_sizes[ts]]
            hit = _presence(tcodes, lvl.n_groups) & used
            if hit.any():
                in_rows = np.concatenate([rows[k] for k in ROLES])
                in_rows = np.unique(in_rows[hit[lvl.codes[in_rows]]])
                trows = np.flatnonzero(hit[tcodes])
                roles_hit = [k for k in ROLES if (pres[k] & hit).any()]
                sink.append(_breach(name, oc.replicate, oc.split, (*roles_hit, ts), hit, lvl, in_rows,
                                    extra={"test_set_rows": trows[:MAX_EXAMPLE_ROWS].tolist(),
                                           "n_test_set_rows": int(trows.size)}))
                any_hit |= hit
        oc.entry["overlap_counts"][name] = int(any_hit.sum())


def _rule_ood_centre(f: _SweepFacts, found: _Findings, oc: _Outcome) -> None:
    """Rule 8: a centre of an unseen-confounder test set that train, val or in-domain test use."""
    lvl, rows = f.conf_level, oc.rows
    seen_rows = np.concatenate([rows[k] for k in ROLES])
    seen = _presence(lvl.codes[seen_rows], lvl.n_groups)
    n_hit = 0
    for ts, (a, b) in f.conf_off.items():
        tcodes = lvl.codes[a:b]
        hit = _presence(tcodes, lvl.n_groups) & seen
        if hit.any():
            trows = np.flatnonzero(hit[tcodes])
            in_rows = seen_rows[hit[lvl.codes[seen_rows]]]
            roles_hit = [k for k in ROLES if hit[lvl.codes[rows[k]]].any()]
            found.breaches.append(_breach("ood_centre", oc.replicate, oc.split, (*roles_hit, ts), hit, lvl, in_rows,
                                          extra={"test_set_rows": trows[:MAX_EXAMPLE_ROWS].tolist(),
                                                 "n_test_set_rows": int(trows.size)}))
            n_hit += int(hit.sum())
    oc.entry["overlap_counts"]["ood_centre"] = n_hit


def _rule_test_set_drift(f: _SweepFacts, found: _Findings, oc: _Outcome) -> None:
    """Rule 11: the in-domain test rows of a replicate are the same in every split."""
    test_sorted = np.unique(oc.rows["in_domain"])
    if oc.replicate not in found.test_ref:
        found.test_ref[oc.replicate] = (oc.split, test_sorted)
        return
    s0, ref = found.test_ref[oc.replicate]
    if ref.shape != test_sorted.shape or not np.array_equal(ref, test_sorted):
        added = np.setdiff1d(test_sorted, ref)
        removed = np.setdiff1d(ref, test_sorted)
        changed = np.concatenate([added, removed])
        found.breaches.append({
            "level": "test_set_drift", "replicate": oc.replicate, "split": oc.split,
            "roles": [f"in_domain@split {s0}", f"in_domain@split {oc.split}"],
            "n_ids": int(changed.size), "ids": changed[:MAX_EXAMPLE_IDS].tolist(),
            "n_rows": int(changed.size), "rows": changed[:MAX_EXAMPLE_ROWS].tolist(),
            "n_added": int(added.size), "n_removed": int(removed.size),
        })


def _rule_duplicate_tiles(f: _SweepFacts, found: _Findings, oc: _Outcome) -> None:
    """A tile key repeated inside one role: allowed, counted and warned about."""
    tile = f.levels["tile"]
    dup = oc.entry["duplicate_tiles_within_role"]
    for role in ROLES:
        counts = np.bincount(tile.codes[oc.rows[role]], minlength=tile.n_groups)
        dup[role] = int((counts > 1).sum())
        if dup[role]:
            found.warnings.append(f"replicate {oc.replicate}, split {oc.split}: {dup[role]} tile key(s) "
                                  f"repeated inside {role} (allowed inside one role)")


def _rule_missing_class(f: _SweepFacts, found: _Findings, oc: _Outcome) -> None:
    """Rule 9: a role (train / val / in_domain) lacking a class of the task is critical; relaxed
    (``require_class_coverage=False``) it is a warning."""
    missing = oc.entry["missing_classes"]
    for role in ROLES:
        absent = np.setdiff1d(f.task_classes, f.lab_codes[oc.rows[role]])
        if not absent.size:
            continue
        missing[role] = [f.task_class_values[i] for i in absent.tolist()]
        if not f.require_class_coverage:
            found.warnings.append(f"replicate {oc.replicate}, split {oc.split}: {role} lacks class(es) "
                                  f"{missing[role]}")
        else:
            found.breaches.append({
                "level": f"missing_class:{role}", "replicate": oc.replicate, "split": oc.split,
                "roles": [role], "n_ids": int(absent.size),
                "ids": missing[role][:MAX_EXAMPLE_IDS], "n_rows": 0, "rows": [],
            })


def _rule_id_centre_unseen(f: _SweepFacts, found: _Findings, oc: _Outcome) -> None:
    """Rule 6: a centre of the in-domain test rows never seen in training (critical)."""
    cc, n, rows = f.conf_codes, len(f.conf_uniques), oc.rows
    unseen = _presence(cc[rows["in_domain"]], n) & ~_presence(cc[rows["train"]], n)
    if unseen.any():
        trows = rows["in_domain"][unseen[cc[rows["in_domain"]]]]
        found.breaches.append({
            "level": "id_centre_unseen", "replicate": oc.replicate, "split": oc.split,
            "roles": ["train", "in_domain"], "n_ids": int(unseen.sum()),
            "ids": [f.conf_uniques[i] for i in np.flatnonzero(unseen)[:MAX_EXAMPLE_IDS]],
            "n_rows": int(trows.size), "rows": np.unique(trows)[:MAX_EXAMPLE_ROWS].tolist(),
        })


# ----------------------------------------------------------------------------- closing rules


def _rule_replicate_seeds(f: _SweepFacts, found: _Findings) -> None:
    """Rule 12: one seed per replicate, distinct across replicates."""
    multi_seed = {r: sorted(map(str, s)) for r, s in found.seeds_by_rep.items() if len(s) > 1}
    if multi_seed:
        found.breaches.append({"level": "replicate_seeds", "replicate": None, "split": None,
                               "roles": ["replicate"], "n_ids": len(multi_seed),
                               "ids": [[r, s] for r, s in list(multi_seed.items())[:MAX_EXAMPLE_IDS]],
                               "n_rows": 0, "rows": []})
    single = [(r, next(iter(s))) for r, s in found.seeds_by_rep.items() if len(s) == 1]
    seed_vals = pd.Series([s for _, s in single], dtype=object)
    dup = seed_vals[seed_vals.duplicated(keep=False) & seed_vals.notna()]
    if len(dup):
        found.breaches.append({"level": "replicate_seeds", "replicate": None, "split": None,
                               "roles": ["replicate"], "n_ids": int(dup.nunique()),
                               "ids": sorted({_id(v) for v in dup})[:MAX_EXAMPLE_IDS],
                               "n_rows": 0, "rows": []})


def _rule_coarser_overlaps(f: _SweepFacts, found: _Findings) -> None:
    """Rule 5: overlaps at identity levels coarser than the protected one are counted and shown as
    warnings, never hidden, never critical."""
    for name in f.coarser:
        mine = [b for b in found.coarse_found if b["level"] == name]
        if mine:
            examples = list(dict.fromkeys(i for b in mine for i in b["ids"]))[:MAX_EXAMPLE_IDS]
            found.warnings.append(
                f"{name} overlaps across roles in {len(mine)} case(s) (coarser than the protected "
                f"level '{f.protected_level}', so a warning), e.g. {examples}; first: {_format_breach(mine[0])}")


@dataclass(frozen=True)
class _Rule:
    """One audit rule: ``check`` is its name in ``report["checks"]`` (None: a rule without a check
    of its own: warnings, or part of the identity-level checks), ``stage`` when it runs
    (``sweep``: once before the outcomes, ``outcome``: per outcome in order, ``close``: once after
    them), ``applies`` whether the inputs enable it."""

    check: str | None
    stage: str
    run: Callable
    applies: Callable[[_SweepFacts], bool] = lambda f: True
    #: whether ``check`` is listed as checked (default: whenever the rule applies)
    checked: Callable[[_SweepFacts], bool] | None = None


#: The rules, in the order they run within their stage (the order of breaches and warnings in
#: the report).
RULES: tuple[_Rule, ...] = (
    _Rule("conflicting_labels", "sweep", _rule_conflicting_labels, lambda f: f.lab_codes is not None),
    _Rule(None, "sweep", _rule_unaudited_test_sets),
    _Rule(None, "sweep", _rule_groups_spanning_centres, lambda f: f.conf_codes is not None),
    _Rule("group_spans_ood", "sweep", _rule_group_spans_ood, lambda f: bool(f.test_set_confounders)),
    _Rule(None, "outcome", _rule_rows_in_one_role),
    _Rule(None, "outcome", _rule_group_overlaps),
    _Rule("ood_centre", "outcome", _rule_ood_centre, lambda f: f.conf_level is not None),
    _Rule("test_set_drift", "outcome", _rule_test_set_drift),
    _Rule(None, "outcome", _rule_duplicate_tiles),
    _Rule("missing_class", "outcome", _rule_missing_class, lambda f: f.lab_codes is not None,
          checked=lambda f: f.lab_codes is not None and f.require_class_coverage),
    _Rule("id_centre_unseen", "outcome", _rule_id_centre_unseen,
          lambda f: f.conf_codes is not None and f.require_seen_id_centres),
    _Rule("replicate_seeds", "close", _rule_replicate_seeds),
    _Rule(None, "close", _rule_coarser_overlaps),
)

#: Order of ``report["checks"]`` after the identity levels (``row``, ``tile``, the protected groups).
_CHECK_ORDER = ("conflicting_labels", "ood_centre", "id_centre_unseen", "missing_class", "group_spans_ood",
                "test_set_drift", "replicate_seeds")


def audit_sweep(
    outcomes: Sequence[Any],
    *,
    n_rows: int,
    groups: Mapping[str, Any],
    tile_ids,
    labels=None,
    confounders=None,
    test_set_sizes: Mapping[str, int] | None = None,
    test_set_groups: Mapping[str, Mapping[str, Any]] | None = None,
    test_set_confounders: Mapping[str, Any] | None = None,
    raise_on_leakage: bool = True,
    require_class_coverage: bool = True,
    require_seen_id_centres: bool = True,
    protected_level: str | None = None,
) -> dict:
    """Audit every (replicate, split) outcome of a sweep; return a JSON-serialisable report.

    The audit is the table :data:`RULES` run over validated inputs: sweep-wide rules first, then
    every outcome's rules in order, then the closing rules; each rule is a small function with its
    own docstring (rule numbers of spec/evaluation.md C.3).

    Parameters
    ----------
    outcomes : sequence of objects with ``replicate, split, seed, train_rows, val_rows,
        test_rows`` (C's ``ProbeOutcome``); row arrays are int indices into the embeddings.
    n_rows : number of embedding rows.
    groups : ``{level: ids (n_rows,)}`` protected group ids (e.g. ``{"slide": ..., "patient": ...}``).
    tile_ids : ids (n_rows,) or a tuple of such arrays forming a composite key.
    labels : optional class per row; enables ``conflicting_labels``.
    confounders : optional confounder code per row; needed for ``ood_centre``.
    test_set_sizes : ``{name: n}`` row count of each extra test set.
    test_set_groups : ``{name: {level: ids (n,)}}``; must cover every level of ``groups``
        ("tile" optional). A test set without an entry is recorded as not group-audited.
    test_set_confounders : ``{name: codes (n,)}`` in the ``confounders`` code space; a code seen
        in train / val / in-domain test is critical ``ood_centre``.
    raise_on_leakage : raise :class:`LeakageError` (carrying the report) on any critical breach.
    require_class_coverage : (default True, spec rule 9) a role (train / val / in_domain) that
        lacks a class of the task is critical ``missing_class:<role>``; False records it in
        ``per_outcome[...]["missing_classes"]`` and as a warning only (an explicit relaxation,
        listed in ``report["relaxed"]``).
    require_seen_id_centres : (default True, spec rule 6) an in-domain test centre absent from
        train is critical ``id_centre_unseen`` (needs ``confounders``); False relaxes it.
    protected_level : the identity level the split protects, a key of ``groups``. Default: the
        coarsest of :data:`IDENTITY_LEVELS` among ``groups`` (every level then is critical, since
        finer levels nest in it). Overlaps at levels of :data:`IDENTITY_LEVELS` coarser than it
        are warnings (rule 5), reported in ``coarser_overlaps`` and ``warnings``.

    Raises
    ------
    LeakageError
        A row index in two roles (always), or any critical breach with ``raise_on_leakage``.
    ValueError
        No outcomes; malformed / missing / blank identities (rows named); row indices out of
        range; inconsistent test-set inputs.
    """
    outcomes = list(outcomes)
    f = _facts(outcomes, n_rows=n_rows, groups=groups, tile_ids=tile_ids, labels=labels, confounders=confounders,
               test_set_sizes=test_set_sizes, test_set_groups=test_set_groups,
               test_set_confounders=test_set_confounders, require_class_coverage=require_class_coverage,
               require_seen_id_centres=require_seen_id_centres, protected_level=protected_level)
    active = [r for r in RULES if r.applies(f)]
    enabled = {r.check for r in active if r.check and (r.checked is None or r.checked(f))}
    checks = ["row", "tile", *[g for g in groups if g not in f.coarser], *[c for c in _CHECK_ORDER if c in enabled]]
    found = _Findings()
    for rule in active:
        if rule.stage == "sweep":
            rule.run(f, found)
    per_outcome = []
    for raw in outcomes:
        oc = _outcome(raw, f, found)
        for rule in active:
            if rule.stage == "outcome":
                rule.run(f, found, oc)
        per_outcome.append(oc.entry)
    for rule in active:
        if rule.stage == "close":
            rule.run(f, found)
    report = {
        "schema_version": AUDIT_SCHEMA_VERSION,
        "passed": not found.breaches,
        "checks": checks,
        "levels": list(f.levels),
        "protected_levels": [g for g in groups if g not in f.coarser],
        "protected_level": f.protected_level,
        "coarser_overlaps": found.coarse_found,
        "n_rows": f.n_rows,
        "n_outcomes": len(outcomes),
        "replicates": sorted(found.seeds_by_rep, key=lambda x: (str(type(x)), x)),
        "test_sets": {
            ts: {
                "n_rows": int(f.test_set_sizes[ts]),
                "levels_checked": f.ts_levels[ts],
                "confounders_checked": bool(test_set_confounders and ts in test_set_confounders),
            }
            for ts in f.test_set_sizes
        },
        "critical": sorted({b["level"] for b in found.breaches}),
        "breaches": found.breaches,
        "warnings": found.warnings,
        "groups_spanning_centres": found.spans,
        "relaxed": [name for name, on in (("missing_class", require_class_coverage),
                                          ("id_centre_unseen", require_seen_id_centres)) if not on],
        "per_outcome": per_outcome,
    }
    if found.breaches and raise_on_leakage:
        raise LeakageError(_error_message(found.breaches), found.breaches, report)
    return report


# ---------------------------------------------------------------------------------------------
# content audit (rule 3): identical embedding bytes in two roles

#: Fixed dtype and byte order the content of an embedding row is compared / hashed in. Every
#: float32 value is exactly representable in float64, so two rows are equal here exactly when
#: their float32 (or float64) values are equal bit for bit after the exact upcast.
CONTENT_DTYPE = np.dtype("<f8")

_CONTENT_SEVERITIES = ("critical", "warning")


#: Rows per block while fingerprinting (bounds the float64 working copy to ~block x D x 8 bytes).
_CONTENT_BLOCK_ROWS = 4096


def _row_content_codes(blocks: Sequence[np.ndarray]) -> tuple[np.ndarray, Callable[[int], np.ndarray]]:
    """Content code per row over the stacked blocks (equal code <=> byte-identical row).

    Each row is cast to :data:`CONTENT_DTYPE` block by block and its 64-bit words are folded into
    two 64-bit keys by fixed random odd multipliers (wrap-around arithmetic, vectorised). Rows
    whose keys collide are then compared byte for byte (``np.unique`` on an opaque ``void`` view),
    so the codes are exact; no per-row Python work and no full float64 copy of the embeddings.
    Returns the codes (int64, 0..K-1) and ``row(i)`` giving row ``i`` in the canonical dtype.
    """
    arrays = [np.asarray(b) for b in blocks]
    width = arrays[0].shape[1]
    mult = np.random.default_rng(0x5EED).integers(1, 2**63, size=(2, width), dtype=np.uint64) | np.uint64(1)
    keys = []
    for arr in arrays:
        for lo in range(0, arr.shape[0], _CONTENT_BLOCK_ROWS):
            words = np.ascontiguousarray(arr[lo:lo + _CONTENT_BLOCK_ROWS], dtype=CONTENT_DTYPE).view("<u8")
            k = np.empty((words.shape[0], 2), dtype=np.uint64)
            k[:, 0] = (words * mult[0]).sum(axis=1, dtype=np.uint64)
            k[:, 1] = ((words ^ (words >> np.uint64(29))) * mult[1]).sum(axis=1, dtype=np.uint64)
            keys.append(k)
    starts = np.cumsum([0] + [a.shape[0] for a in arrays])

    def row(i: int) -> np.ndarray:
        j = int(np.searchsorted(starts, i, side="right")) - 1
        return np.ascontiguousarray(arrays[j][i - starts[j]], dtype=CONTENT_DTYPE)

    n = int(starts[-1])
    if n == 0 or width == 0:
        return np.zeros(n, np.int64), row
    key = np.concatenate(keys)
    _, prov = np.unique(key.view(np.dtype((np.void, 16))).reshape(-1), return_inverse=True)
    prov = prov.reshape(-1).astype(np.int64)
    mult_count = np.bincount(prov)
    cand = np.flatnonzero(mult_count[prov] > 1)  # rows sharing a fingerprint: verify bytes
    final = prov.copy()
    if cand.size:
        parts = []
        for j, arr in enumerate(arrays):  # cand is sorted: per-block gathers keep its order
            local = cand[(cand >= starts[j]) & (cand < starts[j + 1])] - starts[j]
            if local.size:
                parts.append(np.ascontiguousarray(arr[local], dtype=CONTENT_DTYPE))
        exact = np.concatenate(parts)
        _, sub = np.unique(exact.view(np.dtype((np.void, width * CONTENT_DTYPE.itemsize))).reshape(-1),
                           return_inverse=True)
        final[cand] = int(prov.max()) + 1 + sub.reshape(-1)
    _, codes = np.unique(final, return_inverse=True)
    return codes.reshape(-1).astype(np.int64), row


def _row_sha256(row: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(row, dtype=CONTENT_DTYPE).tobytes()).hexdigest()


def audit_content(
    embeddings,
    jobs: Sequence[Any],
    *,
    test_sets: Mapping[str, Any] | None = None,
    severity: str = "critical",
) -> dict:
    """Find byte-identical embedding rows in two roles of any (replicate, split) (spec C.3 rule 3).

    Parameters
    ----------
    embeddings : array (n_rows, D) -- the in-domain rows the jobs index.
    jobs : objects with ``replicate, split, train_rows, val_rows, test_rows`` (roles ``train``,
        ``val``, ``test_id``).
    test_sets : ``{name: X (n, D)}`` (or ``(X, y)`` pairs); every row of a test set is in role
        ``name`` (a ``test_ood`` role) for every job.
    severity : ``"critical"`` (default) or ``"warning"``. ``"warning"`` is the explicit
        relaxation: overlaps are reported under ``lowered_breaches`` and ``passed`` stays True;
        the report records the setting.

    Returns
    -------
    dict, JSON-safe: ``check = "content"``, ``severity``, ``dtype``, ``n_rows``,
    ``n_distinct_rows``, ``passed``, ``critical`` (``["content"]`` or ``[]``), ``breaches``
    (level ``content``: replicate, split, roles, n_ids, ids = sha256 hex of the shared row
    contents (first 10), n_rows, rows (first 20 in-domain rows; test-set rows under
    ``test_set_rows``)), ``lowered_breaches``, ``warnings``, ``per_outcome``.

    Identical rows inside one role are only counted (``duplicate_rows_within_role``).

    Raises
    ------
    ValueError
        Unknown severity; no jobs; a test set whose width differs from the embeddings.
    """
    if severity not in _CONTENT_SEVERITIES:
        raise ValueError(f"content audit severity must be one of {_CONTENT_SEVERITIES}, got {severity!r}")
    jobs = list(jobs)
    if not jobs:
        raise ValueError("no jobs to audit; an empty content audit never passes")
    x = np.asarray(embeddings)
    if x.ndim != 2:
        raise ValueError(f"embeddings must be 2-D, got shape {x.shape}")
    n_rows = x.shape[0]
    names, blocks = [], [x]
    for name, value in (test_sets or {}).items():
        tx = np.asarray(value[0] if isinstance(value, tuple) else value)
        if tx.ndim != 2 or tx.shape[1] != x.shape[1]:
            raise ValueError(f"test set '{name}': shape {tx.shape} does not match the embeddings' "
                             f"{x.shape[1]} features")
        names.append(name)
        blocks.append(tx)
    codes, row_of = _row_content_codes(blocks)
    n_codes = int(codes.max()) + 1 if codes.size else 0
    multiplicity = np.bincount(codes, minlength=n_codes)
    dup_code = multiplicity > 1  # only contents held by >= 2 rows can cross roles
    order = np.argsort(codes, kind="stable")
    starts = np.flatnonzero(np.r_[True, np.diff(codes[order]) != 0]) if codes.size else order
    first_row = order[starts]  # first row holding each content code (codes are 0..n_codes-1)
    offsets, o = {}, n_rows
    for name, b in zip(names, blocks[1:]):
        offsets[name] = (o, o + b.shape[0])
        o += b.shape[0]
    ts_present = {name: _presence(codes[a:b], n_codes) & dup_code for name, (a, b) in offsets.items()}

    found: list[dict] = []
    warnings: list[str] = []
    per_outcome = []
    for job in jobs:
        r, s = _id(job.replicate), _id(job.split)
        roles = {
            "train": np.asarray(job.train_rows, np.int64),
            "val": np.asarray(job.val_rows, np.int64),
            "test_id": np.asarray(job.test_rows, np.int64),
        }
        pres = {k: _presence(codes[v], n_codes) & dup_code for k, v in roles.items()}
        within = {}
        for k, v in roles.items():
            c = codes[v]
            c = c[dup_code[c]]
            cnt = np.bincount(c, minlength=n_codes)
            within[k] = int((cnt > 1).sum())
        pres.update(ts_present)
        role_names = list(pres)
        any_hit = np.zeros(n_codes, dtype=bool)
        for i in range(len(role_names)):
            for j in range(i + 1, len(role_names)):
                a, b = role_names[i], role_names[j]
                if a in offsets and b in offsets:
                    continue  # two fixed test sets: not a property of this split
                hit = pres[a] & pres[b]
                if not hit.any():
                    continue
                any_hit |= hit
                ids = np.flatnonzero(hit)
                in_rows = np.concatenate([roles[k] for k in (a, b) if k in roles])
                in_rows = np.unique(in_rows[hit[codes[in_rows]]])
                d = {
                    "level": "content", "replicate": r, "split": s, "roles": [a, b],
                    "n_ids": int(ids.size),
                    "ids": [_row_sha256(row_of(int(first_row[c]))) for c in ids[:MAX_EXAMPLE_IDS]],
                    "n_rows": int(in_rows.size), "rows": in_rows[:MAX_EXAMPLE_ROWS].tolist(),
                }
                if b in offsets:
                    lo, hi = offsets[b]
                    trows = np.flatnonzero(hit[codes[lo:hi]])
                    d["test_set_rows"] = trows[:MAX_EXAMPLE_ROWS].tolist()
                    d["n_test_set_rows"] = int(trows.size)
                found.append(d)
        per_outcome.append({"replicate": r, "split": s, "overlap_count": int(any_hit.sum()),
                            "duplicate_rows_within_role": within})
    if severity == "warning":
        breaches, lowered = [], found
        warnings.append("content audit lowered to a warning by an explicit setting "
                        "(content_audit='warning')")
        if found:
            warnings.append(f"{len(found)} content overlap(s) between roles, reported but not critical")
    else:
        breaches, lowered = found, []
    dup_total = int(dup_code.sum())
    if dup_total:
        warnings.append(f"{dup_total} embedding content(s) are shared by more than one row")
    return {
        "schema_version": AUDIT_SCHEMA_VERSION,
        "check": "content",
        "severity": severity,
        "dtype": CONTENT_DTYPE.str,
        "n_rows": int(n_rows),
        "test_sets": {name: int(b - a) for name, (a, b) in offsets.items()},
        "n_distinct_rows": n_codes,
        "passed": not breaches,
        "critical": ["content"] if breaches else [],
        "breaches": breaches,
        "lowered_breaches": lowered,
        "warnings": warnings,
        "per_outcome": per_outcome,
    }


def combine_leakage(plan_audit: dict | None, content_audit: dict | None) -> dict:
    """The leakage record of a bundle: plan audit + this encoder's content audit.

    ``passed`` is True only when both audits ran and passed; False when either failed; None
    (with ``"not_audited"`` in ``critical`` and the missing parts named) when either did not
    run. It is never vacuously true.
    """
    missing = [name for name, a in (("plan", plan_audit), ("content", content_audit)) if a is None]
    critical = []
    for a in (plan_audit, content_audit):
        if a is not None:
            critical.extend(a.get("critical", []))
    if missing:
        critical.append("not_audited")
    failed = any(a is not None and a.get("passed") is not True for a in (plan_audit, content_audit))
    passed = False if failed else (None if missing else True)
    return {
        "schema_version": AUDIT_SCHEMA_VERSION,
        "passed": passed,
        "critical": sorted(set(critical)),
        "not_audited": missing,
        "plan": plan_audit,
        "content": content_audit,
    }


# ---------------------------------------------------------------------------------------------
# whole-partition (cross-validation) audit (spec B.3, C.3 "Cross-validation mode")


def audit_cv_folds(
    folds: Sequence[tuple[Any, Any]],
    *,
    n_rows: int,
    groups: Mapping[str, Any],
    tile_ids,
    labels=None,
    raise_on_leakage: bool = False,
) -> dict:
    """Audit a fold assignment as one object: every row validated once, every identity in one fold.

    Parameters
    ----------
    folds : ``[(train_idx, validation_idx), ...]``, numbered from 1 in the report.
    n_rows : number of rows the indices point into.
    groups : ``{level: ids (n_rows,)}`` protected group ids (missing / blank ids refused).
    tile_ids : ids (n_rows,) or a tuple of arrays (composite tile key); a tile family (repeated
        key) must also sit in one validation fold.
    labels : optional class per row; a tile key with two classes is critical ``conflicting_labels``.
    raise_on_leakage : raise LeakageError when the audit fails.

    Returns
    -------
    dict (JSON-safe): ``split_name = "all_cv_folds"``, ``n_samples``, ``n_folds``,
    ``validation_membership_missing`` / ``_duplicate`` (first 20 rows) with exact counts,
    ``overlap_counts`` per level, ``examples`` per level (first 10, ``"value -> folds a,b"``),
    ``critical`` (fixed order: membership, protected levels, conflicts), ``warnings``, ``passed``.

    Raises
    ------
    ValueError
        No folds; an index outside ``[0, n_rows)`` (named); malformed identities.
    LeakageError
        An index in both parts of one fold (at once), or a failed audit with ``raise_on_leakage``.
    """
    folds = list(folds)
    if not folds:
        raise ValueError("no folds to audit; an empty audit never passes")
    n_rows = int(n_rows)
    levels, _ = _build_levels(n_rows, groups, tile_ids, {}, None)
    val_parts, fold_ids = [], []
    for f, (tr, va) in enumerate(folds, start=1):
        tr = _check_rows(tr, n_rows, role="train", replicate=None, split=f"fold {f}")
        va = _check_rows(va, n_rows, role="validation", replicate=None, split=f"fold {f}")
        both = np.intersect1d(tr, va)
        if both.size:
            b = {"level": "row", "replicate": None, "split": f, "roles": ["train", "validation"],
                 "n_ids": int(both.size), "ids": both[:MAX_EXAMPLE_IDS].tolist(),
                 "n_rows": int(both.size), "rows": both[:MAX_EXAMPLE_ROWS].tolist()}
            raise LeakageError(f"fold {f}: rows {both[:MAX_EXAMPLE_ROWS].tolist()} ({both.size} in all) "
                               "are in both train and validation", [b])
        val_parts.append(np.unique(va))
        fold_ids.append(np.full(val_parts[-1].size, f, np.int64))
    val_rows = np.concatenate(val_parts)
    val_fold = np.concatenate(fold_ids)
    membership = np.bincount(val_rows, minlength=n_rows)
    missing = np.flatnonzero(membership == 0)
    duplicate = np.flatnonzero(membership > 1)
    critical: list[str] = []
    if missing.size:
        critical.append("validation_membership_missing")
    if duplicate.size:
        critical.append("validation_membership_duplicate")
    overlap_counts: dict[str, int] = {}
    examples: dict[str, list[str]] = {}
    for name, lvl in levels.items():
        pairs = np.unique(np.stack([lvl.codes[val_rows], val_fold], axis=1), axis=0)
        n_folds_of = np.bincount(pairs[:, 0], minlength=lvl.n_groups)
        multi = np.flatnonzero(n_folds_of > 1)
        overlap_counts[name] = int(multi.size)
        if multi.size:
            critical.append(name)
            shown = multi[:MAX_EXAMPLE_IDS]
            sel = pairs[np.isin(pairs[:, 0], shown)]
            folds_of = pd.Series(sel[:, 1]).groupby(sel[:, 0]).apply(list).to_dict()
            examples[name] = [f"{lvl.uniques[c]} -> folds {','.join(map(str, folds_of[c]))}" for c in shown]
    conflicts = 0
    if labels is not None:
        lab = np.asarray(labels)
        if lab.shape != (n_rows,):
            raise ValueError(f"labels must have shape ({n_rows},), got {lab.shape}")
        tcodes = levels["tile"].codes
        lab_codes = pd.factorize(pd.Series(lab, copy=False))[0]
        pairs = np.unique(np.stack([tcodes, lab_codes], axis=1), axis=0)
        multi = np.flatnonzero(np.bincount(pairs[:, 0], minlength=levels["tile"].n_groups) > 1)
        conflicts = int(multi.size)
        if multi.size:
            critical.append("conflicting_labels")
            examples["conflicting_labels"] = [str(levels["tile"].uniques[c]) for c in multi[:MAX_EXAMPLE_IDS]]
    overlap_counts["conflicting_labels"] = conflicts
    report = {
        "schema_version": AUDIT_SCHEMA_VERSION,
        "split_name": "all_cv_folds",
        "n_samples": n_rows,
        "n_folds": len(folds),
        "levels": list(levels),
        "validation_membership_missing": missing[:MAX_EXAMPLE_ROWS].tolist(),
        "n_validation_membership_missing": int(missing.size),
        "validation_membership_duplicate": duplicate[:MAX_EXAMPLE_ROWS].tolist(),
        "n_validation_membership_duplicate": int(duplicate.size),
        "overlap_counts": overlap_counts,
        "examples": examples,
        "critical": critical,
        "warnings": [],
        "passed": not critical,
    }
    if critical and raise_on_leakage:
        raise LeakageError("Cross-validation leakage audit failed: " + ", ".join(critical), [], report)
    return report
