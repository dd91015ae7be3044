"""What a consortium reviews (issue 38): `fedmpi stats` against pandas on the sites' own CSV
files (in process, under mpiexec with each rank opening only its sites' files, with DP noise
calibrated by dp-accounting), and the sites' names in the report's plots and tables."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import h5py
import numpy as np
import pandas as pd
import pytest
import yaml

from conftest import OPEN_AUDIT, ROOT, TEST_DEVICE, mpiexec_path, set_dotted
from fedmpi.cli import main
from fedmpi.config.schema import config_from_dict
from fedmpi.errors import ConfigError

FEATURES = ["age", "bmi", "glucose", "smoker"]
#: (samples, labels present) per site: site 2 lacks class 0 and 2, only site 1 has class 2
SITES = [(40, [0, 1]), (25, [0, 1, 2]), (60, [1])]
NAMES = ["Mercy", "St Jude", "Charite"]


def write_sites(root) -> list[pd.DataFrame]:
    """Three hospitals' CSVs with missing values (float32 values written to round-trip)."""
    rng = np.random.default_rng(38)
    root.mkdir(parents=True, exist_ok=True)
    frames = []
    for k, (n, classes) in enumerate(SITES):
        df = pd.DataFrame({"age": rng.normal(50 + 8 * k, 12, n), "bmi": rng.normal(27, 4, n),
                           "glucose": rng.lognormal(4.6, 0.25, n),
                           "smoker": rng.integers(0, 2, n).astype(float)}).astype(np.float32)
        df.loc[rng.random(n) < 0.15, "bmi"] = np.nan
        if k == 1:
            df.loc[rng.random(n) < 0.3, "glucose"] = np.nan
        df["label"] = rng.choice(classes, n)
        df.to_csv(root / f"hospital_{k}.csv", index=False, float_format="%.9g")
        frames.append(pd.read_csv(root / f"hospital_{k}.csv"))
    frames[0].dropna().to_csv(root / "test.csv", index=False, float_format="%.9g")
    return frames


def silo_config(root, **extra) -> dict:
    cfg = {"name": "hospitals", "seed": 0,
           "runtime": {"progress": False, "device": TEST_DEVICE, "threads": 1,
                       "out_dir": str(root / "runs")},
           "data": {"num_clients": len(SITES), "partition": {"method": "silos"},
                    "silos": {"path": str(root / "hospital_{client}.csv"),
                              "test": str(root / "test.csv")}},
           "model": {"name": "mlp", "mlp": {"hidden": [8]}},
           "train": {"rounds": 2, "local_steps": 1, "batch_size": 8, "lr": 0.05}}
    return set_dotted(cfg, extra)


@pytest.fixture(scope="module")
def sites(tmp_path_factory):
    root = tmp_path_factory.mktemp("hospitals")
    frames = write_sites(root)
    config = root / "hospitals.yaml"
    config.write_text(yaml.safe_dump(silo_config(root)))
    return root, frames, config


def expected(frame: pd.DataFrame) -> dict:
    """pandas' summaries of one site (or of the concatenated sites), of the float32 values
    fedmpi reads (fedmpi.data.tabular)."""
    x = frame[FEATURES].astype(np.float32).astype(np.float64)
    return {"samples": len(frame),
            "classes": [int((frame["label"] == j).sum()) for j in range(3)],
            "values": x.count().tolist(), "missing": x.isna().sum().tolist(),
            "mean": x.mean().tolist(), "std": x.std().tolist(),   # ddof=1
            "min": x.min().tolist(), "max": x.max().tolist()}


def check_site(site: dict, want: dict, rtol: float = 1e-9) -> None:
    assert site["samples"] == want["samples"]
    assert site["classes"] == want["classes"]
    feats = site["features"]
    assert [f["name"] for f in feats] == FEATURES
    for key in ("values", "missing"):
        assert [f[key] for f in feats] == want[key], key
    for key in ("mean", "std", "min", "max"):
        np.testing.assert_allclose([f[key] for f in feats], want[key], rtol=rtol, err_msg=key)


