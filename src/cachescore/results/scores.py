"""The tidy score and probe tables: every stored score with its bootstrap CI, flags and rank.

One row of :func:`score_table` per stored record (encoder × view × design × scope × metric × m).
Uncertainty comes from the stored per-unit values, never from a new neighbour search (ADR-0009):

* **RI / MaRI** (pooled ratios ``sum(so) / (sum(so) + sum(os))``): a cluster bootstrap over
  ``group_id`` of the pooled ratio itself, recomputed from the drawn groups' evidence sums; under
  ``paired_2x2`` the ratio is the micro-average over subsets, so the same rule applies to every
  occurrence of the drawn groups;
* **CRoMa** (median of margins): croma's ``bootstrap_pooled_median`` under ``all``; under
  ``paired_2x2`` the balanced median (median of per-subset medians) of the drawn groups, the rule
  of croma's paired helpers;
* **APD**: the percentile interval of the per-replicate drops ``mean_s(acc[s, r] / acc[0, r]) - 1``
  over the probe replicates (not a cluster bootstrap: the replicates are the sweep's own
  repetitions); **nIPD**: likewise over the per-replicate nIPD (the schedule's Cramér's V and the
  chance level from the unit's evaluation bundle; NaN with ``ci_method`` saying why otherwise).
  Probe rows carry the bundle's warning when most probes selected the grid's smallest C.

Draws: PCG64 ``default_rng(seed)``, ``integers(0, K, K)`` per replicate, taken once per (view,
design) on the caller (the draw depends only on the seed and the view's groups), so every
encoder of a view is resampled identically: the rank interval of an encoder is read off the same
replicates (``paired_rank_stability`` semantics for CRoMa).

Rank columns: ``rank`` (point ranking among the defined rows; tied values share the best rank
they span, e.g. two identical encoders both rank 2), ``rank_low``/``rank_high`` and ``mean_rank``
over the shared replicates, with ties spanning every rank they could hold (two identical encoders:
``[2, 3]`` each, never a certainty decided by name; ``rank_summary(ties="span")``), ``win_fractions`` (JSON ``{other encoder: share of
replicates in which this one scores strictly higher}``, croma's ``pairwise_win``).

Flags: ``defined`` is false when the stored value is a fallback (RI/MaRI: support 0, or a scope
with a single confounder value or a single label; any non-finite value); ``undefined_reason``
says which. ``low_support``: RI/MaRI support below ``min_support``. Undefined rows are never
ranked (``rank`` null); low-support rows are ranked and flagged.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable

import numpy as np
import pandas as pd

from ..metrics import families
from ..metrics.bootstrap import cluster_counts, percentile_ci, rank_summary
from .bundles import BundleFacts, bundle_facts
from .memo import EntryMemo, entry_token, group_token

__all__ = ["SCORE_COLUMNS", "PROBE_COLUMNS", "CENTRE_COLUMNS", "BOOTSTRAP_DEFAULTS", "score_entries", "score_table",
           "keep_entries", "probe_table", "probe_centre_table", "paired_difference"]

#: Columns of the tidy score table, in order (``<store>/scores.parquet``; README "Reading results").
SCORE_COLUMNS = (
    "encoder", "view", "design", "scope", "metric", "m", "value", "ci_low", "ci_high", "ci_level", "n_boot",
    "ci_seed", "ci_method", "support", "defined", "undefined_reason", "low_support", "rank", "rank_low", "rank_high",
    "mean_rank", "n_ranked", "win_fractions", "best_encoder", "delta_vs_best", "delta_ci_low", "delta_ci_high",
    "verdict", "recall", "n_units", "n_defined", "k", "tau", "f0", "q_alpha", "ltm_alpha", "backend",
    "warnings", "fingerprint", "code_version", "finished_at",
)
#: Columns of the tidy probe table (``<store>/probe.parquet``): one row per probe accuracy.
PROBE_COLUMNS = ("encoder", "view", "test_set", "split", "replicate", "replicate_seed", "accuracy",
                 "unit_fingerprint", "split_plan_sha256")

#: ``[metrics] bootstrap`` defaults (spec §8.2).
BOOTSTRAP_DEFAULTS = {"n_boot": 2000, "level": 0.95, "seed": 0}

_INT_COLUMNS = ("m", "n_boot", "ci_seed", "rank", "rank_low", "rank_high", "n_ranked", "n_units", "n_defined", "k")
_FLOAT_COLUMNS = ("value", "ci_low", "ci_high", "ci_level", "support", "mean_rank", "recall", "tau", "f0",
                  "q_alpha", "ltm_alpha", "delta_vs_best", "delta_ci_low", "delta_ci_high")


def _num(x) -> float:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return float("nan")
    return v


class _Views:
    """Per-call memo of view frames, specs and shared bootstrap draws (one per view × design)."""

    def __init__(self, cache, bootstrap: dict):
        self.cache, self.bootstrap = cache, bootstrap
        self._frames: dict = {}
        self._draws: dict = {}

    def seed(self, view: str, frame: pd.DataFrame) -> None:
        """Use ``frame`` (``cache.read_view(view)``, already read) for ``view``."""
        self.frame(view, frame)

    def frame(self, view: str, read: pd.DataFrame | None = None) -> tuple[pd.DataFrame, str]:
        if view not in self._frames:
            frame = self.cache.read_view(view) if read is None else read
            self._frames[view] = (frame, self.cache.view_spec(view).confounder_column)
        return self._frames[view]

    def draw(self, view: str, design: str, groups: np.ndarray):
        """``(member, counts)`` shared by every unit of ``view`` × ``design`` with these groups."""
        key = (view, design)
        got = self._draws.get(key)
        if got is None or not np.array_equal(got[0], groups):
            member, counts = cluster_counts(groups, n_boot=self.bootstrap["n_boot"], seed=self.bootstrap["seed"])
            got = (groups, member, counts)
            self._draws[key] = got
        return got[1], got[2]


def _text_keys(column: pd.Series) -> np.ndarray:
    """Keys of a column's values as text (``astype(str)``): the text itself, or for a categorical
    (a large view's or table's lean columns) integers numbered in sorted text order, so equal
    texts share a key and keys sort as the texts do (what cluster numbering and the fallback
    checks need), without a string per row."""
    if isinstance(column.dtype, pd.CategoricalDtype):
        names = np.asarray([str(c) for c in column.cat.categories], dtype=object).astype(str)
        _, rank = np.unique(names, return_inverse=True)
        return rank.astype(np.int64)[column.cat.codes.to_numpy()]
    return column.astype(str).to_numpy()


def _by_text(column: pd.Series):
    """``(text, row mask)`` for each distinct text of a column (``astype(str)``), in sorted order."""
    if isinstance(column.dtype, pd.CategoricalDtype):
        texts = [str(c) for c in column.cat.categories]
        codes = column.cat.codes.to_numpy()
        for t in sorted(set(texts)):
            mask = np.isin(codes, [i for i, x in enumerate(texts) if x == t])
            if mask.any():  # a category no row holds is no scope
                yield t, mask
        return
    values = column.astype(str).to_numpy()
    for t in sorted(set(values.tolist())):
        yield t, values == t


def _one_value(values: np.ndarray) -> bool:
    """Fewer than two distinct values (``np.unique(values).size < 2`` without sorting strings)."""
    return values.size == 0 or not bool((values != values[0]).any())


def _fallback_reason(family, record: dict, per_unit: pd.DataFrame, frame: pd.DataFrame, confounder: str) -> str:
    """Why a stored value is a fallback, or ``""``: for a family with support (RI/MaRI, spec
    §5.3) 0.5 without support, or a scope with one confounder value (no OS neighbour) or one label
    (no SO neighbour); for every family a non-finite value."""
    if family is not None and family.has_support:
        if int(record.get("n_defined") or 0) == 0:
            return "support 0: no unit has an SO or OS neighbour, the value is the 0.5 fallback"
        rows = per_unit["source_index"].to_numpy(dtype=np.int64)
        conf = _text_keys(frame[confounder])[rows] if confounder in frame.columns else None
        lab = _text_keys(frame["label"])[rows] if "label" in frame.columns else None
        for s, sel in _by_text(per_unit["subset"]):
            where = "the view" if s == "dataset" else f"scope {s!r}"
            if conf is not None and _one_value(conf[sel]):
                return f"{where} has a single {confounder!r} value: RI/MaRI are not defined (no OS neighbour)"
            if lab is not None and _one_value(lab[sel]):
                return f"{where} has a single label: RI/MaRI are not defined (no SO neighbour)"
    if not math.isfinite(_num(record.get("value"))):
        return "the value is not finite"
    return ""


def _low_support(family, record: dict, min_support: float) -> bool:
    support = _num(record.get("support"))
    return bool(family is not None and family.has_support and math.isfinite(support) and support < min_support)


def _metric_entry(fp: str, record: dict, store, views: _Views, bootstrap: dict, min_support: float,
                  per_unit: pd.DataFrame | None = None) -> dict:
    family = families.lookup(record.get("metric"))
    view, design = record.get("view"), record.get("design")
    per_unit = store.per_unit(fp, text_as_categories=True) if per_unit is None else per_unit
    missing = [c for c in ("source_index", "subset", "value") if c not in per_unit.columns]
    if missing:  # a record written by something else than result_record: no units to resample
        return _entry(record, fp, None, f"not available: the per-unit table lacks {', '.join(missing)}", bootstrap,
                      reason="" if math.isfinite(_num(record.get("value"))) else "the value is not finite",
                      low_support=_low_support(family, record, min_support))
    frame, confounder = views.frame(view)
    rows = per_unit["source_index"].to_numpy(dtype=np.int64)
    groups = _text_keys(frame["group_id"])[rows]
    member, counts = views.draw(view, design, groups)
    subsets = _text_keys(per_unit["subset"]) if design == "paired_2x2" else None
    reps, method = None, f"not available: metric family {record.get('metric')!r} has no interval rule"
    if family is not None and family.replicates is not None:
        reps, method = family.replicates(per_unit, member, counts, subsets)
    reason = _fallback_reason(family, record, per_unit, frame, confounder)
    return _entry(record, fp, reps, method, bootstrap, reason=reason,
                  low_support=_low_support(family, record, min_support))


def _probe_entry(fp: str, record: dict, bootstrap: dict, facts: BundleFacts) -> dict:
    family = families.lookup(record.get("metric"))
    matrix = record.get("matrix")
    acc = np.asarray(matrix, dtype=np.float64) if matrix is not None else None
    reps, method = None, "not available: the record holds no accuracy matrix of two or more splits"
    if acc is not None and acc.ndim == 2 and acc.shape[0] >= 2 and family is not None and family.replicates:
        reps, method = family.replicates(acc, facts.cramers_v, facts.chance)
    reason = "" if math.isfinite(_num(record.get("value"))) else "the value is not finite"
    entry = _entry(record, fp, reps, method, bootstrap, reason=reason, low_support=False)
    warn = facts.smallest_c_warning
    if warn:
        entry["warnings"] = "\n".join(w for w in (warn, entry["warnings"]) if w)
    return entry


def _entry(record: dict, fp: str, reps, method: str, bootstrap: dict, *, reason: str, low_support: bool) -> dict:
    value = _num(record.get("value"))
    if reps is not None and not reason:
        ci = percentile_ci(reps, value, float(bootstrap["level"]), len(reps))
        lo, hi, n_boot = ci.lo, ci.hi, ci.n_boot
    else:
        lo = hi = float("nan")
        n_boot = 0
    m = record.get("m")
    return {
        "encoder": record.get("encoder"), "view": record.get("view"), "design": record.get("design"),
        "scope": record.get("scope") if record.get("design") == "probe" else None,
        "metric": record.get("metric"), "m": None if m is None or (isinstance(m, float) and math.isnan(m)) else int(m),
        "value": value, "ci_low": lo, "ci_high": hi, "ci_level": float(bootstrap["level"]), "n_boot": n_boot,
        "ci_seed": int(bootstrap["seed"]) if reps is not None and record.get("design") != "probe" else None,
        "ci_method": method, "support": _num(record.get("support")), "defined": not reason,
        "undefined_reason": reason, "low_support": bool(low_support and not reason),
        "recall": _num(record.get("recall")), "n_units": record.get("n_units"), "n_defined": record.get("n_defined"),
        "k": record.get("k"), "tau": _num(record.get("tau")), "f0": _num(record.get("f0")),
        "q_alpha": _num(record.get("q_alpha")), "ltm_alpha": _num(record.get("ltm_alpha")),
        "backend": record.get("backend"), "warnings": record.get("warnings") or "", "fingerprint": fp,
        "code_version": record.get("code_version"), "finished_at": record.get("finished_at"),
        "_reps": reps if (reps is not None and not reason) else None,
    }


def paired_difference(reps_a, reps_b, delta: float, level: float) -> tuple[float, float, float]:
    """``(ci_low, ci_high, win_fraction)`` of B − A (``delta`` its point value) from the paired
    replicates ``reps_a`` / ``reps_b`` (same draw, same length): the percentile interval of the
    replicate differences at ``level`` and the share of replicates where B is strictly higher. NaN
    thrice without paired replicates."""
    if reps_a is None or reps_b is None or len(reps_a) != len(reps_b) or len(reps_a) == 0:
        return float("nan"), float("nan"), float("nan")
    ra, rb = np.asarray(reps_a, dtype=float), np.asarray(reps_b, dtype=float)
    ci = percentile_ci(rb - ra, delta, level, len(ra))
    both = np.isfinite(ra) & np.isfinite(rb)
    return ci.lo, ci.hi, float((both & (rb > ra)).sum() / len(ra))


def _against_best(ranked: list[dict], level: float) -> None:
    """Each ranked entry against its group's best (rank 1; the first by name among tied ones):
    ``delta_vs_best`` (≤ 0), its paired CI and the ``verdict``: ``best``, ``worse than X`` (the
    interval excludes 0), ``no detectable difference from X`` or ``no interval: cannot decide``."""
    best = min((e for e in ranked if e["rank"] == 1), key=lambda e: e["encoder"])
    for e in ranked:
        delta = e["value"] - best["value"]
        lo, hi, _ = paired_difference(best["_reps"], e["_reps"], delta, level)
        if e is best:
            verdict = "best"
        elif not (math.isfinite(lo) and math.isfinite(hi)):
            verdict = "no interval: cannot decide"
        elif hi < 0:
            verdict = f"worse than {best['encoder']}"
        else:
            verdict = f"no detectable difference from {best['encoder']}"
        e.update(best_encoder=best["encoder"], delta_vs_best=delta, delta_ci_low=lo, delta_ci_high=hi, verdict=verdict)


def _rank_group(group: list[dict], level: float) -> None:
    """Ranks among the defined rows of one leaderboard group (:func:`_group_of`), in place."""
    ranked = sorted((e for e in group if e["defined"]), key=lambda e: e["encoder"])
    for e in group:
        e.update(rank=None, rank_low=None, rank_high=None, mean_rank=float("nan"), n_ranked=len(ranked),
                 win_fractions="", best_encoder=None, delta_vs_best=float("nan"), delta_ci_low=float("nan"),
                 delta_ci_high=float("nan"), verdict="")
    if not ranked:
        return
    names = [e["encoder"] for e in ranked]
    points = {e["encoder"]: e["value"] for e in ranked}
    lengths = {None if e["_reps"] is None else len(e["_reps"]) for e in ranked}
    if len(lengths) == 1 and None not in lengths and lengths != {0}:
        summary = rank_summary(names, points, np.stack([e["_reps"] for e in ranked], axis=1), level=level,
                               ties="span")
    else:  # no shared replicates: the point ranking only
        summary = rank_summary(names, points, np.empty((0, len(names))), level=level, ties="span")
    for e in ranked:
        n = e["encoder"]
        wins = {b: summary["pairwise_win"][(n, b)] for b in names if b != n
                and math.isfinite(summary["pairwise_win"][(n, b)])}
        e.update(rank=summary["point_rank"][n], rank_low=summary["rank_lo"][n], rank_high=summary["rank_hi"][n],
                 mean_rank=summary["mean_rank"][n], win_fractions=json.dumps(wins, sort_keys=True) if wins else "")
    _against_best(ranked, level)


def _frame(rows: list[dict], columns) -> pd.DataFrame:
    df = pd.DataFrame([{c: r.get(c) for c in columns} for r in rows], columns=list(columns))
    for c in columns:
        if c in _INT_COLUMNS:
            df[c] = pd.array([None if v is None or (isinstance(v, float) and math.isnan(v)) else int(v)
                              for v in df[c]], dtype="Int64")
        elif c in _FLOAT_COLUMNS or c == "accuracy":
            df[c] = pd.to_numeric(df[c], errors="coerce").astype("float64")
        elif c in ("defined", "low_support"):
            df[c] = df[c].astype(bool)
        elif c == "finished_at":
            df[c] = pd.to_datetime(df[c], utc=True, errors="coerce")
    return df


class _Entries:
    """Builds score entries of stored records, sharing view frames, bootstrap draws and bundle
    facts across the records of one call."""

    def __init__(self, store, cache, bootstrap: dict, min_support: float, kept: EntryMemo | None = None):
        self.store, self.bootstrap, self.min_support = store, bootstrap, float(min_support)
        self.views = _Views(cache, bootstrap)
        self.facts: dict = {}
        self.kept = kept

    def entry(self, fp: str, record: dict, per_unit: pd.DataFrame | None = None) -> dict:
        """The entry of stored record ``fp`` (``per_unit``: its per-unit table when the caller holds it)."""
        if record.get("design") == "probe":
            bundle = record.get("bundle")
            if bundle not in self.facts:
                self.facts[bundle] = bundle_facts(bundle)
            return _probe_entry(fp, record, self.bootstrap, self.facts[bundle])
        if self.kept is None:
            return _metric_entry(fp, record, self.store, self.views, self.bootstrap, self.min_support, per_unit)
        token = entry_token(fp, self.bootstrap, self.min_support)
        entry = self.kept.get(token)
        if entry is None:
            entry = _metric_entry(fp, record, self.store, self.views, self.bootstrap, self.min_support, per_unit)
            self.kept.put(token, entry)
        return entry


def keep_entries(store, cache, fingerprints, *, bootstrap: dict | None, min_support: float,
                 view_frame: pd.DataFrame | None = None, per_units: dict | None = None) -> int:
    """Compute and keep (:class:`~.memo.EntryMemo`) the entries of the stored metric records
    ``fingerprints`` (the unit task calls this on the worker right after storing them, so the
    run's publication draws no replicate). ``view_frame``: the records' view as the task read it
    (``cache.read_view``; all records of one view), so it is not read again; ``per_units``
    (``{fingerprint: the per-unit table just stored}``) likewise. Returns how many
    entries were computed; records the store lacks and probe records are skipped. Raises what
    :func:`score_entries` raises."""
    bootstrap = dict(BOOTSTRAP_DEFAULTS, **(bootstrap or {}))
    build = _Entries(store, cache, bootstrap, min_support, kept=EntryMemo(store.path, writable=True))
    n = 0
    for fp in dict.fromkeys(fingerprints):
        record = store.record(fp)
        if record is None or record.get("design") == "probe":
            continue
        if view_frame is not None:
            build.views.seed(record.get("view"), view_frame)
        build.entry(fp, record, (per_units or {}).get(fp))
        n += 1
    return n


def score_entries(store, cache, fingerprints: Iterable[str], *, bootstrap: dict | None = None,
                  min_support: float = 0.5) -> list[dict]:
    """One dict per stored record of ``fingerprints``: the :data:`SCORE_COLUMNS` fields (unranked)
    plus ``_reps``, the score's replicate values (shared draw per view × design; None without an
    interval). What :func:`score_table` and :func:`~.compare.compare_encoders` build on."""
    bootstrap = dict(BOOTSTRAP_DEFAULTS, **(bootstrap or {}))
    build = _Entries(store, cache, bootstrap, min_support)
    entries = []
    for fp in dict.fromkeys(fingerprints):
        record = store.record(fp)
        if record is not None:
            entries.append(build.entry(fp, record))
    return entries


def _group_of(record: dict) -> tuple:
    """The leaderboard group of a record: ``(view, design, scope, metric, m)``, as :func:`_entry`
    normalises them (scope for probe records only, ``m`` as an int or None)."""
    m = record.get("m")
    m = None if m is None or (isinstance(m, float) and math.isnan(m)) else int(m)
    scope = record.get("scope") if record.get("design") == "probe" else None
    return tuple(str(x) for x in (record.get("view"), record.get("design"), scope, record.get("metric"), m))


def score_table(store, cache, fingerprints: Iterable[str], *, bootstrap: dict | None = None,
                min_support: float = 0.5, memo=None, entries=None) -> pd.DataFrame:
    """The tidy score table of the stored records ``fingerprints`` (absent ones are skipped).

    ``store``: a ``ResultsStore``; ``cache``: the job's ``Cache`` (views give ``group_id``, labels
    and confounders of the units); ``bootstrap``: ``{"n_boot", "level", "seed"}`` (defaults
    :data:`BOOTSTRAP_DEFAULTS`). Columns :data:`SCORE_COLUMNS`; sorted by view, design, scope,
    metric, m, rank (unranked last), encoder. Raises what reading the store or the views raises
    (``CorruptRecordError``, cache errors).

    ``memo`` (a :class:`~.memo.TableMemo`): each group's rows are taken from it when its
    :func:`~.memo.group_token` is kept there — no per-unit table read, no replicate drawn — and
    computed (and kept, when the memo is writable) otherwise; groups no longer part of the table
    are dropped from a writable memo. ``entries`` (an :class:`~.memo.EntryMemo`): a recomputed
    group takes its members' entries (value, interval, replicates) from it and ranks them, so a
    group that gained an encoder computes that encoder's entry only; entries of records no longer
    in the table are dropped from a writable one. Rows are identical either way.
    """
    bootstrap = dict(BOOTSTRAP_DEFAULTS, **(bootstrap or {}))
    groups: dict = {}
    for fp in dict.fromkeys(fingerprints):
        record = store.record(fp)
        if record is not None:
            groups.setdefault(_group_of(record), []).append((fp, record))
    build = _Entries(store, cache, bootstrap, min_support, kept=entries)
    frames, tokens = [], []
    for members in groups.values():
        token = group_token([fp for fp, _ in members], bootstrap, min_support) if memo is not None else None
        kept = memo.get(token) if memo is not None else None
        if kept is None:
            members_entries = [build.entry(fp, record) for fp, record in members]
            _rank_group(members_entries, float(bootstrap["level"]))
            kept = _frame(members_entries, SCORE_COLUMNS)
            if memo is not None:
                memo.put(token, kept)
        frames.append(kept)
        tokens.append(token)
    if memo is not None:
        memo.keep_only(tokens)
    if entries is not None:
        entries.keep_only([entry_token(fp, bootstrap, min_support) for members in groups.values() for fp, _ in members])
    df = pd.concat(frames, ignore_index=True) if frames else _frame([], SCORE_COLUMNS)
    if len(df):
        df = df.sort_values(["view", "design", "scope", "metric", "m", "rank", "encoder"], na_position="last",
                            kind="stable").reset_index(drop=True)
    return df


def probe_table(store, fingerprints: Iterable[str]) -> pd.DataFrame:
    """One row per probe accuracy of the stored probe records ``fingerprints``: ``encoder, view,
    test_set`` (``in_domain`` or a test set), ``split`` (schedule row, 0 = balanced),
    ``replicate``, ``replicate_seed``, ``accuracy`` (balanced accuracy), ``unit_fingerprint``,
    ``split_plan_sha256`` (columns :data:`PROBE_COLUMNS`)."""
    rows, seen = [], set()
    for fp in dict.fromkeys(fingerprints):
        record = store.record(fp)
        if record is None or record.get("design") != "probe" or record.get("matrix") is None:
            continue
        key = (record.get("unit_fingerprint"), record.get("scope"))
        if key in seen:  # the apd and nipd records of a matrix hold the same matrix
            continue
        seen.add(key)
        acc = np.asarray(record["matrix"], dtype=np.float64)
        seeds = list(record.get("replicate_seeds") or [])
        for s in range(acc.shape[0]):
            for r in range(acc.shape[1]):
                rows.append({"encoder": record.get("encoder"), "view": record.get("view"),
                             "test_set": record.get("scope"), "split": s, "replicate": r,
                             "replicate_seed": seeds[r] if r < len(seeds) else None, "accuracy": float(acc[s, r]),
                             "unit_fingerprint": record.get("unit_fingerprint"),
                             "split_plan_sha256": record.get("split_plan_sha256")})
    df = _frame(rows, PROBE_COLUMNS)
    for c in ("split", "replicate", "replicate_seed"):
        df[c] = pd.array([None if v is None or (isinstance(v, float) and math.isnan(v)) else int(v) for v in df[c]],
                         dtype="Int64")
    return df


#: Columns of the per-centre probe table (``<store>/probe_centres.parquet``).
CENTRE_COLUMNS = ("encoder", "view", "centre", "confounder_column", "role", "role_kind", "split", "replicate", "n", "balanced_accuracy",
                  "accuracy", "ece_raw", "ece_calibrated", "unit_fingerprint")


def probe_centre_table(store, fingerprints: Iterable[str]) -> pd.DataFrame:
    """One row per (probe, role, centre) of the stored probe units' bundles (columns
    :data:`CENTRE_COLUMNS`): how every probe scores on each centre, in-domain and unseen; ``centre``
    is the confounder value by name, ``confounder_column`` the view column it comes from."""
    frames, seen = [], set()
    for fp in dict.fromkeys(fingerprints):
        record = store.record(fp)
        if record is None or record.get("design") != "probe" or record.get("bundle") in seen:
            continue
        seen.add(record.get("bundle"))
        facts = bundle_facts(record.get("bundle"))
        table = facts.per_centre
        if table is None or not len(table):
            continue
        t = table.assign(encoder=record.get("encoder"), view=record.get("view"),
                         unit_fingerprint=record.get("unit_fingerprint"), confounder_column=facts.confounder_column)
        t["centre"] = t["centre"].astype(str)
        frames.append(t[[c for c in CENTRE_COLUMNS if c in t.columns]])
    if not frames:
        return pd.DataFrame({c: pd.Series(dtype="object") for c in CENTRE_COLUMNS})
    return pd.concat(frames, ignore_index=True).reindex(columns=list(CENTRE_COLUMNS))


def scores_json(df: pd.DataFrame) -> str:
    """The table as JSON records (NaN → null, timestamps ISO 8601)."""
    return df.to_json(orient="records", date_format="iso", indent=1)

