"""Command line: ``fedmpi run | check | info``.

Bad input (a :class:`~fedmpi.errors.UserError`) prints one line
``fedmpi: error: ...`` naming the key or file, and exits with status 2.
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
from typing import Optional, Sequence

from . import __version__
from .errors import EXIT_USAGE, UserError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fedmpi", description="MPI-native federated learning.")
    p.add_argument("--version", action="version", version=f"fedmpi {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run an experiment (alone or under mpirun -n N)")
    run.add_argument("config", help="YAML config file")
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="override a config key, e.g. --set train.lr=0.1 (repeatable)")
    run.add_argument("--out", default=None, help="output directory (default runtime.out_dir/<name>)")

    check = sub.add_parser("check", help="validate a config and print it resolved")
    check.add_argument("config")
    check.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")

    sub.add_parser("info", help="versions, MPI library, CUDA-aware MPI, GPUs")
    return p


def _cmd_run(args: argparse.Namespace) -> int:
    from .config import load_config
    from .runtime import run

    cfg = load_config(args.config, args.overrides)
    final = run(cfg, args.out)
    if final is not None:
        print(f"final test_accuracy={final:.6f}", flush=True)
    return 0


def _cmd_check(args: argparse.Namespace) -> int:
    from .config import load_config

    cfg = load_config(args.config, args.overrides)
    sys.stdout.write(cfg.to_yaml())
    return 0


def info_lines() -> list[str]:
    """What ``fedmpi info`` prints (also used in bench JSON)."""
    import numpy
    import torch

    from .comm import cuda_aware_mpi, mpi_library_version

    lines = [f"fedmpi {__version__}", f"python {platform.python_version()}",
             f"torch {torch.__version__}", f"numpy {numpy.__version__}"]
    try:
        import mpi4py

        lines.append(f"mpi4py {mpi4py.__version__}")
    except ImportError:
        lines.append("mpi4py not installed (pip install mpi4py, or build it against the system MPI)")
    lines.append(f"MPI library: {mpi_library_version()}")
    aware = cuda_aware_mpi()
    lines.append(f"CUDA-aware MPI: {'unknown' if aware is None else ('yes' if aware else 'no')}")
    lines.append(f"CPU cores: {os.cpu_count()}, torch threads: {torch.get_num_threads()}")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            lines.append(f"GPU {i}: {torch.cuda.get_device_name(i)}")
    else:
        lines.append("GPUs: none (runtime.device auto -> cpu)")
    return lines


def _cmd_info(args: argparse.Namespace) -> int:
    print("\n".join(info_lines()))
    return 0


COMMANDS = {"run": _cmd_run, "check": _cmd_check, "info": _cmd_info}


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except UserError as exc:
        print(f"fedmpi: error: {exc}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("fedmpi: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
