"""cachescore: robustness scoring of foundation-model embedding caches.

The metric API mirrors croma 1.0.1 (``RI``, ``MaRI``, ``CRoMa``, ``expand_features_to_manifest``,
``apd``, ``nipd``, ``probe_sweep``) and also accepts dask arrays. The cache scorer lives in
``cachescore.pipeline`` (driven by ``cachescore run JOB``); the probe evaluation in
``cachescore.probe``; croma's downstream namespace in ``cachescore.downstream``.
"""

from ._version import __version__
from .alignment import expand_features_to_manifest
from .downstream import apd, nipd, probe_sweep
from .metrics.croma import CRoMa, CrossConfounderRobustnessMargin
from .metrics.mari import MarginAwareRobustnessIndex, MaRI
from .metrics.ri import RI, RobustnessIndex
from .types import CRoMaResult, RobustnessResult

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
