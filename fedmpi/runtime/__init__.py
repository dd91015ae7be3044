"""The runtime: one code path for every rank, method and world size.

Where things are:

============================  ==========================================================
:mod:`.driver`                ``run``: set-up agreement, resume, progress, exit codes, files
:mod:`.build`                 device, data, model, method/weighting/transforms, placement
:mod:`.federation`            one rank and its round loop (:class:`Federation`)
:mod:`.channel`               every message of a round (the only user of ``comm``)
:mod:`.worker`                client task → local update → transforms → status → uplink
:mod:`.server`                the pure server step: exclusion, weights, server rule
:mod:`.evaluation`            default / method-owned / sharded / overlapped / per-site evaluation
:mod:`.record`                log rows and timing
:mod:`.guard`                 run-level safety nets: run directory, divergence, refused writes
============================  ==========================================================
"""
from .build import client_hosts, participants, resolve_device
from .channel import Mirror, UplinkPlan, plan_uplink, row_tag
from .driver import run
from .federation import CMD_ABORT, CMD_ROUND, CMD_STOP, Federation
from .server import (META_FIELDS, STATUS_FAILED, STATUS_IDLE, STATUS_NONFINITE, STATUS_OK,
                     ServerResult, Uplink, server_step)
from ..train import stream_seed

__all__ = ["CMD_ABORT", "CMD_ROUND", "CMD_STOP", "Federation", "META_FIELDS", "Mirror",
           "STATUS_FAILED", "STATUS_IDLE", "STATUS_NONFINITE", "STATUS_OK", "ServerResult", "Uplink",
           "UplinkPlan", "client_hosts", "participants", "plan_uplink",
           "resolve_device", "row_tag", "run", "server_step", "stream_seed"]
