"""examples/ run as documented: the custom model + data + method file under mpiexec -n 3,
and the fedmpi.run script that reads its log into pandas (in this process)."""
from __future__ import annotations

import ast
import os
import subprocess
import sys

from conftest import ROOT, mpiexec_path, run_fedmpi, run_here

import pytest


def _run(cmd: list[str], cwd) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.mpi
def test_custom_method_example_under_mpiexec(tmp_path):
    mpi = mpiexec_path()
    if mpi is None:
        pytest.skip("mpiexec not found")
    proc = _run([mpi, "-n", "3", sys.executable, str(ROOT / "examples" / "custom_method.py")],
                cwd=tmp_path)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("final")]
    assert len(line) == 1                                 # printed by rank 0 only
    metrics = ast.literal_eval(line[0].split("final ", 1)[1].split(" log:")[0])
    assert set(metrics) == {"test_accuracy", "balanced_accuracy", "macro_f1"}
    assert metrics["test_accuracy"] > 0.8                 # wine is easy; chance is 0.4
    from fedmpi.log.reader import read

    log = read(tmp_path / "runs" / "custom_method" / "log.h5")
    assert log.config["algorithm"]["name"] == "__main__:ClippedFedAvg"
    assert log.config["model"]["name"] == "__main__:Net"
    assert log.config["algorithm"]["params"] == {"max_norm": 2.0}
    # ~50 lines of user code
    assert len((ROOT / "examples" / "custom_method.py").read_text().splitlines()) <= 70


def test_custom_method_example_by_import_path(tmp_path):
    run_here(["run", "configs/quickstart.yaml", "--set", "model.name=examples.custom_method:Net",
              "--set", "data.dataset=examples.custom_method:wine",
              "--set", "data.partition.min_size=5",
              "--set", "algorithm.name=examples.custom_method:ClippedFedAvg",
              "--set", "algorithm.params.max_norm=1", "--set", "train.rounds=2",
              "--set", "runtime.progress=false", "--out", str(tmp_path / "r")])


def test_api_to_pandas_example(tmp_path, monkeypatch, capsys):
    """The script as ``python examples/api_to_pandas.py`` runs it (in this process)."""
    import runpy

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    capsys.readouterr()
    runpy.run_path(str(ROOT / "examples" / "api_to_pandas.py"), run_name="__main__")
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["round", "test_accuracy", "balanced_accuracy", "macro_f1",
                                "auroc", "train_loss"]
    assert len(lines) == 1 + 5 + 1 and lines[-1].startswith("mean weight per client:")


@pytest.mark.mpi
def test_lora_example_under_mpiexec(tmp_path):
    """examples/lora_transformer.py as documented at -n 3: only the LoRA adapters and the
    head travel (4 bytes × trainable parameters × participants), every rank builds the same
    frozen ViT, and model.pt holds the whole model."""
    pytest.importorskip("peft", reason="the LoRA example needs the [peft] extra")
    torch = pytest.importorskip("torch")
    proc = run_fedmpi(["run", str(ROOT / "configs" / "quickstart.yaml"), "--out", str(tmp_path),
                       "--set", "model.name=examples.lora_transformer:vit_lora",
                       "--set", "train.rounds=1", "--set", "train.local_epochs=1",
                       "--set", "data.num_clients=4", "--set", "train.clients_per_round=2",
                       "--set", "runtime.progress=false"], n=3)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import h5py

    sys.path.insert(0, str(ROOT))
    from examples.lora_transformer import vit_lora

    model = vit_lora((1, 8, 8), 10)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert trainable < sum(p.numel() for p in model.parameters()) // 10
    with h5py.File(tmp_path / "log.h5", "r") as f:
        assert list(f["rounds/bytes_up_encoded"][:]) == [4 * trainable * 2]
    state = torch.load(tmp_path / "model.pt", weights_only=True)
    assert sum(v.numel() for v in state.values()) == sum(v.numel() for v in model.state_dict().values())
