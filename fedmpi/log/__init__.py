"""HDF5 run log: :class:`LogWriter` (rank 0 only) and :func:`read`.

Layout, ``schema_version`` "1" (R rounds, K clients; docs/hdf5-log.md)::

    / attrs                  schema_version, fedmpi_version, config_yaml, world_size,
                             status (running|completed|failed|interrupted),
                             resumed_world_sizes (only after a resume),
                             stop_reason (only for a run completed before train.rounds:
                             privacy.target_epsilon),
                             fingerprint (run-defining config hash, fedmpi.job.rundir),
                             writer_host, writer_pid, flushed_at (Unix time of the
                             last flush; issue 18), run_info (JSON: the model, data
                             and silo files with SHA-256, the sites' names, method and
                             its parameters,
                             weighting, transforms as they ran; fedmpi.job.provenance)
    /rounds/round            [R]        int64
    /rounds/<name>           [R]        int64 for ``bytes_*``, float64 otherwise
    /clients/num_samples     [K]        int64
    /clients/<name>          [R, K]     bool for selected/excluded, float64 otherwise
    /partition/class_counts  [K, C]     int64
    /<group>/<name>          [R, ...]   per-round arrays, e.g. fedvg/grad_norm [R, K, L]
    /<group>/<name>          [...]      static datasets, e.g. fedvg/layer_names [L]
    /events/round, rank, client, message   [E]   int64, int64, int64, str

Every dataset with a round axis is chunked and resizable along axis 0
(``maxshape[0] is None``); that is how :func:`read` tells them from static
datasets. All of them always have the same length: a dataset first named at
round r > 0 gets r rows of its fill value (NaN, False, or 0 for ``bytes_*``),
and a name left out of one :meth:`LogWriter.append_round` gets a fill row.

The file is flushed once per round (and on events and status changes), so a
killed run leaves a log that is readable up to its last flushed round. Each
flush records its time (``flushed_at``), so a log still ``running`` whose
writer is gone is recognisable (:func:`ended_without_status`). A write that
the file system refuses (disk full) raises
:class:`~fedmpi.job.outputs.OutputError` naming the file; the writer then refuses
further writes (HDF5's state after a failed flush is not trustworthy).

One module per side: :mod:`~fedmpi.log.writer` (:class:`LogWriter`),
:mod:`~fedmpi.log.reader` (:func:`read`, :class:`RunLog`, the checks of untrusted
logs) and :mod:`~fedmpi.log.schema` (version, statuses and the HDF5 walks both share,
so the two sides cannot drift apart). Every name is importable from ``fedmpi.log``.
"""
