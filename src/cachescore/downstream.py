"""croma-compatible namespace of the downstream protocol (``croma.downstream``).

``from cachescore.downstream import probe_sweep, probe_sweep_over_test_sets, pathorob_schedule,
IN_DOMAIN, apd, nipd`` gives the same callables, signatures and numbers as croma 1.0.1; the sweep
functions additionally accept ``client=`` (a ``distributed.Client``) to fan probes out.
"""

from cachescore.probe.fit import IN_DOMAIN
from cachescore.probe.reductions import apd, nipd
from cachescore.probe.schedule import pathorob_schedule
from cachescore.probe.sweep import probe_sweep, probe_sweep_over_test_sets

__all__ = [
    "IN_DOMAIN",
    "apd",
    "nipd",
    "pathorob_schedule",
    "probe_sweep",
    "probe_sweep_over_test_sets",
]
