"""cachescore: robustness scoring of foundation-model embedding caches.

The metric API mirrors croma 1.0.1 (``RI``, ``MaRI``, ``CRoMa``, ``expand_features_to_manifest``,
``apd``, ``nipd``, ``probe_sweep``) and also accepts dask arrays.
"""

__version__ = "0.1.0"
