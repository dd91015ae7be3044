"""Command line: ``fedmpi run | check | info | report | compare | partition | export | runs |
stats``.

Bad input (a :class:`~fedmpi.errors.UserError`) prints one line
``fedmpi: error: ...`` naming the key or file, and exits with status 2; under
``mpiexec``/``srun`` only rank 0 prints it (every rank reads the same input). User
code that raises prints ``fedmpi: error: <object> (<import path>) raised <Type>:
<message> at <file>:<line>``, once per job: exit 2 while the run is built
(:class:`~fedmpi.errors.UserCodeError`), 1 once it runs
(:class:`~fedmpi.errors.RunFailed`); ``--traceback`` (or ``FEDMPI_TRACEBACK=1``)
adds the full traceback. A refused write (:class:`~fedmpi.job.outputs.OutputError`,
e.g. disk full) prints one line naming the file and exits with status 1.

Over ~400 lines with one job: the argument parser and one thin handler per subcommand;
each handler only parses and calls the module that does the work.
"""
from __future__ import annotations

from fedmpi.job import signals

signals.install_early()   # first: a SIGTERM during the imports below exits 75
import argparse  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
from typing import Optional, Sequence  # noqa: E402

from fedmpi._version import __version__  # noqa: E402
from fedmpi.errors import (EXIT_USAGE, RunFailed, RunInterrupted, UserCodeError, UserError,
    launch_rank, show_traceback)
from fedmpi.job.outputs import EXIT_WRITE_FAILED, OutputError, quiet_h5py_errors


