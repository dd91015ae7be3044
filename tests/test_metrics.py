"""eval.metrics: values against scikit-learn on the raw predictions, sharded evaluation,
the log rows, the final stdout line, report and compare."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.metrics import balanced_accuracy_score, f1_score, roc_auc_score

from conftest import SMALL, run_fedmpi, run_here
from fedmpi.metrics import Collector

ALL = ("accuracy", "balanced_accuracy", "macro_f1", "auroc")


@pytest.mark.parametrize("classes, outputs", [(2, 2), (4, 4), (3, 6)])
def test_collected_metrics_equal_sklearn(classes, outputs):
    """Batch-wise accumulation gives sklearn's numbers on the whole set; with more
    outputs than classes (FedGPS eval_logits: all) a prediction ≥ C is wrong for
    every class and AUROC uses the softmax of the first C outputs."""
    gen = torch.Generator().manual_seed(classes)
    logits = torch.randn(301, outputs, generator=gen) * 2
    y = torch.randint(0, classes, (301,), generator=gen)
    col = Collector(classes, ALL, torch.device("cpu"))
    for s in range(0, 301, 64):
        col(logits[s:s + 64], y[s:s + 64])
    loss = float(torch.nn.functional.cross_entropy(logits, y, reduction="sum"))
    got = col.scalars(loss, 301)

    pred = logits.argmax(1).numpy()
    yt = y.numpy()
    p = torch.softmax(logits[:, :classes].double(), 1).numpy()
    assert got["test_loss"] == pytest.approx(loss / 301)
    assert got["test_accuracy"] == np.mean(pred == yt)
    assert got["balanced_accuracy"] == pytest.approx(balanced_accuracy_score(yt, np.minimum(pred, classes)))
    if outputs == classes:   # sklearn on the raw predictions
        assert got["macro_f1"] == pytest.approx(f1_score(yt, pred, average="macro"))
    auc = roc_auc_score(yt, p[:, 1]) if classes == 2 else \
        roc_auc_score(yt, p, multi_class="ovr", average="macro")
    assert got["auroc"] == pytest.approx(auc, rel=1e-6)


def test_auroc_single_class_is_nan_and_absent_class_renormalised():
    col = Collector(3, ALL, torch.device("cpu"))
    col(torch.randn(5, 3), torch.zeros(5, dtype=torch.int64))
    assert np.isnan(col.scalars(1.0, 5)["auroc"])
    logits = torch.randn(40, 3, generator=torch.Generator().manual_seed(1))
    y = torch.arange(40) % 2                              # class 2 absent from the test set
    col = Collector(3, ALL, torch.device("cpu"))
    col(logits, y)
    p = torch.softmax(logits.double(), 1).numpy()
    assert col.scalars(1.0, 40)["auroc"] == pytest.approx(roc_auc_score(y, p[:, 1] / p[:, :2].sum(1)))


def _digits_predictions(model_path) -> tuple[np.ndarray, np.ndarray]:
    from fedmpi.data.datasets import load_dataset
    from fedmpi.models import build_model

    data = load_dataset("digits")
    model = build_model("cnn", data.input_shape, 10)
    model.load_state_dict(torch.load(model_path, weights_only=True))
    model.eval()
    with torch.no_grad():
        out = model(data.prepare(data.x_test, train=False))
    return out.argmax(1).numpy(), data.y_test.numpy()


@pytest.mark.mpi
def test_sharded_metrics_logged_per_round_and_shown(tmp_path):
    """-n 3 with eval.sharded: each slice's confusion matrix is reduced; the logged
    balanced accuracy and macro-F1 of the last round are sklearn's on the final model."""
    out = tmp_path / "run"
    proc = run_fedmpi(["run", "configs/quickstart.yaml", *SMALL, "--set", "eval.sharded=true",
                       "--set", "eval.every=2", "--set",
                       "eval.metrics=[accuracy,balanced_accuracy,macro_f1]", "--out", str(out)], n=3)
    from fedmpi.log.reader import read

    log = read(out / "log.h5")
    for name in ("test_accuracy", "balanced_accuracy", "macro_f1"):
        v = log.rounds[name]
        assert np.isnan(v[0]) and np.isfinite(v[1:]).all(), name   # eval rounds 1 and 2 (last)
    pred, y = _digits_predictions(out / "model.pt")
    assert log.rounds["balanced_accuracy"][-1] == pytest.approx(balanced_accuracy_score(y, pred))
    assert log.rounds["macro_f1"][-1] == pytest.approx(f1_score(y, pred, average="macro"))
    assert log.rounds["test_accuracy"][-1] == np.mean(pred == y)
    last = proc.stdout.strip().splitlines()[-1]
    assert last == (f"final test_accuracy={log.rounds['test_accuracy'][-1]:.6f} "
                    f"balanced_accuracy={log.rounds['balanced_accuracy'][-1]:.6f} "
                    f"macro_f1={log.rounds['macro_f1'][-1]:.6f}")

    from fedmpi.compare import compare
    from fedmpi.report.summary import summary_markdown

    summary = summary_markdown(log)
    assert f"| final macro_f1 | {log.rounds['macro_f1'][-1]:.4f} |" in summary
    table = compare([out / "log.h5"])
    assert "final balanced_accuracy (%)" in table.markdown().splitlines()[0]
    assert "macro_f1_mean" in table.csv().splitlines()[0]


def test_default_metrics_keep_the_old_line(tmp_path, capsys):
    capsys.readouterr()
    run_here(["run", "configs/quickstart.yaml", *SMALL, "--set", "train.rounds=1",
              "--out", str(tmp_path / "r")])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("final test_accuracy=") and " " not in last.split("=", 1)[1]