def test_stats_match_pandas_on_the_silo_files(sites, capsys):
    root, frames, config = sites
    out = root / "stats"
    assert main(["stats", str(config), "--out", str(out)]) == 0
    assert capsys.readouterr().out.split() == [str(out / "stats.md"), str(out / "stats.json")]
    report = json.loads((out / "stats.json").read_text())
    assert report["kind"] == "tabular" and report["sample_shape"] == [4]
    assert report["num_classes"] == 3 and report["privacy"] is None
    assert [s["name"] for s in report["sites"]] == ["hospital_0", "hospital_1", "hospital_2"]
    for site, frame in zip(report["sites"], frames):
        check_site(site, expected(frame))
    check_site(report["total"], expected(pd.concat(frames)))   # the union, not a mean of sites
    md = (out / "stats.md").read_text()
    assert "| hospital_1 | 1 | 25 |" in md and "| bmi | **all sites** |" in md
    # an existing report is never replaced without --overwrite
    before = (out / "stats.json").read_bytes()
    assert main(["stats", str(config), "--out", str(out)]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert (out / "stats.json").read_bytes() == before
    assert main(["stats", str(config), "--out", str(out), "--overwrite",
                 "--set", f"data.silos.names={NAMES}"]) == 0
    assert "| St Jude | 1 | 25 |" in (out / "stats.md").read_text()


# Every rank records the files it opens under the sites' folder.
AUDIT = OPEN_AUDIT + r'''
from fedmpi.cli import main
code = main(["stats", config, "--out", out])
json.dump(sorted(opened), open(os.path.join(out, f"opened_{rank}.json"), "w"))
sys.exit(code)
'''


@pytest.mark.mpi
def test_stats_under_mpiexec_equal_in_process_and_each_rank_reads_only_its_sites(sites, tmp_path):
    """Client k on rank 1 + k mod 2: rank 0 opens no site's file, ranks 1 and 2 only theirs;
    the summaries are the in-process ones, bit for bit."""
    mpi = mpiexec_path()
    if mpi is None:
        pytest.skip("mpiexec not found")
    root, frames, config = sites
    out = tmp_path / "n3"
    out.mkdir()
    proc = subprocess.run([mpi, "-n", "3", sys.executable, "-c", AUDIT, str(root), str(config),
                           str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    opened = [[p for p in json.loads((out / f"opened_{r}.json").read_text())
               if p.startswith("hospital_")] for r in range(3)]
    assert opened == [[], ["hospital_0.csv", "hospital_2.csv"], ["hospital_1.csv"]]
    alone = tmp_path / "n1"
    assert main(["stats", str(config), "--out", str(alone)]) == 0
    assert json.loads((out / "stats.json").read_text()) == \
        json.loads((alone / "stats.json").read_text())


def test_stats_noise_is_the_gaussian_mechanism_dp_accounting_calibrates(sites, tmp_path):
    """The stated ε holds by dp-accounting's analytic Gaussian mechanism for the documented
    sensitivities; the noise has that scale; min and max are withheld."""
    import dp_accounting

    from fedmpi.consortium.noise import calibrate
    from fedmpi.consortium.summaries import RowLayout

    root, frames, config = sites
    eps, delta, lo, hi = 2.0, 1e-6, 0.0, 200.0
    out = tmp_path / "dp"
    assert main(["stats", str(config), "--out", str(out), "--epsilon", str(eps),
                 "--delta", str(delta), "--clip", str(lo), str(hi)]) == 0
    report = json.loads((out / "stats.json").read_text())
    p = report["privacy"]
    blocks = 5                                             # count, classes, missing, sum, sum_sq
    sigma = math.sqrt(blocks) * dp_accounting.get_sigma_gaussian(eps, delta)
    r, h = (hi - lo) / 2, len(FEATURES)
    want = {"count": 1, "classes": 1, "missing": math.sqrt(h), "sum": r * math.sqrt(h),
            "sum_sq": r * r * math.sqrt(h)}
    assert p["noise_multiplier"] == pytest.approx(sigma, rel=1e-9)
    assert p["epsilon"] == pytest.approx(eps, abs=1e-6)
    assert dp_accounting.get_epsilon_gaussian(sigma / math.sqrt(blocks), delta) == \
        pytest.approx(eps, abs=1e-6)
    assert p["sensitivities"] == pytest.approx(want)
    for site in (*report["sites"], report["total"]):
        assert all(f["min"] is None and f["max"] is None for f in site["features"])
    # the noise of each block has std σ·Δ_b (4000 draws of a site's zero row)
    privacy = calibrate(eps, delta, (lo, hi))
    layout = RowLayout(3, h)
    rng = np.random.default_rng(0)
    draws = np.stack([privacy.add_noise(np.zeros(layout.width), layout, 1, rng)
                      for _ in range(4000)])
    for block, delta_b in want.items():
        noise = draws[:, layout.span(block)]
        assert noise.std() == pytest.approx(sigma * delta_b, rel=0.05), block
        assert abs(noise.mean()) < 0.1 * sigma * delta_b, block


def test_stats_with_noise_have_totals_that_add_up(sites, tmp_path):
    """Under DP (large noise: ε = 0.5 at three small sites) every count shown is a whole
    number ≥ 0 and the "all sites" row is the sum of the site rows, in stats.json and in
    stats.md's table (issue 48: totals that did not add up to their rows)."""
    root, frames, config = sites
    out = tmp_path / "dp"
    assert main(["stats", str(config), "--out", str(out), "--epsilon", "0.5",
                 "--clip", "0", "200"]) == 0
    report = json.loads((out / "stats.json").read_text())
    sites_, total = report["sites"], report["total"]
    counts = [s["samples"] for s in sites_] + [c for s in sites_ for c in s["classes"]]
    counts += [f[k] for s in sites_ for f in s["features"] for k in ("values", "missing")]
    assert all(c == int(c) and c >= 0 for c in counts), counts
    assert total["samples"] == sum(s["samples"] for s in sites_)
    assert total["classes"] == [sum(c) for c in zip(*(s["classes"] for s in sites_))]
    for key in ("values", "missing"):
        assert [f[key] for f in total["features"]] == \
            [sum(v) for v in zip(*([f[key] for f in s["features"]] for s in sites_))], key
    md = (out / "stats.md").read_text().split("## Sites")[1].split("## Per")[0]
    rows = [line.split("|")[3:-1] for line in md.splitlines() if line.startswith("| ")][1:]
    *each, everyone = [[int(v) for v in row] for row in rows]
    assert everyone == [sum(v) for v in zip(*each)], rows
    assert "all-sites row is the sum" in (out / "stats.md").read_text()


def test_stats_with_noise_summarise_the_clipped_values(sites, tmp_path):
    """With a very large ε the noise vanishes and what remains is pandas' summary of the
    values clipped to the declared range (age clipped at 50 changes every site's mean)."""
    root, frames, config = sites
    lo, hi = 20.0, 50.0
    out = tmp_path / "clip"
    assert main(["stats", str(config), "--out", str(out), "--epsilon", "1e6",
                 "--clip", str(lo), str(hi)]) == 0
    report = json.loads((out / "stats.json").read_text())
    for site, frame in zip(report["sites"], frames):
        clipped = frame[FEATURES].clip(lo, hi)
        assert site["samples"] == pytest.approx(len(frame), abs=0.05)
        np.testing.assert_allclose([f["mean"] for f in site["features"]], clipped.mean(),
                                   atol=0.05)
        np.testing.assert_allclose([f["std"] for f in site["features"]], clipped.std(), atol=0.5)
        assert clipped["age"].mean() != pytest.approx(frame["age"].mean(), abs=1.0)


def test_stats_bad_input_is_one_line(sites, tmp_path, capsys):
    root, frames, config = sites
    assert main(["stats", str(config), "--out", str(tmp_path / "a"), "--epsilon", "1"]) == 2
    assert "--clip" in capsys.readouterr().err
    assert main(["stats", str(config), "--out", str(tmp_path / "b"),
                 "--set", f"data.silos.path={tmp_path}/missing_{{client}}.csv"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "missing_0.csv" in err
    assert not (tmp_path / "b" / "stats.json").exists()


def test_stats_say_when_the_sites_disagree_on_their_columns(sites, tmp_path):
    """Site 2 with its columns in another order: named, features then by position."""
    root, frames, _ = sites
    other = tmp_path / "swapped"
    other.mkdir()
    for k, frame in enumerate(frames):
        cols = ["bmi", "age", "glucose", "smoker", "label"] if k == 2 else list(frame.columns)
        frame[cols].to_csv(other / f"hospital_{k}.csv", index=False, float_format="%.9g")
    frames[0].to_csv(other / "test.csv", index=False)
    config = other / "c.yaml"
    config.write_text(yaml.safe_dump(silo_config(other)))
    assert main(["stats", str(config), "--out", str(other / "s")]) == 0
    report = json.loads((other / "s" / "stats.json").read_text())
    assert "feature columns differ (first at column 0" in report["notes"][0]
    assert [f["name"] for f in report["total"]["features"]] == ["x0", "x1", "x2", "x3"]


def test_stats_of_pooled_images_per_channel(tmp_path):
    """A pooled image config: each client of the partition a site; per channel the mean,
    std and range of all its pixels, as numpy computes them from the partition."""
    from fedmpi.data.build import build_partition, load_pool
    from fedmpi.usercode import UserCode

    cfg = {"name": "digits", "data": {"dataset": "digits", "num_clients": 3,
                                      "partition": {"method": "iid"}},
           "runtime": {"out_dir": str(tmp_path)}}
    (tmp_path / "d.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["stats", str(tmp_path / "d.yaml")]) == 0
    report = json.loads((tmp_path / "digits" / "stats" / "stats.json").read_text())
    built = config_from_dict(cfg)
    pool = load_pool(built)
    part = build_partition(built, pool, UserCode().data_needs(built))
    assert report["kind"] == "images" and report["sample_shape"] == list(pool.x_train.shape[1:])
    for k, site in enumerate(report["sites"]):
        x = pool.x_train[part.client_indices[k]].double().numpy()
        assert site["samples"] == len(x)
        ch = site["features"][0]
        assert ch["values"] == x.size
        np.testing.assert_allclose([ch["mean"], ch["std"], ch["min"], ch["max"]],
                                   [x.mean(), x.std(ddof=1), x.min(), x.max()], rtol=1e-9)


# ------------------------------------------------------------------ site names
def test_site_names_key_and_rule(sites):
    root, _, _ = sites
    from fedmpi.data.silos import site_names

    base = silo_config(root)
    assert site_names(config_from_dict(base)) == ["hospital_0", "hospital_1", "hospital_2"]
    assert site_names(config_from_dict(base, [f"data.silos.names={NAMES}"])) == NAMES
    assert site_names(config_from_dict(base, [f"data.silos.path={root}/{{client}}/x.csv"])) == \
        ["client 0", "client 1", "client 2"]
    for bad, match in (("[a, b]", "one name per client"), ("[a, a, b]", "'a' twice"),
                       ('[a, "b|c", d]', "without a vertical bar")):
        with pytest.raises(ConfigError, match=match):
            config_from_dict(base, [f"data.silos.names={bad}"])


def test_report_names_every_site(sites, tmp_path, monkeypatch):
    """A silo run evaluated by its sites: the names reach the log (run_info) and label the
    per-site table of summary.md (its values are the log's), the metrics legend and the
    heatmaps' site axis; eval.where and the names are in the config table."""
    import fedmpi
    from fedmpi.report import write_report
    from fedmpi.report.curves import plot_metrics
    from fedmpi.report.heatmaps import plot_client_weights

    from test_report_plots import drawn_figure

    root, _, config = sites
    filled = tmp_path / "filled"          # training refuses missing values (it does not impute)
    filled.mkdir()
    for src in root.glob("*.csv"):
        pd.read_csv(src).fillna(0.0).to_csv(filled / src.name, index=False)
    cfg = silo_config(filled, **{"data.silos.names": NAMES, "eval.where": "clients",
                               "eval.client_holdout": 0.25,
                               "eval.metrics": ["accuracy", "balanced_accuracy"]})
    result = fedmpi.run(cfg, out=tmp_path / "run")
    with h5py.File(result.log_path) as f:
        info = json.loads(f.attrs["run_info"])
        acc = f["clients/test_accuracy"][-1]
        n = f["clients/num_samples"][()]
    assert info["data"]["silos"]["names"] == NAMES
    files = {p.name: p for p in write_report(result.log_path, tmp_path / "report")}
    text = files["summary.md"].read_text()
    for k, name in enumerate(NAMES):
        assert f"| {name} | {k} | {n[k]} |" in text
        row = next(line for line in text.splitlines() if line.startswith(f"| {name} | {k} |"))
        assert f"| {acc[k]:.4f} |" in row
    assert "| eval.where | clients |" in text and "| data.silos.names |" in text
    fig = drawn_figure(monkeypatch, plot_metrics, result.log_path, tmp_path / "m.png")
    assert set(NAMES) <= {t.get_text() for t in fig.legends[0].texts}
    fig = drawn_figure(monkeypatch, plot_client_weights, result.log_path, tmp_path / "w.png")
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == NAMES