def _add_set(p: argparse.ArgumentParser) -> None:
    """The ``--set KEY=VALUE`` option of every command that reads a config."""
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set train.lr=0.1 (repeatable)")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fedmpi", description="MPI-native federated learning.")
    p.add_argument("--version", action="version", version=f"fedmpi {__version__}")
    p.add_argument("--traceback", action="store_true",
                   help="on an error, also print the full Python traceback (as "
                        "FEDMPI_TRACEBACK=1); without it an error is one line")
    sub = p.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run an experiment (alone or under mpirun -n N)")
    run.add_argument("config", help="YAML config file")
    _add_set(run)
    run.add_argument("--out", default=None, help="output directory (default runtime.out_dir/<name>)")
    run.add_argument("--resume", action="store_true",
                     help="continue from <out>/checkpoint.pt and <out>/log.h5 (any number of ranks)")
    run.add_argument("--overwrite", action="store_true",
                     help="replace a previous run in <out> (log.h5, checkpoint.pt, model.pt); "
                          "without it a fresh run there is refused")

    check = sub.add_parser("check", help="validate a config and print it resolved")
    check.add_argument("config")
    _add_set(check)
    check.add_argument("--dry-run", action="store_true",
                       help="also build every rank (data, model, method, weighting, transforms) "
                            "and run one forward/backward batch per client and one evaluation "
                            "batch, checking the model's outputs against the classes; writes "
                            "nothing (alone or under mpirun -n N, as the run would)")

    info = sub.add_parser("info", help="versions, MPI library, CUDA-aware MPI, GPUs, rank placement")
    info.add_argument("-n", "--ranks", type=int, default=None, metavar="N",
                      help="show the rank -> GPU placement for N ranks on this node "
                           "(default: 1 aggregator + 1 worker per GPU)")
    info.add_argument("--launcher", action="store_true",
                      help="print only the command that starts the ranks in a Slurm job for "
                           "this MPI (srun --mpi=pmi2|pmix ... or mpirun), as used by slurm/*.sbatch")

    report = sub.add_parser("report", help="PNG plots and summary.md of one run log")
    report.add_argument("log", help="run log (log.h5), also one still being written")
    report.add_argument("--out", default=None, help="output directory (default <log dir>/report)")
    report.add_argument("--target-accuracy", type=float, default=None, metavar="X",
                        help="target test accuracy as a fraction, e.g. 0.8")
    report.add_argument("--overwrite", action="store_true",
                     help="replace the files of an earlier report in --out (without it, "
                          "existing files are never replaced)")

    compare = sub.add_parser("compare", help="table across runs: mean ± std over seeds, "
                                             "rounds to a target, speed-up")
    compare.add_argument("logs", nargs="+", help="run logs (log.h5)")
    compare.add_argument("--target-accuracy", type=float, default=None, metavar="X",
                         help="target test accuracy as a fraction (default: the baseline's "
                              "best accuracy, lowest over its runs)")
    compare.add_argument("--group-by", action="append", default=[], metavar="KEY",
                         help="dotted config key or alias (algorithm, weighting, alpha, dataset, "
                              "model, partition, clients, ecgr); repeatable; default: the "
                              "config keys that differ between the logs, seeds excluded")
    compare.add_argument("--baseline", default=None, metavar="GROUP",
                         help="group for the speed-up, by label or value (default: the fedavg "
                              "group if there is exactly one)")
    compare.add_argument("--out", default=None,
                         help="also write compare.md, compare.csv and runs.csv into this directory")
    compare.add_argument("--overwrite", action="store_true",
                     help="replace compare.md, compare.csv, runs.csv existing in --out")

    export = sub.add_parser("export", help="a run log as TensorBoard events, an MLflow run or "
                                           "a CSV table (the log stays the record)")
    export.add_argument("log", help="run log (log.h5)")
    export.add_argument("--tensorboard", default=None, metavar="DIR",
                        help="write TensorBoard event files into DIR (extra fedmpi[tensorboard])")
    export.add_argument("--mlflow", default=None, metavar="URI",
                        help="log one MLflow run to tracking URI, e.g. sqlite:///mlflow.db "
                             "(extra fedmpi[mlflow])")
    export.add_argument("--experiment", default="fedmpi", metavar="NAME",
                        help="MLflow experiment (default fedmpi)")
    export.add_argument("--csv", default=None, metavar="FILE",
                        help="one row per round: /rounds scalars and per-site metrics")
    export.add_argument("--overwrite", action="store_true",
                        help="replace an existing --csv FILE (without it nothing is replaced)")

    runs = sub.add_parser("runs", help="the run directories under DIR: status, rounds, last and "
                                       "best metric, whether --resume is possible, lock holder")
    runs.add_argument("dir", nargs="?", default="runs",
                      help="directory holding run directories, searched recursively "
                           "(default runs/)")
    runs.add_argument("--json", action="store_true",
                      help="print a JSON list (one object per run directory) for scripts")

    stats = sub.add_parser("stats", help="federated statistics of every site's data (counts, "
                                         "labels, per-feature mean/std/range/missing): only "
                                         "summaries leave a site; alone or under mpirun -n N")
    stats.add_argument("config", help="YAML config file (the sites of its data.* keys)")
    _add_set(stats)
    stats.add_argument("--out", default=None,
                       help="output directory for stats.md and stats.json (default "
                            "runtime.out_dir/<name>/stats)")
    stats.add_argument("--overwrite", action="store_true",
                       help="replace stats.md and stats.json existing in --out")
    stats.add_argument("--epsilon", type=float, default=None, metavar="E",
                       help="Gaussian noise on every site's summaries, (E, --delta)-DP per "
                            "record (dp-accounting); needs --clip")
    stats.add_argument("--delta", type=float, default=1e-5, metavar="D",
                       help="δ of --epsilon (default 1e-5)")
    stats.add_argument("--clip", type=float, nargs=2, default=None, metavar=("LO", "HI"),
                       help="with --epsilon: every value is clipped to [LO, HI] before it is "
                            "summed (the range the sensitivities assume)")

    part = sub.add_parser("partition", help="partition preview without training: class-count "
                                            "heatmap and client sizes")
    part.add_argument("config", help="YAML config file")
    _add_set(part)
    part.add_argument("--out", default=None,
                      help="output directory (default runtime.out_dir/<name>)")
    part.add_argument("--export", nargs="?", const="", default=None, metavar="DIR",
                      help="also write one table per client (silo), the test set and the server "
                           "hold-out: to the files data.silos.path/test/validation name, or as "
                           "DIR/{client}.csv, DIR/test.csv, DIR/validation.csv")
    part.add_argument("--overwrite", action="store_true",
                     help="replace existing partition.png/.csv and exported files "
                          "(without it nothing that exists is replaced)")
    for command in sub.choices.values():   # also accepted after the command
        command.add_argument("--traceback", action="store_true", default=argparse.SUPPRESS,
                             help="on an error, also print the full traceback")
    return p


def _cmd_run(args: argparse.Namespace) -> int:
    from fedmpi.api import run_cli as run

    result = run(args.config, args.overrides, out=args.out, resume=args.resume,
                 overwrite=args.overwrite)
    if result.metrics:
        print("final " + " ".join(f"{k}={v:.6f}" for k, v in result.metrics.items()), flush=True)
    return 0


