"""The framework's config sections are typed (issue 34): ``mypy`` flags a read of a key that
does not exist (``cfg.train.lrr``, ``cfg.trian.lr``) and accepts the keys that do, with
their declared types. mypy runs in process on a snippet, with fedmpi's config package
analysed and every other fedmpi module skipped (their names are Any), so it takes seconds."""
from __future__ import annotations

import re

import pytest

from conftest import ROOT

api = pytest.importorskip("mypy.api")

GOOD = """\
from fedmpi.config.core import Config
from fedmpi.config.framework import DPConfig
from fedmpi.config.schema import load_config


def lr(cfg: Config) -> float:
    return cfg.train.lr + cfg.data.partition.alpha


def dp(cfg: Config) -> DPConfig:
    return cfg.privacy.dp


def steps(cfg: Config) -> int | None:
    return cfg.train.local_steps


def block(cfg: Config) -> float:
    return float(cfg.get("algorithm.fedprox.mu"))   # a component's block: by key


betas: list[float] = load_config(None).train.betas
"""

#: (line, what mypy must say) for each bad read
BAD = {
    "cfg.train.lrr": '"TrainConfig" has no attribute "lrr"',
    "cfg.trian.lr": '"Config" has no attribute "trian"',
    "cfg.privacy.dp.noise_multplier": '"DPConfig" has no attribute "noise_multplier"',
    "cfg.ecgr.beta": '"Config" has no attribute "ecgr"',
    "cfg.algorithm.fedprox.mu": '"AlgorithmConfig" has no attribute "fedprox"',
}


def _mypy(tmp_path, files: dict[str, str]) -> tuple[str, int]:
    ini = tmp_path / "mypy.ini"
    ini.write_text(f"[mypy]\npython_version = 3.10\nmypy_path = {ROOT}\n"
                   f"cache_dir = {tmp_path / 'cache'}\nfollow_imports = skip\n"
                   "ignore_missing_imports = True\n"
                   "[mypy-fedmpi.config.*]\nfollow_imports = normal\n")
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    out, err, status = api.run(["--config-file", str(ini), "--no-error-summary",
                                *(str(tmp_path / name) for name in files)])
    return out + err, status


def test_mypy_flags_misspelt_framework_keys_and_accepts_the_real_ones(tmp_path):
    bad = "from fedmpi.config.core import Config\n\n\n" + "".join(
        f"def read{i}(cfg: Config) -> object:\n    return {read}\n\n\n"
        for i, read in enumerate(BAD))
    out, status = _mypy(tmp_path, {"good.py": GOOD, "bad.py": bad})
    assert "good.py" not in out, out
    assert status == 1, out
    errors = re.findall(r"bad\.py:(\d+): error: (.*)", out)
    assert len(errors) == len(BAD), out
    lines = {int(n): msg for n, msg in errors}
    for i, expected in enumerate(BAD.values()):
        assert expected in lines[5 + 4 * i], (expected, out)   # the line of read{i}'s return


def test_mypy_checks_the_declared_types(tmp_path):
    text = ("from fedmpi.config.core import Config\n\n\n"
            "def name(cfg: Config) -> str:\n    return cfg.train.rounds\n")
    out, status = _mypy(tmp_path, {"typed.py": text})
    assert status == 1 and 'Incompatible return value type (got "int", expected "str")' in out, \
        out
