"""Shared test fixtures (additive: several test modules and engineers contribute here).

* ``global_seed``: the seed of randomised parity/property tests. Fixed (0) by default; set
  ``CACHESCORE_TEST_SEEDS`` to a comma list or a range (``"0-19"``) to sweep: every test using
  it must pass for any seed.
* ``toy_manifest``: a factory for croma-style manifests (Appendix A conventions of
  spec/metrics.md: ``sample_id = s{i}``, unique ``image_path``, confounder column named by the
  caller, ``group_id`` per row, ``dataset = "toy"``).
* ``croma_call``: runs a croma 1.0.1 callable with its warnings captured (croma's k-selection can
  emit scikit-learn warnings that would otherwise fail under ``filterwarnings = error``) and
  returns ``(result_or_exception, runtime_warning_messages)``.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pytest


def _parse_seeds(text: str) -> list[int]:
    seeds: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            lo, hi = part.split("-", 1)
            seeds.extend(range(int(lo), int(hi) + 1))
        else:
            seeds.append(int(part))
    return seeds or [0]


_SEEDS = _parse_seeds(os.environ.get("CACHESCORE_TEST_SEEDS", "0"))


@pytest.fixture(params=_SEEDS, ids=lambda s: f"seed{s}")
def global_seed(request) -> int:
    """Seed for randomised tests (``CACHESCORE_TEST_SEEDS`` sweeps it)."""
    return int(request.param)


def make_toy_manifest(labels, confounders, groups=None, *, confounder_column="scanner_vendor", subsets=None, dataset="toy"):
    """A croma-style manifest from per-row labels/confounders (and optional groups/subsets)."""
    n = len(labels)
    frame = pd.DataFrame(
        {
            "sample_id": [f"s{i}" for i in range(n)],
            "image_path": [f"/tmp/toy/{i}.png" for i in range(n)],
            "label": list(labels),
            confounder_column: list(confounders),
            "group_id": [f"slide-{i}" for i in range(n)] if groups is None else list(groups),
        }
    )
    if subsets is not None:
        frame["subset"] = list(subsets)
    if dataset is not None:
        frame["dataset"] = dataset
    return frame


@pytest.fixture
def toy_manifest():
    """Factory: ``toy_manifest(labels, confounders, groups=None, *, confounder_column=..., subsets=None)``."""
    return make_toy_manifest


def call_capturing(fn, *args, **kwargs):
    """Run ``fn``; return ``(result or raised exception, [RuntimeWarning messages])``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            out = fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - compared by the caller
            out = exc
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    return out, messages


@pytest.fixture
def croma_call():
    """``croma_call(fn, *args, **kwargs) -> (result_or_exception, runtime_warning_messages)``."""
    return call_capturing


@pytest.fixture(scope="session")
def rng_factory():
    """``rng_factory(*keys)`` → a ``numpy.random.Generator`` seeded from the integer keys."""
    return lambda *keys: np.random.default_rng([int(k) for k in keys])


@pytest.fixture(scope="session")
def demo(tmp_path_factory):
    """The demo job run into a fresh store (in-process cluster); returns the loaded job."""
    import io

    from cachescore.jobs import load_job
    from cachescore.pipeline import run_job

    root = tmp_path_factory.mktemp("demo")
    text = (Path(__file__).resolve().parents[1] / "jobs" / "demo.toml").read_text()
    text = text.replace('cache = "../demo-cache"', f'cache = "{root / "cache"}"').replace(
        'store = "../results/demo"', f'store = "{root / "store"}"')
    (root / "demo.toml").write_text(text)
    job = load_job(root / "demo.toml")
    summary = run_job(job, processes=False, out=io.StringIO())
    assert summary.ok and summary.tables["scores"].endswith("scores.parquet")
    return job
