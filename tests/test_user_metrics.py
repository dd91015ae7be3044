"""eval.metrics by import path: fn(labels, probabilities) -> float, logged as /rounds/fn
(and per site with eval.where), with the value scikit-learn gives on the final model."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import TEST_DEVICE

MODULE = '''
import numpy as np
from sklearn.metrics import average_precision_score
from sklearn.preprocessing import label_binarize

def auprc(labels, probs):
    return average_precision_score(label_binarize(labels, classes=range(probs.shape[1])), probs,
                                   average="macro")

def brier(labels, probs):
    return float(((probs - np.eye(probs.shape[1])[labels]) ** 2).sum(1).mean())
'''

BASE = {"name": "usermetric", "seed": 4, "runtime": {"progress": False, "device": TEST_DEVICE,
                                                     "threads": 1},
        "data": {"dataset": "wine", "num_clients": 3, "partition": {"method": "iid"}},
        "model": {"name": "mlp", "mlp": {"hidden": [8]}},
        "train": {"rounds": 2, "local_steps": 3, "batch_size": 8},
        "eval": {"metrics": ["accuracy", "usermetrics_i27:auprc", "usermetrics_i27:brier"]}}


def test_user_metrics_are_logged_like_builtins(tmp_path, monkeypatch):
    (tmp_path / "usermetrics_i27.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    import fedmpi
    from fedmpi.data.tabular import load_embedded
    from fedmpi.log.reader import read
    from sklearn.metrics import average_precision_score
    from sklearn.preprocessing import label_binarize

    result = fedmpi.run(BASE, out=tmp_path / "run")
    log = read(result.log_path)
    assert set(result.metrics) == {"test_accuracy", "auprc", "brier"}
    data = load_embedded("wine")
    state = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    x = data.prepare(data.x_test, train=False)
    h = torch.relu(x @ state["body.1.weight"].T + state["body.1.bias"])
    p = torch.softmax(h @ state["classifier.weight"].T + state["classifier.bias"], 1).double().numpy()
    y = data.y_test.numpy()
    auprc = average_precision_score(label_binarize(y, classes=[0, 1, 2]), p, average="macro")
    brier = np.mean(np.sum((p - np.eye(3)[y]) ** 2, axis=1))
    assert log.rounds["auprc"][-1] == pytest.approx(auprc, abs=1e-6)
    assert log.rounds["brier"][-1] == pytest.approx(brier, abs=1e-6)
    assert result.metrics["brier"] == log.rounds["brier"][-1]
    # reported like the built-ins: summary.md (one format for every metric), fedmpi compare
    from fedmpi.compare import compare
    from fedmpi.report.summary import summary_markdown
    assert f"| final brier | {brier:.4f} |" in summary_markdown(log)
    assert "| final auprc | final brier |" in compare([result.log_path]).markdown()


def test_unimportable_user_metric_is_a_config_error(tmp_path):
    import fedmpi
    from fedmpi.errors import ConfigError

    with pytest.raises(ConfigError, match=r"eval\.metrics.*no_such_module_i27"):
        fedmpi.run(BASE, ["eval.metrics=[accuracy, no_such_module_i27:f]"], out=tmp_path)


def test_fedmpi_check_resolves_user_metrics(tmp_path, capsys):
    import yaml
    from fedmpi.cli import main

    (tmp_path / "c.yaml").write_text(yaml.safe_dump({"eval": {"metrics": ["math:nope"]}}))
    assert main(["check", str(tmp_path / "c.yaml")]) == 2
    assert "eval.metrics" in capsys.readouterr().err
