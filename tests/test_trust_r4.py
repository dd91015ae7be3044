"""Trust, round four (issue 48): each item's behaviour as a new user or a consortium meets it.

The silo-of-two Dropout check is in tests/test_silo.py and the one-site re-scoring of a
cross-site cell in tests/test_cross_site.py; this file holds the rest."""
from __future__ import annotations

import json
import os
from pathlib import Path
import signal
import subprocess
import sys

import pytest

from conftest import ROOT, fedmpi_cmd, mpiexec_path

QUICK = ["run", "configs/quickstart.yaml", "--set", "model.name=mlp", "--set", "train.rounds=1",
         "--set", "data.num_clients=2", "--set", "train.clients_per_round=2", "--set",
         "runtime.progress=false", "--set", "runtime.threads=1"]


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]), **extra}


# ------------------------------------------------- 3 Ctrl-C during start-up
@pytest.mark.mpi
def test_ctrl_c_at_start_up_leaves_nothing_and_the_plain_rerun_exits_0(tmp_path):
    """A Ctrl-C reaching ``mpiexec -n 3`` while rank 0 loads its data (sent from there: a
    known start-up point, no sleep): exit 75, one fedmpi line saying nothing was kept, an
    empty run directory — no config.yaml, log.h5 or model.pt to block the next run — and
    the same command then runs to the end (exit 0)."""
    mpi = mpiexec_path()
    if mpi is None:
        pytest.skip("mpiexec not found")
    out = tmp_path / "run"
    args = [*QUICK, "--out", str(out)]
    proc = subprocess.Popen([mpi, "-n", "3", *fedmpi_cmd(*args, "--set",
                                                           "data.dataset=startup_sigint:digits")],
                            cwd=ROOT, env=_env(), start_new_session=True, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 75, err[-3000:]
    ours = [ln for ln in err.splitlines() if ln.startswith("fedmpi")]
    assert len(ours) == 1 and "nothing of it was kept: run the same command again" in ours[0], err
    assert "Traceback" not in err and "BAD TERMINATION" not in err, err
    assert not out.exists() or not any(out.iterdir()), sorted(p.name for p in out.iterdir())
    again = subprocess.run([mpi, "-n", "3", *fedmpi_cmd(*args)], cwd=ROOT, env=_env(),
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]


def test_ctrl_c_during_import_torch_is_one_line_and_exit_75(tmp_path):
    """SIGINT sent the moment the process exists, while the launcher keeps it blocked:
    it waits (pending) until fedmpi's first statement unblocks it, i.e. before torch,
    numpy or MPI are imported — one line and 75, not a KeyboardInterrupt traceback (under
    ``mpiexec``: one from every rank, and MPICH's BAD TERMINATION); nothing written."""
    out = tmp_path / "out"
    proc = subprocess.Popen(fedmpi_cmd(*QUICK, "--out", str(out)), cwd=ROOT, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.pthread_sigmask(signal.SIG_BLOCK,
                                                                      {signal.SIGINT}))
    try:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 75, err[-2000:]
    assert err.strip() == ("fedmpi: interrupted (SIGINT) during start-up, before anything was "
                           "written; nothing to resume: run the same command again"), err
    assert not out.exists() or not any(out.iterdir())


def test_other_commands_keep_ctrl_c_as_keyboard_interrupt():
    """Only ``run`` turns a start-up Ctrl-C into 75: the other commands get Python's own
    handler back once their arguments are parsed."""
    code = ("import signal, fedmpi.cli as c\n"
            "early = signal.getsignal(signal.SIGINT) is not signal.default_int_handler\n"
            "c.main(['info'])\n"
            "print('handlers', early, signal.getsignal(signal.SIGINT) is signal.default_int_handler)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "handlers True True" in proc.stdout, proc.stdout


# --------------------------------------- 4, 5 a report is derived output
@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    import fedmpi

    out = tmp_path_factory.mktemp("r4") / "run"
    fedmpi.run(ROOT / "configs" / "quickstart.yaml", QUICK[3::2], out=out)
    return out


def test_a_report_is_regenerated_without_overwrite_but_an_edited_one_is_not(finished,
                                                                            monkeypatch):
    """The advice "install matplotlib, then run fedmpi report again" works as written: the
    summary-only report of a machine without matplotlib is replaced by the full one. A
    summary the user edited since is theirs: refused without --overwrite (one line)."""
    import fedmpi.report as report
    from fedmpi.job.outputs import ExistingFiles

    monkeypatch.setattr(report, "have_matplotlib", lambda: False)
    first = report.write_report(finished / "log.h5")
    assert [p.name for p in first] == ["summary.md"]
    assert "then run fedmpi report again" in first[0].read_text()
    monkeypatch.undo()
    again = {p.name for p in report.write_report(finished / "log.h5")}
    assert {"summary.md", "accuracy.png"} <= again
    assert "then run fedmpi report again" not in (finished / "report" / "summary.md").read_text()
    summary = finished / "report" / "summary.md"
    summary.write_text(summary.read_text() + "\nmy notes\n")
    with pytest.raises(ExistingFiles, match="summary.md"):
        report.write_report(finished / "log.h5")
    assert summary.read_text().endswith("my notes\n")
    report.write_report(finished / "log.h5", overwrite=True)


def test_overwrite_removes_the_old_runs_report_and_stats(tmp_path):
    """``--overwrite`` replaces a run and what was derived from it: the old report/ and
    stats/ files go (a summary reading "8 of 8 rounds" must not sit beside a new 1-round
    log); a file of the user's in report/ stays."""
    import fedmpi
    from fedmpi.report import write_report

    out = tmp_path / "run"
    fedmpi.run(ROOT / "configs" / "quickstart.yaml", QUICK[3::2], out=out)
    write_report(out / "log.h5")
    from fedmpi.cli import main
    assert main(["stats", "configs/quickstart.yaml", "--out", str(out / "stats"),
                 *(a for v in QUICK[3::2] for a in ("--set", v))]) == 0
    assert (out / "stats" / "stats.md").exists()
    (out / "report" / "notes.txt").write_text("mine\n")
    fedmpi.run(ROOT / "configs" / "quickstart.yaml", QUICK[3::2], out=out, overwrite=True)
    assert sorted(p.name for p in (out / "report").iterdir()) == ["notes.txt"]
    assert not (out / "stats").exists()


# ------------------------------------------------ 4 advice that works as written
def test_the_cross_site_refusal_names_every_key_and_following_it_works():
    from fedmpi.config.schema import config_from_dict
    from fedmpi.errors import ConfigError

    base = {"data": {"num_clients": 4}, "privacy": {"secure_aggregation": True},
            "eval": {"cross_site": True, "cross_site_models": True, "client_holdout": 0.2}}
    with pytest.raises(ConfigError) as err:
        config_from_dict(base)
    line = str(err.value)
    assert "set eval.cross_site: false and eval.cross_site_models: false" in line, line
    base["eval"].update(cross_site=False, cross_site_models=False)
    config_from_dict(base)     # the advice, followed literally, is a valid config


def test_a_silo_path_that_is_a_directory_is_named_as_one(tmp_path):
    from fedmpi.data.tabular import read_named_table
    from fedmpi.errors import DataError

    (tmp_path / "silo_0.csv").mkdir()
    with pytest.raises(DataError, match=r"silo_0.csv: is a directory, not a data file"):
        read_named_table(tmp_path / "silo_0.csv")


@pytest.mark.parametrize("path,near", [
    ("exampels.trimmed_mean_rule:TrimmedMean", "(did you mean 'examples'?)"),
    ("examples.trimed_mean_rule:TrimmedMean", "(did you mean 'examples.trimmed_mean_rule'?)"),
    ("examples.trimmed_mean_rule:TrimedMean", "(did you mean 'TrimmedMean'?)"),
])
def test_an_import_path_typo_gets_did_you_mean(path, near, monkeypatch):
    from fedmpi.errors import ConfigError
    from fedmpi.imports import resolve

    monkeypatch.chdir(ROOT)
    with pytest.raises(ConfigError) as err:
        resolve(path, "aggregation.rule", "a rule")
    assert near in str(err.value) and "'aggregation.rule'" in str(err.value), str(err.value)


@pytest.mark.parametrize("command", ["run", "check", "stats", "partition"])
def test_set_has_help_in_every_command_that_reads_a_config(command, capsys):
    from fedmpi.cli import main

    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--set KEY=VALUE override a config key" in text, text


# ------------------------------------------------------- 7 silo files by site
def test_silo_files_named_by_site(tmp_path):
    """``data.silos.path: .../{site}.csv`` with ``data.silos.names``: ``partition --export``
    writes one file per site name and a run reads them (the same model as files by
    index); {site} without names is refused naming the key."""
    import torch
    import yaml

    import fedmpi
    from fedmpi.cli import main
    from fedmpi.config.schema import config_from_dict
    from fedmpi.errors import ConfigError

    names = ["Mercy", "St Jude", "Charité"]
    models = {}
    for how, where in (("{site}", "site"), ("silo_{client}", "client")):
        root = tmp_path / where
        cfg = yaml.safe_load((ROOT / "configs" / "tabular_silos.yaml").read_text())
        cfg["data"]["num_clients"] = 3
        cfg["data"]["silos"].update(path=str(root / f"{how}.csv"), test=str(root / "test.csv"),
                                    validation=str(root / "validation.csv"), names=names)
        cfg["train"]["rounds"] = 1
        config = tmp_path / f"{where}.yaml"
        config.write_text(yaml.safe_dump(cfg, allow_unicode=True))
        assert main(["partition", str(config), "--out", str(root / "preview"), "--export"]) == 0
        models[how] = torch.load(fedmpi.run(config, out=root / "run").out_dir / "model.pt",
                                 weights_only=True)
    assert sorted(p.name for p in (tmp_path / "site").glob("*.csv")) == sorted(
        ["Mercy.csv", "St Jude.csv", "Charité.csv", "test.csv", "validation.csv"])
    a, b = models.values()
    assert all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ConfigError, match="'data.silos.path' uses {site}, which needs "
                                          "data.silos.names"):
        config_from_dict({"data": {"partition": {"method": "silos"}, "num_clients": 2,
                                   "silos": {"path": "s/{site}.csv", "test": "t.csv"}}})


# ----------------------------------------------------------- 5 stale or misleading output
def test_cross_site_colours_span_the_matrix_not_0_to_1(monkeypatch, tmp_path):
    """A cross-site matrix in 0.90-1.00 gets the whole colour scale (a fixed 0-1 scale
    painted it one colour); a loss matrix too, and an undefined cell stays out of it."""
    import numpy as np

    from fedmpi.log.reader import RunLog
    from fedmpi.report.cross_site import plot_cross_site
    from test_report_plots import drawn_figure

    acc = np.array([[0.95, 0.91, 0.99], [0.93, 0.97, 0.90]])
    loss = np.array([[0.2, np.nan, 0.4], [0.3, 0.25, 0.35]])
    log = RunLog(path=str(tmp_path / "log.h5"), attrs={"status": "completed"},
                 config={"name": "x"}, rounds={}, clients={}, events={},
                 arrays={"cross_site/sites": np.array(["a", "b"], dtype=object),
                         "cross_site/models": np.array(["global", "a", "b"], dtype=object),
                         "cross_site/test_accuracy": acc, "cross_site/test_loss": loss})
    fig = drawn_figure(monkeypatch, plot_cross_site, log, tmp_path / "cross_site.png")
    clims = [ax.images[0].get_clim() for ax in fig.axes if ax.images]
    assert clims == [(0.90, 0.99), (0.2, 0.4)], clims


def test_silo_files_are_recorded_as_the_config_names_them(tmp_path, monkeypatch):
    """run_info and the report name a silo file as the config does (a relative path stays
    relative): no machine path in a file a site may share."""
    import yaml

    import fedmpi
    from fedmpi.cli import main
    from fedmpi.job.provenance import read_run_info
    from fedmpi.log.reader import read
    from fedmpi.report import write_report

    monkeypatch.chdir(tmp_path)
    cfg = yaml.safe_load((ROOT / "configs" / "tabular_silos.yaml").read_text())
    cfg["data"]["num_clients"] = 2
    cfg["data"]["silos"].update(path="silos/site_{client}.csv", test="silos/test.csv",
                                validation="silos/validation.csv", names=None)
    cfg["train"]["rounds"] = 1
    Path("c.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["partition", "c.yaml", "--out", "preview", "--export"]) == 0
    log = fedmpi.run("c.yaml", out="run").log_path
    silos = read_run_info(read(log).attrs)["data"]["silos"]
    # the template as written; the test file, which the config makes absolute, by name
    assert silos["path"] == "silos/site_{client}.csv"
    assert [f["path"] for f in silos["files"]][:3] == ["silos/site_0.csv", "silos/site_1.csv",
                                                      "…/test.csv"]
    text = "".join(p.read_text() for p in write_report(log) if p.suffix == ".md")
    assert "`silos/site_0.csv`" in text and "| data.silos.test | …/test.csv |" in text
    assert str(tmp_path / "silos") not in text and str(tmp_path / "silos") not in \
        json.dumps(read_run_info(read(log).attrs), ensure_ascii=False)


def test_a_tracker_that_fails_to_open_leaves_no_run_directory(tmp_path, monkeypatch):
    """An MLflow server that answers with an error (here: the tracker raising as
    MLflowTracker does) stops the run with its one line and leaves nothing — no log.h5,
    config.yaml or model.pt — so the same command runs once the server is fixed."""
    import fedmpi
    import fedmpi.runtime.driver as driver
    from fedmpi.errors import ConfigError

    def refuse(cfg, run_name=None):
        raise ConfigError("logging.mlflow.tracking_uri: MLflow cannot use tracking URI "
                          "'http://x': INTERNAL_ERROR")

    out = tmp_path / "run"
    monkeypatch.setattr(driver, "open_trackers", refuse)
    with pytest.raises(ConfigError, match="INTERNAL_ERROR"):
        fedmpi.run(ROOT / "configs" / "quickstart.yaml", QUICK[3::2], out=out)
    assert not out.exists() or sorted(p.name for p in out.iterdir()) == [], \
        sorted(p.name for p in out.iterdir())
    monkeypatch.undo()
    fedmpi.run(ROOT / "configs" / "quickstart.yaml", QUICK[3::2], out=out)   # no --overwrite


# ------------------------------------------------- 6 user-code errors show their cause
USER_MODEL = '''
from torch import nn

def _load_ops():
    raise RuntimeError("operator torchvision::nms does not exist")

class Net(nn.Module):
    def __init__(self, input_shape, num_classes):
        super().__init__()
        try:
            _load_ops()
        except RuntimeError as exc:
            raise ImportError("cannot import name 'detection' from 'torchvision.models'") from exc
'''


def test_a_failing_user_model_names_the_root_cause_in_its_one_line(tmp_path, monkeypatch,
                                                                    capsys):
    """The torch/torchvision case of the issue: the model's ImportError is raised from the
    real cause, which the one line (no --traceback) names too."""
    from fedmpi.cli import main

    (tmp_path / "mymodel_r4.py").write_text(USER_MODEL)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    args = [str(ROOT / a) if a.startswith("configs/") else a for a in QUICK]
    assert main([*args, "--set", "model.name=mymodel_r4:Net", "--out", "run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "ImportError: cannot import name 'detection'" in err[0], err
    assert err[0].endswith("; root cause: RuntimeError: operator torchvision::nms does not "
                           "exist"), err


def test_root_cause_follows_the_chain_but_not_a_hidden_context():
    from fedmpi.errors import code_error_line, root_cause

    def chained(hide: bool) -> BaseException:
        try:
            try:
                raise OSError("libtorchvision.so: undefined symbol")
            except OSError:
                if hide:
                    raise ValueError("outer") from None
                raise ValueError("outer")
        except ValueError as exc:
            return exc

    shown, hidden = chained(False), chained(True)
    assert isinstance(root_cause(shown), OSError) and root_cause(hidden) is hidden
    assert code_error_line("model", None, shown).endswith(
        "; root cause: OSError: libtorchvision.so: undefined symbol")
    assert "root cause" not in code_error_line("model", None, hidden)


def test_info_lists_torchvision_and_the_optional_packages(monkeypatch):
    """Versions as the installed metadata gives them; a package that is absent says which
    extra installs it; a torchvision that cannot be imported says why."""
    from importlib.metadata import PackageNotFoundError, version

    import fedmpi.cli as cli

    lines = cli.info_lines()
    assert f"torchvision {version('torchvision')}" in lines
    for name in ("matplotlib", "pandas", "pyarrow", "dp-accounting", "cryptography",
                 "tensorboard", "mlflow", "transformers", "peft"):
        try:
            want = f"  {name} {version(name)}"
        except PackageNotFoundError:
            want = f"  {name} not installed (pip install 'fedmpi["
        assert any(line.startswith(want) for line in lines), (name, lines)
    monkeypatch.setitem(sys.modules, "torchvision", None)   # import torchvision fails
    line = cli._torchvision_line()
    assert line.startswith(f"torchvision {version('torchvision')} (cannot be imported: "
                           "ModuleNotFoundError"), line


# ------------------------------------------------------------- 8 the suite's reliability
def test_the_error_line_is_read_by_the_launcher_before_the_abort(monkeypatch):
    """Why rank 0's setup_timeout line could be lost: under mpiexec stderr is a pipe to
    the launcher's proxy, and MPI_Abort reaches that proxy on another channel; handled
    first, it ends the job with the line still in the pipe. guard.end_job now aborts
    only once the pipe's reader has taken every byte. Deterministic: the reader reads
    only when the waiting rank polls (time.sleep), and the abort must find the pipe
    empty with the line read."""
    import threading

    import fedmpi.job.stdio as stdio
    from fedmpi.runtime import guard

    r, w = os.pipe()
    read_text: list[bytes] = []
    go, done = threading.Event(), threading.Event()

    def proxy():                     # the launcher's proxy, reading when asked
        go.wait()
        read_text.append(os.read(r, 65536))
        done.set()

    def poll(seconds):               # the waiting rank's poll lets the proxy read once
        go.set()
        done.wait(10)

    class FakeComm:
        rank = 0
        aborted_with: list[int] = []

        def abort(self, code):
            self.aborted_with = [code, stdio.unread_bytes(w)]
            raise SystemExit(code)

    threading.Thread(target=proxy, daemon=True).start()
    monkeypatch.setattr(stdio.time, "sleep", poll)
    monkeypatch.setattr(sys, "stderr", os.fdopen(w, "w", closefd=False))
    monkeypatch.setattr(guard, "release", lambda: None)
    comm = FakeComm()
    with pytest.raises(SystemExit):
        guard.end_job(None, comm, RuntimeError("start-up: rank 2 did not finish"), 0)
    assert comm.aborted_with == [1, 0], comm.aborted_with
    assert read_text == [b"fedmpi: error: start-up: rank 2 did not finish\n"], read_text
    os.close(r)
    os.close(w)


def test_wait_until_read_gives_up_on_a_reader_that_is_gone_and_ignores_files(tmp_path):
    from fedmpi.job.stdio import unread_bytes, wait_until_read

    r, w = os.pipe()
    os.write(w, b"line\n")
    assert unread_bytes(w) == 5
    assert wait_until_read(w, limit=0.05) is False      # nobody reads: the abort goes on
    os.read(r, 5)
    assert wait_until_read(w, limit=0.05) is True
    with open(tmp_path / "f", "w") as f:
        f.write("x")
        f.flush()
        assert unread_bytes(f.fileno()) == 0 and wait_until_read(f.fileno(), 0.05)
    os.close(r)
    os.close(w)
