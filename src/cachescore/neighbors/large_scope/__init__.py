"""Out-of-core, distributed neighbour search (an engine of :mod:`cachescore.neighbors`) of one large scope (DESIGN §4 "Large scopes", §6 "Scale").

A metric unit whose scope has at least ``[neighbors] large_scope_rows`` rows is not a task: the
client process drives it (:func:`cachescore.pipeline.large_unit.drive_large_unit`) through this
module, which fans the search out over the cluster's workers. Its scopes arrive as
:class:`ScopeRef` (a worker wrote each scope's ``rows.npy``: tileset row and codes per scope row);
the API may pass :class:`ScopeRows` (arrays), which the engine writes to scratch first:

1. **Partition** (once per scope, shared by every unit of that scope):
   a sample of rows is read from the cache and normalised, and a spherical k-means (one task on a worker: only the centroids come back) gives ``C``
   centroids (``C = ceil(n / ROWS_PER_CLUSTER)``); then one task per *chunk* of the scope's rows
   (``CHUNK_BYTES`` of embeddings) reads its rows **from the cache on the worker**, checks them
   (NaN/inf name the view rows), normalises them (croma's two-step rule, spec §1.7), assigns each
   to its nearest centroid and writes them to a scratch ``.npy`` sorted by cluster, with their
   metadata (scope position and codes, :data:`INDEX_COLUMNS`) in the same order. The tasks find
   the scope's tileset rows and codes in ``rows.npy``; each also writes its rows' cluster ids
   (scope order) and returns its rows per (cell, cluster) counts, nothing per row.
2. **Calibration and audit** (ANN only): two seeded query samples get their exact answers from
   one brute-force task per chunk (both samples in one pass, merged by ``(distance, index)``);
   the calibration sample picks the *probe rule* of least work whose recall reaches the target
   plus half the margin (:func:`~cachescore.neighbors.partition.calibrate_probe`, ADR-0013): from
   query cluster ``a`` a search probes every cluster whose centroid is within the *probe radius*
   of ``a``'s (:class:`~cachescore.neighbors.partition.ProbeGeometry`), nearest first, grown to
   a floor of rows (at least ``k`` + the largest group, so every query has ``k`` other-group
   candidates); each true neighbour's cluster tells from which radius or floor on it is found.
   A radius, unlike a fixed share of the rows, probes few rows from a small tight region and
   many from a large one. Typed pools (one per target cell) are calibrated together, weighted by
   the queries that search them.
3. **Search**: one task per batch of query clusters (consecutive on a nearest-centroid chain, so
   their probe sets overlap) reads its queries and the clusters they probe (cross-group: all rows
   of the probed clusters; typed: their rows of every SO/OS target cell) from the chunk files
   in pieces of at most ``PIECE_ROWS`` rows, runs the exact kernel
   (:func:`~cachescore.neighbors.partition.topk_tiles`) and writes its query rows into the
   scope-order ``(n, k)`` tables in place (positional writes; the driver only creates the files).
   The metrics read the tables as files on the workers (:meth:`LargeScopeSearch.table_files`,
   :mod:`cachescore.metrics.large`) or, through the API calls, memory-mapped. With the job's
   tables expected (``expected=``), a scope's cross-group and typed tables are searched in one
   pass: one calibration pass and one set of search tasks, a typed pair inside the cross-group
   probe computed once for both (ADR-0024); each table keeps its own rules and recall.
4. **Recall**: measured on the audit sample against its exact answers (tie-robust, like
   :mod:`cachescore.neighbors.ann`). Below the target, the rule widens to the next rung of
   :func:`~cachescore.neighbors.partition.probe_ladder` (each a superset of the last) and the
   search reruns; ``r = inf`` probes every cluster, i.e. is an exact search (the ``exact``
   backend on large scopes runs with ``r = inf`` directly, without sampling).

Memory per task: one chunk (partition), or ``BATCH_ROWS`` queries plus one ``PIECE_ROWS`` piece
of targets with their metadata (search); a task's arguments are paths, per-chunk cluster bounds
(chunks × clusters), a batch's probe plan or a bounded query sample, never O(n) (so a worker's
memory does not grow with the scope). Memory of the driver: no per-row state: O(chunks × clusters × cells) and the bounded calibration samples (ADR-0019).

Scratch: ``<store scratch>/large/<key>/<scope>/`` (the store's scratch folder is given by the caller,
:func:`cachescore.store.scratch_path`) where ``key`` fingerprints the unit's inputs, design,
confounder column, seed and code version (:func:`scratch_dir`), so concurrent units of one scope (RI and MaRI share a table)
coordinate through a ``distributed.Lock`` per artefact (the partition; all searches of a scope)
and reuse what is complete (``done.json``
written last; parts and tables written under temporary names and renamed). A run that is killed
resumes from the completed artefacts; :func:`remove_scratch` deletes a run's folders at its end.
"""


from .driver import LargeScopeSearch
from .files import (
    CALIBRATION_QUERIES,
    CHUNK_BYTES,
    KMEANS_MAX_SAMPLE,
    KMEANS_MIN_SAMPLE,
    ROWS_PER_CLUSTER,
    ScopeRef,
    ScopeRows,
    read_refs,
    write_refs,
    write_scope,
    remove_scratch,
    scratch_dir,
    scratch_root,
)
from .tasks import read_scope_rows

__all__ = [
    "CALIBRATION_QUERIES",
    "CHUNK_BYTES",
    "KMEANS_MAX_SAMPLE",
    "KMEANS_MIN_SAMPLE",
    "ROWS_PER_CLUSTER",
    "LargeScopeSearch",
    "ScopeRef",
    "ScopeRows",
    "read_refs",
    "write_refs",
    "write_scope",
    "read_scope_rows",
    "remove_scratch",
    "scratch_dir",
    "scratch_root",
]
