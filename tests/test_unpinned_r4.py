"""Three properties pinned against computations made here (issue 50, item 3):

* record-level DP: a silo that does not train in a round composes none of that round's
  steps (each silo's logged ε against dp-accounting composed by hand for its own steps);
* ``fedmpi stats``: a site with no value at all in a column is ignored by the all-sites
  minimum, maximum, mean and standard deviation (against pandas on the pooled files);
* missing values are counted per value, not per sample (tabular features and image
  channels with several NaNs in one sample).
"""
from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import yaml

from conftest import TEST_DEVICE
import fedmpi
from fedmpi.cli import main
from fedmpi.log.reader import read

SIGMA, CLIP, DELTA, B, TAU = 1.1, 0.5, 1e-5, 16, 2


# ------------------------------------------------------- record-level DP, idle silos
@pytest.mark.parametrize("kind", ["rdp", "pld"])
def test_record_dp_a_silo_that_does_not_train_composes_nothing(tmp_path, kind):
    """6 silos of unequal size (Dirichlet), 2 train per round for 5 rounds, τ = 2 steps each.
    Who trained is read from the per-client training loss (finite only where a silo ran its
    local loop); every silo's ε after round r is dp-accounting's for q_k = B/n_k composed
    2·(rounds ≤ r it trained) times, and 0 before its first round."""
    dpa = pytest.importorskip("dp_accounting")
    from dp_accounting import pld, rdp

    cfg = {"name": "idle", "seed": 3,
           "data": {"dataset": "digits", "num_clients": 6,
                    "partition": {"method": "dirichlet", "alpha": 0.5},
                    "validation": {"fraction": 0.0}},
           "model": {"name": "mlp", "mlp": {"hidden": [8]}},
           "train": {"rounds": 5, "clients_per_round": 2, "local_steps": TAU, "batch_size": B,
                     "lr": 0.05},
           "eval": {"every": 5},
           "privacy": {"dp": {"level": "record", "accountant": kind, "noise_multiplier": SIGMA,
                              "clip": CLIP, "delta": DELTA}},
           "runtime": {"progress": False, "threads": 1, "device": TEST_DEVICE}}
    fedmpi.run(cfg, out=tmp_path / "r", overwrite=True)
    log = read(tmp_path / "r" / "log.h5")
    trained = np.isfinite(log.clients["train_loss"])            # [R, K]
    n = np.asarray(log.clients["num_samples"], dtype=float)
    rounds_trained = trained.cumsum(axis=0)
    # the property is exercised: every silo sat out a round, and they did not all train
    # equally often (a rule that composed every silo every round would give other ε)
    assert (~trained).any(axis=0).all()
    assert len(set(rounds_trained[-1].tolist())) > 1
    assert len(set(n.tolist())) == 6

    def by_hand(k: int, steps: int) -> float:
        if steps == 0:
            return 0.0
        acc = pld.PLDAccountant() if kind == "pld" else rdp.RdpAccountant()
        acc.compose(dpa.PoissonSampledDpEvent(min(1.0, B / n[k]), dpa.GaussianDpEvent(SIGMA)),
                    steps)
        return float(acc.get_epsilon(DELTA))

    for r in range(5):
        want = [by_hand(k, TAU * int(rounds_trained[r, k])) for k in range(6)]
        np.testing.assert_allclose(log.clients["epsilon"][r], want, rtol=1e-10, err_msg=f"r{r}")
        assert log.rounds["epsilon"][r] == pytest.approx(max(want), rel=1e-10)
    # a silo idle in round r keeps its ε of round r - 1
    idle = ~trained[1:]
    np.testing.assert_array_equal(log.clients["epsilon"][1:][idle],
                                  log.clients["epsilon"][:-1][idle])


# --------------------------------------------------------------- fedmpi stats
FEATURES = ["age", "bmi", "glucose", "smoker"]


def _write_sites(root) -> list[pd.DataFrame]:
    """Three sites; site 1 has no glucose value at all (a column it never records), site 2
    has rows with two or three NaNs among the four features."""
    rng = np.random.default_rng(50)
    root.mkdir(parents=True, exist_ok=True)
    frames = []
    for k, n in enumerate((30, 20, 40)):
        df = pd.DataFrame({"age": rng.normal(40 + 10 * k, 9, n), "bmi": rng.normal(26, 3, n),
                           "glucose": rng.lognormal(4.6, 0.2, n) + 300 * k,
                           "smoker": rng.integers(0, 2, n).astype(float)}).astype(np.float32)
        if k == 1:
            df["glucose"] = np.nan      # the site's extreme would be 300+: it must not count
        if k == 2:
            several = rng.random(n) < 0.3
            df.loc[several, ["age", "bmi"]] = np.nan
            df.loc[rng.random(n) < 0.2, ["age", "glucose", "smoker"]] = np.nan
        df["label"] = rng.integers(0, 2, n)
        df.to_csv(root / f"site_{k}.csv", index=False, float_format="%.9g")
        frames.append(pd.read_csv(root / f"site_{k}.csv"))
    frames[0].dropna().to_csv(root / "test.csv", index=False, float_format="%.9g")
    return frames