def _cmd_check(args: argparse.Namespace) -> int:
    from fedmpi.config.schema import load_config
    from fedmpi.usercode import check_config_paths

    cfg = load_config(args.config, args.overrides)
    check_config_paths(cfg)
    if not args.dry_run:
        sys.stdout.write(cfg.to_yaml())
        return 0
    from fedmpi.runtime.driver import check

    line = check(cfg)
    if launch_rank() == 0:
        sys.stdout.write(cfg.to_yaml())
        print(f"fedmpi check: {line}", file=sys.stderr)
    return 0


def info_lines(ranks: Optional[int] = None) -> list[str]:
    """What ``fedmpi info`` prints (also used in bench JSON); ``ranks``: ranks on
    this node for the placement lines (:mod:`fedmpi.job.placement`)."""
    import numpy
    import torch

    from fedmpi.comm.library import cuda_aware_mpi, mpi4py_version, mpi_library_version

    lines = [f"fedmpi {__version__}", f"python {platform.python_version()}",
             f"torch {torch.__version__}", _torchvision_line(), f"numpy {numpy.__version__}"]
    try:
        lines.append(f"mpi4py {mpi4py_version()}")
    except ImportError:
        lines.append("mpi4py not installed (pip install mpi4py, or build it against the system MPI)")
    lines.append(f"MPI library: {mpi_library_version()}")
    lines.append("Slurm launcher (fedmpi info --launcher): {} ({})".format(*launcher_choice()))
    aware = cuda_aware_mpi()
    lines.append(f"CUDA-aware MPI: {'unknown' if aware is None else ('yes' if aware else 'no')}")
    lines.append(f"CPU cores: {os.cpu_count()}, torch threads: {torch.get_num_threads()}")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            lines.append(f"GPU {i}: {torch.cuda.get_device_name(i)}")
    else:
        lines.append("GPUs: none (runtime.device auto -> cpu)")
    from fedmpi.job.placement import default_threads, describe, plan, usable_cores

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    ranks = ranks or 1 + max(1, gpus)
    rule = f"node-local rank i -> GPU i mod {gpus}" if gpus else "no GPUs: every rank on the CPU"
    lines.append(f"placement of {ranks} ranks on this node ({rule}; "
                 "{} torch threads per rank from {}".format(*default_threads(ranks)) +
                 f"{'; oversubscribed' if ranks > usable_cores() else ''}):")
    lines.extend("  " + line for line in describe(plan(ranks, gpus)))
    lines.append("optional packages:")
    lines.extend(f"  {line}" for line in optional_lines())
    return lines


#: The optional packages (distribution name, the fedmpi extra that installs it).
OPTIONAL_PACKAGES = (("matplotlib", "plot"), ("pandas", "tabular"), ("pyarrow", "tabular"),
                     ("dp-accounting", "privacy"), ("cryptography", "privacy"),
                     ("tensorboard", "tensorboard"), ("mlflow", "mlflow"),
                     ("transformers", "peft"), ("peft", "peft"))


def optional_lines() -> list[str]:
    """``<package> <version>`` of every :data:`OPTIONAL_PACKAGES` entry, or how to install
    it (from the installed metadata: nothing is imported)."""
    from importlib.metadata import PackageNotFoundError, version

    out = []
    for name, extra in OPTIONAL_PACKAGES:
        try:
            out.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            out.append(f"{name} not installed (pip install 'fedmpi[{extra}]')")
    return out


