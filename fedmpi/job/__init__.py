"""A run as a job on disk and in the cluster: its directory (:mod:`~fedmpi.job.rundir`)
and one-writer lock (:mod:`~fedmpi.job.lock`), writes that never follow a planted link
(:mod:`~fedmpi.job.safefile`, :mod:`~fedmpi.job.outputs`), checkpoints
(:mod:`~fedmpi.job.checkpoint`, :mod:`~fedmpi.job.checkpoint_file`,
:mod:`~fedmpi.job.client_states`, :mod:`~fedmpi.job.state_check`), signals and
preemption (:mod:`~fedmpi.job.signals`), what ran (:mod:`~fedmpi.job.provenance`), the
launcher and rank placement (:mod:`~fedmpi.job.launcher`, :mod:`~fedmpi.job.placement`)."""
