"""The runtime: one code path for every rank, method and world size.

Where things are:

============================  ==========================================================
:mod:`.driver`                ``run``: set-up agreement, resume, progress, exit codes, files
:mod:`.build`                 device, data, model, method/weighting/transforms, placement
:mod:`.federation`            one rank and its round loop (:class:`Federation`)
:mod:`.policy`                what a round decides: participants, when it closes, late updates
:mod:`.exchange`              the verbs that move a round's messages (a protocol)
:mod:`.collective`            the default exchange: one fixed sequence of collectives
:mod:`.view`                  the narrow views of a rank: run status, the plug-ins' view
:mod:`.worker`                client task → local update → transforms → status → uplink
:mod:`.server`                the pure server step: exclusion, weights, server rule
:mod:`.evaluation`            default / method-owned / sharded / overlapped / per-site evaluation
:mod:`.record`                log rows and timing
:mod:`.guard`                 run-level safety nets: run directory, divergence, refused writes
============================  ==========================================================
"""
