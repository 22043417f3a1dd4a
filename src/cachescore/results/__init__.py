"""Results a user can decide on: every stored score with its uncertainty, flags and rank, as tidy
tables at documented paths (ADR-0009).

* :func:`score_table` / :func:`probe_table` / :func:`probe_centre_table` – the tidy tables of a
  set of stored records (scores; probe accuracies; per-centre probe metrics from the bundles);
* :func:`publish_tables` – write them atomically to ``<store>/scores.parquet`` and
  ``<store>/probe.parquet`` (what ``cachescore run`` does after every run);
* :func:`build_results` / :func:`publish_results` – the tables of a job's current records, built
  (what ``cachescore scores`` shows) or published in the store (what every run ends with);
* :func:`export_tables` – the same tables as Parquet, CSV or JSON elsewhere (``cachescore export``);
* :func:`compare_encoders` – B − A per view × metric with a paired bootstrap CI and a verdict
  (``cachescore compare``).

Uncertainty is computed centrally from the stored per-unit values (no neighbour search again):
a cluster bootstrap over ``group_id`` with croma's draw rule (spec/metrics.md §8.2), one shared
draw per view, so encoders' replicates are paired and give rank intervals.
"""

from .compare import COMPARE_COLUMNS, compare_encoders
from .publish import build_results, publish_results
from .scores import CENTRE_COLUMNS, PROBE_COLUMNS, SCORE_COLUMNS, probe_centre_table, probe_table, score_table
from .tables import export_tables, publish_tables, read_scores

__all__ = ["SCORE_COLUMNS", "PROBE_COLUMNS", "CENTRE_COLUMNS", "COMPARE_COLUMNS", "score_table", "probe_table",
           "probe_centre_table", "compare_encoders",
           "publish_tables", "export_tables", "read_scores", "build_results", "publish_results"]
