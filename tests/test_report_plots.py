"""Report plots a paper can use: uplink and downlink both visible, a panel per chosen metric
with the per-site spread, labels from the run's own components."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import TEST_DEVICE

pytest.importorskip("matplotlib")

BASE = {"name": "plots", "seed": 1, "runtime": {"progress": False, "device": TEST_DEVICE,
                                                "threads": 1},
        "data": {"dataset": "wine", "num_clients": 4, "partition": {"method": "iid"}},
        "model": {"name": "mlp", "mlp": {"hidden": [8]}},
        "train": {"rounds": 3, "local_steps": 2, "batch_size": 8, "optimizer": "adam",
                  "lr": 0.01},
        "eval": {"where": "both", "client_holdout": 0.25,
                 "metrics": ["accuracy", "balanced_accuracy", "auroc"]}}


def _share(png, hex_color: str, tol: float = 0.02) -> float:
    """Share of the image's pixels within ``tol`` of ``hex_color`` (RGB)."""
    from matplotlib.image import imread

    img = imread(png)[..., :3]
    rgb = np.array([int(hex_color[i:i + 2], 16) / 255 for i in (1, 3, 5)])
    return float((np.abs(img - rgb).max(-1) < tol).mean())


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    import fedmpi
    from fedmpi.report import write_report

    out = tmp_path_factory.mktemp("plots")
    result = fedmpi.run(BASE, out=out / "run")
    return {p.name: p for p in write_report(result.log_path, out / "report")}


def test_uplink_and_downlink_are_both_visible(report):
    """FedAvg sends as many bytes up as down: both directions still show (C0 and C1
    each cover a real area of the image, not one line hidden under the other)."""
    png = report["bytes_per_round.png"]
    assert _share(png, "#1f77b4") > 0.03 and _share(png, "#ff7f0e") > 0.03


def drawn_figure(monkeypatch, plot, *args):
    """The matplotlib figure ``plot(*args)`` saves (its text is not in the PNG's pixels)."""
    from fedmpi.report import canvas

    figures = []
    save = canvas.save
    monkeypatch.setattr(canvas, "save", lambda fig, path: (figures.append(fig), save(fig, path))[1])
    assert plot(*args) is not None
    return figures[-1]


def test_every_chosen_metric_and_the_site_spread_are_drawn(report, monkeypatch, tmp_path):
    from fedmpi.log.reader import read
    from fedmpi.report.curves import plot_metrics

    png = report["metrics.png"]
    assert _share(png, "#000000") > 0.002       # the combined and server curves (black)
    log = read(png.parent.parent / "run" / "log.h5")
    fig = drawn_figure(monkeypatch, plot_metrics, log, tmp_path / "m.png")
    titles = [ax.get_title() for ax in fig.axes if ax.get_visible()]
    assert titles == ["accuracy", "balanced accuracy", "AUROC"]
    labels = [t.get_text() for t in fig.legends[0].texts]
    for label in ("client 0", "client 1", "client 2", "client 3", "server test set",
                  "sites combined: pooled (exact)", "sites combined: n-weighted mean",
                  "4 sites: min–max"):
        assert label in labels, label
    # every site's curve in each panel, in its own colour
    for ax in fig.axes[:3]:
        colors = {line.get_label(): line.get_color() for line in ax.get_lines()}
        assert len({colors[f"client {k}"] for k in range(4)}) == 4
    text = report["summary.md"].read_text()
    assert "metrics.png" in text
    log = read(png.parent.parent / "run" / "log.h5")
    assert np.isfinite(log.clients["balanced_accuracy"]).all()


def test_metrics_plot_skipped_when_it_would_repeat_accuracy(tmp_path):
    import fedmpi
    from fedmpi.report import write_report

    result = fedmpi.run(BASE, ["eval.where=server", "eval.metrics=[accuracy]"], out=tmp_path)
    names = [p.name for p in write_report(result.log_path, tmp_path / "report")]
    assert "accuracy.png" in names and "metrics.png" not in names


def test_subtitle_names_the_runs_components():
    from fedmpi.report.derived import run_components

    class Log:
        config = {"data": {"dataset": "wine", "num_clients": 4, "partition": {"method": "iid"}},
                  "model": {"name": "mlp"}, "algorithm": {"name": "fedprox"},
                  "aggregation": {"weighting": "uniform"}, "train": {"optimizer": "adamw",
                                                                      "lr": 0.01},
                  "eval": {"where": "clients"}}

    text = run_components(Log())
    for word in ("wine", "mlp", "fedprox + uniform", "adamw lr 0.01", "iid, 4 clients",
                 "clients' held-out data"):
        assert word in text, word