def _torchvision_line() -> str:
    """torchvision's version, and its import error when it cannot be imported beside this
    torch (a mismatched pair fails inside a user's model, issue 48)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        installed = version("torchvision")
    except PackageNotFoundError:
        return "torchvision not installed (pip install torchvision)"
    try:
        import torchvision  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any failure is what the user needs to see
        from fedmpi.errors import root_cause

        why = root_cause(exc)
        return (f"torchvision {installed} (cannot be imported: {type(why).__name__}: "
                + " ".join(str(why).split()) + ")")
    return f"torchvision {installed}"


def launcher_choice() -> tuple[str, str]:
    """(launcher words for a Slurm job step, shell-quoted; why), for ``fedmpi info
    --launcher`` (:func:`fedmpi.job.launcher.choose_launcher`)."""
    import shlex

    from fedmpi.comm.library import mpi_library_version
    from fedmpi.job.launcher import choose_launcher, find_mpirun, srun_mpi_plugins

    version = mpi_library_version(initialize=False)
    try:
        mpirun = find_mpirun(sys.executable)
    except UserError:
        mpirun = "mpirun"
    words, why = choose_launcher(version, srun_mpi_plugins(), mpirun)
    return shlex.join(words), why


def _cmd_info(args: argparse.Namespace) -> int:
    if args.launcher:
        line, why = launcher_choice()
        print(f"fedmpi info: {why}", file=sys.stderr)
        print(line)
        return 0
    if args.ranks is not None and args.ranks < 1:
        raise UserError(f"fedmpi info --ranks expects a positive number of ranks, got {args.ranks}")
    print("\n".join(info_lines(args.ranks)))
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from fedmpi.report.canvas import PLOT_HINT, have_matplotlib
    from fedmpi.report import write_report

    for path in write_report(args.log, args.out, args.target_accuracy, overwrite=args.overwrite):
        print(path)
    if not have_matplotlib():
        print(f"fedmpi report: summary.md only; {PLOT_HINT}", file=sys.stderr)
    return 0


def _cmd_compare(args: argparse.Namespace) -> int:
    from fedmpi.compare import compare
    from fedmpi.job.outputs import claim
    from fedmpi.job.rundir import output_dir

    out = output_dir(args.out) if args.out is not None else None
    table = compare(args.logs, target=args.target_accuracy, group_by=args.group_by,
                    baseline=args.baseline)
    md = table.markdown()
    sys.stdout.write(md)
    if out is not None:
        from fedmpi.job.safefile import refuse_links, write_text

        refuse_links(out, ("compare.md", "compare.csv", "runs.csv"), "an output directory")
        claim([out / n for n in ("compare.md", "compare.csv", "runs.csv")], args.overwrite,
              "fedmpi compare --out")
        write_text(out / "compare.md", md)
        write_text(out / "compare.csv", table.csv())
        write_text(out / "runs.csv", table.runs_csv())
    return 0


def _cmd_partition(args: argparse.Namespace) -> int:
    from pathlib import Path

    from fedmpi.config.schema import load_config
    from fedmpi.data.build import build_partition, load_pool
    from fedmpi.data.export import plan_export, pooled_config, silo_files
    from fedmpi.data.tabular import write_table
    from fedmpi.job.outputs import claim
    from fedmpi.report.preview import partition_preview
    from fedmpi.job.rundir import output_dir
    from fedmpi.usercode import UserCode

    cfg = load_config(args.config, args.overrides)
    out = output_dir(args.out if args.out is not None else Path(cfg.runtime.out_dir) / cfg.name)
    if cfg.data.partition.method == "silos" and args.export is None:
        files = silo_files(cfg)
        if cfg.data.silos.loader is not None or all(Path(f).exists() for f in files):
            from fedmpi.comm.world import self_comm
            from fedmpi.data.silos import build_local, site_names

            # the federation's own silos, read as a run reads them (one rank hosting all)
            local = build_local(cfg, self_comm(), range(cfg.data.num_clients), True,
                                needs=UserCode().data_needs(cfg))
            lines = partition_preview(local.partition, out, cfg.name, args.overwrite,
                                      site_names(cfg))
            print(f"silos: {cfg.data.silos.loader or cfg.data.silos.path} "
                  f"({cfg.data.num_clients} clients; test {cfg.data.silos.test})")
            print("\n".join(lines))
            return 0
        print(f"silos: {cfg.data.silos.path} not found; showing what --export would write: "
              f"data.dataset {cfg.data.dataset!r} cut by data.silos.split "
              f"{cfg.data.silos.split!r}")
    pooled = pooled_config(cfg)   # silos: the split `--export` writes (data.silos.split)
    data = load_pool(pooled)
    partition = build_partition(pooled, data, UserCode().data_needs(pooled))
    tables = []
    if args.export is not None:   # every target checked before the first file is written
        tables = plan_export(cfg, data, partition, args.export or None, args.overwrite)
        claim([out / "partition.png", out / "partition.csv"], args.overwrite, "fedmpi partition")
    for line in partition_preview(partition, out, cfg.name, args.overwrite):
        print(line)
    for path, x, y in tables:
        print(write_table(path, x, y, cfg.data.tabular.label))
    return 0


def _cmd_runs(args: argparse.Namespace) -> int:
    import json

    from fedmpi.compare.listing import entries_json, entries_table, list_runs

    entries = list_runs(args.dir)
    if args.json:
        print(json.dumps(entries_json(entries), indent=1))
    else:
        sys.stdout.write(entries_table(entries, args.dir))
    return 0


def _cmd_stats(args: argparse.Namespace) -> int:
    from pathlib import Path

    from fedmpi.comm.world import Comm
    from fedmpi.config.schema import load_config
    from fedmpi.consortium.noise import calibrate
    from fedmpi.consortium.stats import collect_stats
    from fedmpi.consortium.stats_files import claim_outputs, write_stats
    from fedmpi.errors import ConfigError

    if (args.epsilon is None) != (args.clip is None):
        raise ConfigError("fedmpi stats: --epsilon and --clip LO HI go together (the noise's "
                          "sensitivities rest on the declared range of the values)")
    privacy = calibrate(args.epsilon, args.delta, args.clip) if args.epsilon is not None else None
    cfg = load_config(args.config, args.overrides)
    out = Path(args.out) if args.out is not None else \
        Path(cfg.runtime.out_dir) / cfg.name / "stats"
    comm = Comm(timeout=cfg.runtime.setup_timeout)
    comm.timeout_key = "runtime.setup_timeout"
    report = collect_stats(cfg, comm, privacy, before=lambda: claim_outputs(out, args.overwrite))
    if report is None:
        return 0
    for path in write_stats(report, out, args.config, overwrite=args.overwrite):
        print(path)
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from fedmpi.errors import ConfigError
    from fedmpi.log.trackers import export

    if args.tensorboard is None and args.mlflow is None and args.csv is None:
        raise ConfigError("fedmpi export needs at least one of --tensorboard DIR, --mlflow URI, "
                          "--csv FILE")
    for line in export(args.log, args.tensorboard, args.mlflow, args.csv, args.experiment,
                       overwrite=args.overwrite):
        print(line)
    return 0


COMMANDS = {"run": _cmd_run, "check": _cmd_check, "info": _cmd_info, "report": _cmd_report,
            "compare": _cmd_compare, "partition": _cmd_partition, "export": _cmd_export,
            "runs": _cmd_runs, "stats": _cmd_stats}


def one_line(exc: BaseException) -> str:
    """The message on one line (a library's multi-line text folded at its newlines)."""
    return " ".join(part.strip() for part in str(exc).splitlines() if part.strip())


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    if args.command != "run":   # only a run is requeued: other commands die by the signal
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
            if signal.getsignal(sig) is signals._exit_interrupted:
                signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT
                              else signal.SIG_DFL)
    before = os.environ.get("FEDMPI_TRACEBACK")
    if args.traceback:   # every rank parses the same argv; worker code reads the variable
        os.environ["FEDMPI_TRACEBACK"] = "1"
    try:
        return _main(args)
    finally:   # an in-process caller's environment is left as it was
        if before is None:
            os.environ.pop("FEDMPI_TRACEBACK", None)
        else:
            os.environ["FEDMPI_TRACEBACK"] = before


