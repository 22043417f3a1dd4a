"""cachescore: robustness scoring of foundation-model embedding caches.

The metric API mirrors croma 1.0.1 (``RI``, ``MaRI``, ``CRoMa``, ``expand_features_to_manifest``,
``apd``, ``nipd``, ``probe_sweep``) and also accepts dask arrays. The cache scorer lives in
``cachescore.pipeline`` (driven by ``cachescore run JOB``); the probe evaluation in
``cachescore.probe``; croma's downstream namespace in ``cachescore.downstream``.

The public names are imported on first use (PEP 562), so ``import cachescore.cli`` (every
command) does not pay for scikit-learn or the metric modules it does not need.
"""

from importlib import import_module

from ._version import __version__

#: Public name -> the module that defines it.
_EXPORTS = {
    "expand_features_to_manifest": ".alignment",
    "apd": ".downstream", "nipd": ".downstream", "probe_sweep": ".downstream",
    "CRoMa": ".metrics.croma", "CrossConfounderRobustnessMargin": ".metrics.croma",
    "MaRI": ".metrics.mari", "MarginAwareRobustnessIndex": ".metrics.mari",
    "RI": ".metrics.ri", "RobustnessIndex": ".metrics.ri",
    "CRoMaResult": ".types", "RobustnessResult": ".types",
}

__all__ = [
    "RI",
    "MaRI",
    "CRoMa",
    "RobustnessIndex",
    "MarginAwareRobustnessIndex",
    "CrossConfounderRobustnessMargin",
    "RobustnessResult",
    "CRoMaResult",
    "expand_features_to_manifest",
    "apd",
    "nipd",
    "probe_sweep",
    "__version__",
]


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(import_module(_EXPORTS[name], __name__), name)
        globals()[name] = value  # once: later lookups are plain attribute reads
        return value
    raise AttributeError(f"module 'cachescore' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