@pytest.fixture(scope="module")
def sparse_sites(tmp_path_factory):
    root = tmp_path_factory.mktemp("sparse")
    frames = _write_sites(root)
    cfg = {"name": "sparse", "runtime": {"progress": False, "device": TEST_DEVICE,
                                         "threads": 1, "out_dir": str(root / "runs")},
           "data": {"num_clients": 3, "partition": {"method": "silos"},
                    "silos": {"path": str(root / "site_{client}.csv"),
                              "test": str(root / "test.csv")}},
           "model": {"name": "mlp", "mlp": {"hidden": [4]}}}
    (root / "c.yaml").write_text(yaml.safe_dump(cfg))
    out = root / "stats"
    assert main(["stats", str(root / "c.yaml"), "--out", str(out)]) == 0
    return frames, json.loads((out / "stats.json").read_text()), (out / "stats.md").read_text()


def _pandas(frame: pd.DataFrame) -> pd.DataFrame:
    x = frame[FEATURES].astype(np.float32).astype(np.float64)
    return pd.DataFrame({"values": x.count(), "missing": x.isna().sum(), "mean": x.mean(),
                         "std": x.std(), "min": x.min(), "max": x.max()})


def _got(site: dict) -> pd.DataFrame:
    return pd.DataFrame([{k: (np.nan if f[k] is None else f[k])
                          for k in ("values", "missing", "mean", "std", "min", "max")}
                         for f in site["features"]], index=[f["name"] for f in site["features"]])


def test_stats_all_sites_ignore_a_site_without_values_in_a_column(sparse_sites):
    frames, report, _ = sparse_sites
    pooled = _pandas(pd.concat(frames))
    got = _got(report["total"])
    pd.testing.assert_frame_equal(got, pooled, check_dtype=False, rtol=1e-9)
    # the site itself reports the column as empty, and the pooled glucose is that of
    # sites 0 and 2 alone
    site1 = _got(report["sites"][1]).loc["glucose"]
    assert site1["values"] == 0 and site1["missing"] == 20
    assert np.isnan(site1[["mean", "std", "min", "max"]].astype(float)).all()
    stats = ["values", "mean", "std", "min", "max"]
    both = _pandas(pd.concat([frames[0], frames[2]])).loc["glucose", stats]
    pd.testing.assert_series_equal(got.loc["glucose", stats], both, check_dtype=False,
                                   rtol=1e-9, check_names=False)


def test_stats_count_missing_values_per_value_not_per_sample(sparse_sites):
    """Site 2's rows with two or three NaNs count two or three missing values."""
    frames, report, md = sparse_sites
    for site, frame in zip(report["sites"], frames):
        want = frame[FEATURES].isna().sum()
        assert [f["missing"] for f in site["features"]] == want.tolist()
    x2 = frames[2][FEATURES]
    per_value, per_sample = int(x2.isna().sum().sum()), int(x2.isna().any(axis=1).sum())
    assert per_value > per_sample   # the data tell the two counts apart
    assert f"| site_2 | 2 | 40 | {(frames[2]['label'] == 0).sum()} | " \
           f"{(frames[2]['label'] == 1).sum()} | {per_value} |" in md
    total = int(pd.concat(frames)[FEATURES].isna().sum().sum())
    assert f"| **all sites** | — | 90 |" in md and md.count(f"| {total} |") >= 1


def test_stats_count_missing_pixels_per_value_in_each_channel(tmp_path, monkeypatch):
    """Images from a loader: a sample with NaN pixels in two channels counts every NaN pixel
    in its channel (numpy's isnan sum), and the channel's mean/std/min/max skip them."""
    mod = tmp_path / "nan_images_r4.py"
    mod.write_text(
        "import numpy as np\n"
        "def load(k):\n"
        "    rng = np.random.default_rng(k)\n"
        "    x = rng.normal(k, 1 + k, size=(7 + k, 3, 4, 4)).astype(np.float32)\n"
        "    x[0, 0, :2, :3] = np.nan\n"          # six pixels of channel 0 in one sample
        "    x[0, 2, 1, 1] = np.nan\n"            # and one of channel 2 in the same sample
        "    x[3, 0, 3, 3] = np.nan\n"
        "    if k == 1:\n"
        "        x[:, 1] = np.nan\n"              # site 1 has no value in channel 1
        "    return x, np.arange(len(x)) % 2\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from fedmpi.data.tabular import write_table

    write_table(tmp_path / "test.h5", np.zeros((2, 48)), np.arange(2) % 2)
    cfg = {"name": "img", "runtime": {"out_dir": str(tmp_path)},
           "data": {"num_clients": 2, "partition": {"method": "silos"},
                    "silos": {"loader": "nan_images_r4:load", "test": str(tmp_path / "test.h5")}}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["stats", str(tmp_path / "c.yaml"), "--out", str(tmp_path / "s")]) == 0
    report = json.loads((tmp_path / "s" / "stats.json").read_text())
    import nan_images_r4

    xs = [nan_images_r4.load(k)[0].astype(np.float64) for k in range(2)]
    for site, x in [*zip(report["sites"], xs), (report["total"], np.concatenate(xs))]:
        for c, f in enumerate(site["features"]):
            v = x[:, c].ravel()
            assert f["missing"] == int(np.isnan(v).sum())
            assert f["values"] == int((~np.isnan(v)).sum())
            if f["values"]:
                np.testing.assert_allclose([f["mean"], f["std"], f["min"], f["max"]],
                                           [np.nanmean(v), np.nanstd(v, ddof=1), np.nanmin(v),
                                            np.nanmax(v)], rtol=1e-9)
    assert report["sites"][0]["features"][0]["missing"] == 7