def _main(args: argparse.Namespace) -> int:
    try:
        return COMMANDS[args.command](args)
    except UserError as exc:
        # every rank hit the same bad input (or another rank reported it): say it once
        if launch_rank() == 0 and not getattr(exc, "quiet", False):
            if show_traceback() and isinstance(exc, UserCodeError):
                sys.stderr.write(exc.trace)
            print(f"fedmpi: error: {one_line(exc)}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    except RunFailed as exc:   # rank 0 says why; the others exit with the same status
        if not exc.quiet:
            line = one_line(exc)
            print(line if isinstance(exc, RunInterrupted) else f"fedmpi: error: {line}",
                  file=sys.stderr, flush=True)
        return exc.exit_code
    except OutputError as exc:
        print(f"fedmpi: error: {exc}", file=sys.stderr, flush=True)
        quiet_h5py_errors()
        sys.stdout.flush()
        # HDF5 crashes at interpreter exit on a file whose flush failed: leave now.
        os._exit(EXIT_WRITE_FAILED)
    except KeyboardInterrupt:
        print("fedmpi: interrupted", file=sys.stderr)
        return 130


def entry() -> None:
    """The ``fedmpi`` process: :func:`main`, and once a stop signal was acted on,
    later ones are ignored until the process has exited with status 75
    (:func:`fedmpi.job.signals.hold_after_stop`)."""
    from fedmpi.job import signals

    signals.hold_after_stop()
    sys.exit(main())


if __name__ == "__main__":  # pragma: no cover
    entry()
