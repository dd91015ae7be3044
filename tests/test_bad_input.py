"""Issue 18: every kind of bad input exits 2 with ONE line naming the key or file, no traceback.

A table of cases, run in this process through the CLI entry :func:`fedmpi.cli.main`:
every config key with a value of the wrong type, non-finite or out-of-range numbers,
broken YAML, partition JSON/NPZ files, MedMNIST and HDF5 dataset files, checkpoints,
logs and output paths for ``run``, ``report``, ``compare`` and ``partition``. Config
cases go through ``fedmpi check`` (which must reject what ``run`` rejects) and a sample
of them also through ``run``. One case runs under ``mpiexec -n 2``: the line appears once.
"""
from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import h5py
import numpy as np
import pytest
import torch
import yaml

from conftest import ROOT, run_fedmpi
from fedmpi.cli import main as fedmpi_main
from fedmpi.config.schema import SCHEMA
from fedmpi.job.checkpoint_file import digest

CFG = str(ROOT / "configs" / "quickstart.yaml")
FAST = ["--set", "train.rounds=2", "--set", "data.num_clients=4", "--set",
        "train.clients_per_round=2", "--set", "runtime.progress=false", "--set",
        "runtime.threads=1", "--set", "eval.every=1"]


@dataclass
class Case:
    """``argv(tmp)`` -> CLI arguments; ``needle(tmp)`` must be in the one error line."""

    id: str
    argv: Callable[[Path], list[str]]
    needle: Callable[[Path], str]


# ------------------------------------------------------------ config keys
def _nested(dotted: str, value) -> dict:
    out: dict = {}
    node = out
    *parents, leaf = dotted.split(".")
    for p in parents:
        node = node.setdefault(p, {})
    node[leaf] = value
    return out


def _bad_values(key: str) -> list[tuple[str, object]]:
    """Wrong values for one key, by its declared type and bounds."""
    f = SCHEMA[key]
    out: list[tuple[str, object]] = []
    if f.base is float:
        out += [("str", "fast"), ("bool", True), ("inf", float("inf")), ("nan", float("nan")),
                ("-inf", float("-inf")), ("1e300", 1e300), ("list", [1.0])]
    elif f.base is int:
        out += [("float", 1.5), ("bool", True), ("str", "x"), ("list", [1])]
    elif f.base is bool:
        out += [("int", 1), ("str", "maybe")]
    elif f.base is str:
        out += [("list", ["a"]), ("int", 3)] if not f.file else [("list", ["a"])]
        if f.choices:
            out.append(("choice", "no_such_choice_zz"))
    elif f.base is list:
        item_bad = {int: "x", float: "x", str: 3, bool: 2}[f.item]
        out += [("scalar", 1 if f.item is not str else "a"), ("item", [item_bad])]
        if f.item is float:
            out.append(("nan-item", [1.0, float("nan")]))
    if not f.optional:
        out.append(("null", None))
    if f.base in (int, float):
        if f.ge is not None:
            out.append(("below", f.ge - 1))
        elif f.gt is not None:
            out.append(("below", f.gt - (1 if f.base is int else 0.5)))
        if f.le is not None:
            out.append(("above", f.le + 1))
        elif f.lt is not None:
            out.append(("above", f.lt + (0 if f.base is int and f.lt > 2**62 else 1)))
    return out


def _config_case(key: str, label: str, value) -> Case:
    def argv(tmp: Path) -> list[str]:
        path = tmp / "bad.yaml"
        path.write_text(yaml.safe_dump(_nested(key, value)))
        return ["check", str(path)]
    return Case(f"config-{key}-{label}", argv, lambda tmp: repr(key))


CONFIG_CASES = [_config_case(k, label, v) for k in SCHEMA for label, v in _bad_values(k)]


def _yaml_case(id: str, text: str, needle: str) -> Case:
    def argv(tmp: Path) -> list[str]:
        (tmp / "bad.yaml").write_bytes(text.encode("utf-8", "surrogateescape"))
        return ["check", str(tmp / "bad.yaml")]
    return Case(id, argv, lambda tmp: needle)


YAML_CASES = [
    _yaml_case("yaml-duplicate-key", "train:\n  lr: 0.1\n  lr: 0.2\n", "duplicate key 'lr'"),
    _yaml_case("yaml-duplicate-section", "train: {lr: 1}\ntrain: {rounds: 2}\n",
               "duplicate key 'train'"),
    _yaml_case("yaml-name-newline", 'name: "a\\nb"\n', "'name'"),
    _yaml_case("yaml-name-slash", "name: a/b\n", "'name'"),
    _yaml_case("yaml-seed-2^64", "seed: 18446744073709551616\n", "'seed'"),
    _yaml_case("yaml-syntax", "train: [1, 2\n", "bad.yaml"),
    _yaml_case("yaml-top-level-list", "- 1\n- 2\n", "bad.yaml"),
    _yaml_case("yaml-unknown-key", "train:\n  lrr: 0.1\n", "'train.lrr'"),
    _yaml_case("yaml-section-scalar", "train: 3\n", "'train'"),
    _yaml_case("yaml-python-tag", "train: !!python/object:os.system {}\n", "bad.yaml"),
    _yaml_case("yaml-not-utf8", "name: \udcff\udcfe\n", "bad.yaml"),
    _yaml_case("yaml-ecgr-fedlagc",
               "algorithm: {name: fedlagc}\necgr: {enabled: true}\n"
               "system: {levels: [1.0], allocation: [10]}\n", "'ecgr.enabled'"),
    _yaml_case("yaml-fedlagc-no-levels", "algorithm: {name: fedlagc}\n", "'system.levels'"),
    _yaml_case("yaml-heterofl-no-levels", "algorithm: {name: heterofl}\n", "'system.levels'"),
    _yaml_case("yaml-fedgps-nothing", "algorithm: {name: fedgps, fedgps: {static: false, "
               "dynamic: false}}\n", "'algorithm.fedgps.static'"),
    _yaml_case("yaml-fedvg-bf16-cpu", "aggregation: {weighting: fedvg, fedvg: {bf16: true}}\n"
               "runtime: {device: cpu}\n", "'aggregation.fedvg.bf16'"),
    _yaml_case("yaml-allocation-sum", "system: {levels: [1.0, 0.5], allocation: [3, 3]}\n",
               "'system.allocation'"),
    _yaml_case("yaml-clients-per-round", "train: {clients_per_round: 11}\n",
               "'train.clients_per_round'"),
    Case("config-missing-file", lambda tmp: ["check", str(tmp / "nope.yaml")],
         lambda tmp: str(tmp / "nope.yaml")),
    Case("config-is-directory", lambda tmp: ["check", str(tmp)], lambda tmp: str(tmp)),
    Case("set-without-equals", lambda tmp: ["check", CFG, "--set", "train.lr"],
         lambda tmp: "train.lr"),
    Case("set-bad-yaml", lambda tmp: ["check", CFG, "--set", "train.lr=[1"],
         lambda tmp: "'train.lr'"),
]


# --------------------------------------------------------- partition files
def _partition_case(id: str, name: str, write: Callable[[Path], None], needle: str = "") -> Case:
    def argv(tmp: Path) -> list[str]:
        path = tmp / name
        write(path)
        return ["partition", CFG, *FAST, "--set", "data.partition.method=file",
                "--set", f"data.partition.file={path}", "--out", str(tmp / "preview")]
    return Case(id, argv, lambda tmp: needle or str(tmp / name))


def _json(obj) -> Callable[[Path], None]:
    return lambda p: p.write_text(json.dumps(obj))


def _npz(**arrays) -> Callable[[Path], None]:
    def write(p: Path) -> None:
        with open(p, "wb") as f:
            np.savez(f, **arrays)
    return write


OBJ = np.array([[1, 2], [3]], dtype=object)
PARTITION_CASES = [
    _partition_case("json-invalid", "p.json", lambda p: p.write_text("[[1, 2], [3")),
    _partition_case("json-deep", "p.json", lambda p: p.write_text("[" * 100000 + "]" * 100000)),
    _partition_case("json-not-utf8", "p.json", lambda p: p.write_bytes(b"\xff\xfe[[1]]")),
    _partition_case("json-unknown-key", "p.json", _json({"clients": [[1]], "x": 1})),
    _partition_case("json-not-lists", "p.json", _json([1, 2, 3, 4])),
    _partition_case("json-bools", "p.json", _json([[True], [False], [1], [2]])),
    _partition_case("json-floats", "p.json", _json([[0.5], [1], [2], [3]])),
    _partition_case("json-nested", "p.json", _json([[[1]], [2], [3], [4]])),
    _partition_case("json-negative", "p.json", _json([[-1], [2], [3], [4]])),
    _partition_case("json-out-of-pool", "p.json", _json([[10 ** 9], [2], [3], [4]])),
    _partition_case("json-duplicate", "p.json", _json([[1, 1], [2], [3], [4]])),
    _partition_case("json-shared", "p.json", _json([[1], [1], [3], [4]])),
    _partition_case("json-count", "p.json", _json([[1], [2]])),
    _partition_case("json-scalar", "p.json", _json(3)),
    _partition_case("json-validation-str", "p.json",
                    _json({"clients": [[1], [2], [3], [4]], "validation": "x"})),
    _partition_case("json-one-sample-bn", "p.json", _json([[1], [2, 3], [4, 5], [6, 7]]),
                    "client 0"),
    _partition_case("suffix", "p.txt", _json([[1]])),
    _partition_case("npz-object", "p.npz", _npz(client_0=OBJ, client_1=np.arange(2),
                                                client_2=np.arange(2, 4),
                                                client_3=np.arange(4, 6))),
    _partition_case("npz-object-validation", "p.npz",
                    _npz(client_0=np.arange(2), client_1=np.arange(2, 4),
                         client_2=np.arange(4, 6), client_3=np.arange(6, 8), validation=OBJ)),
    _partition_case("npz-gap", "p.npz", _npz(client_0=np.arange(2), client_2=np.arange(2, 4))),
    _partition_case("npz-unexpected", "p.npz", _npz(weights=np.arange(2))),
    _partition_case("npz-float", "p.npz", _npz(client_0=np.ones(2), client_1=np.arange(2, 4),
                                               client_2=np.arange(4, 6), client_3=np.arange(6, 8))),
    _partition_case("npz-2d", "p.npz", _npz(client_0=np.ones((2, 2), dtype=int),
                                            client_1=np.arange(2, 4), client_2=np.arange(4, 6),
                                            client_3=np.arange(6, 8))),
    _partition_case("npz-not-zip", "p.npz", lambda p: p.write_bytes(b"PK\x03\x04garbage")),
    _partition_case("npz-empty-file", "p.npz", lambda p: p.write_bytes(b"")),
    Case("partition-1000-clients-bn",
         lambda tmp: ["partition", CFG, *FAST, "--set", "data.num_clients=1000",
                      "--set", "data.partition.method=iid", "--out", str(tmp / "pv")],
         lambda tmp: "client "),
]


# ---------------------------------------------------------- dataset files
def _medmnist(write: Callable[[Path], None]) -> Callable[[Path], list[str]]:
    def argv(tmp: Path) -> list[str]:
        write(tmp / "foo.npz")
        return ["partition", CFG, *FAST, "--set", "data.dataset=medmnist:foo",
                "--set", f"data.root={tmp}", "--out", str(tmp / "pv")]
    return argv


def _medmnist_arrays(**over) -> dict:
    images = np.zeros((20, 28, 28), dtype=np.uint8)
    labels = (np.arange(20) % 2).reshape(-1, 1)
    arrays = {f"{s}_{k}": v for s in ("train", "val", "test")
              for k, v in (("images", images), ("labels", labels))}
    arrays.update(over)
    return arrays


def _hdf5(write: Callable[[Path], None]) -> Callable[[Path], list[str]]:
    def argv(tmp: Path) -> list[str]:
        write(tmp / "data.h5")
        return ["partition", CFG, *FAST, "--set", "data.dataset=hdf5",
                "--set", f"data.root={tmp / 'data.h5'}", "--out", str(tmp / "pv")]
    return argv


def _h5(**arrays) -> Callable[[Path], None]:
    def write(p: Path) -> None:
        with h5py.File(p, "w") as f:
            for k, v in arrays.items():
                if v is None:
                    f.create_group(k)
                else:
                    f.create_dataset(k, data=v)
    return write


X = np.zeros((20, 1, 8, 8), dtype=np.uint8)
Y = np.arange(20) % 2
DATASET_CASES = [
    Case("medmnist-object-images", _medmnist(_npz(**_medmnist_arrays(train_images=OBJ))),
         lambda tmp: "train_images"),
    Case("medmnist-object-labels", _medmnist(_npz(**_medmnist_arrays(test_labels=OBJ))),
         lambda tmp: "test_labels"),
    Case("medmnist-missing-arrays", _medmnist(_npz(train_images=X)), lambda tmp: "foo.npz"),
    Case("medmnist-not-npz", _medmnist(lambda p: p.write_text("hello")), lambda tmp: "foo.npz"),
    Case("medmnist-missing", lambda tmp: ["partition", CFG, *FAST, "--set",
                                          "data.dataset=medmnist:nope", "--set",
                                          f"data.root={tmp}", "--out", str(tmp / "pv")],
         lambda tmp: "nope.npz"),
    Case("hdf5-string-labels", _hdf5(_h5(x_train=X, y_train=np.array([b"a"] * 20), x_test=X,
                                         y_test=Y)), lambda tmp: "y_train"),
    Case("hdf5-group", _hdf5(_h5(x_train=X, y_train=None, x_test=X, y_test=Y)),
         lambda tmp: "y_train"),
    Case("hdf5-missing-dataset", _hdf5(_h5(x_train=X, y_train=Y)), lambda tmp: "x_test"),
    Case("hdf5-not-hdf5", _hdf5(lambda p: p.write_text("no")), lambda tmp: "data.h5"),
    Case("hdf5-3d-images", _hdf5(_h5(x_train=X[:, 0], y_train=Y, x_test=X[:, 0], y_test=Y)),
         lambda tmp: "data.h5"),
    Case("torchvision-missing", lambda tmp: ["partition", CFG, *FAST, "--set",
                                             "data.dataset=cifar10", "--set", f"data.root={tmp}",
                                             "--out", str(tmp / "pv")],
         lambda tmp: "cifar"),
]


# --------------------------------------------------------------------- logs
@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """One finished 2-round run directory (log, checkpoint, model), made in process."""
    out = tmp_path_factory.mktemp("finished") / "run"
    assert fedmpi_main(["run", CFG, *FAST, "--out", str(out)]) == 0
    return out


def _log_case(id: str, edit: Callable[[Path], None], cmd: str = "report",
              needle: str = "") -> Case:
    def argv(tmp: Path) -> list[str]:
        path = tmp / "log.h5"
        edit(path)
        extra = ["--out", str(tmp / "rep")] if cmd == "report" else []
        return [cmd, str(path), *extra]
    return Case(f"log-{cmd}-{id}", argv, lambda tmp: needle or str(tmp / "log.h5"))


def _h5edit(fn: Callable[[h5py.File], None]) -> Callable[[Path], None]:
    def edit(path: Path) -> None:
        shutil.copy(_FINISHED[0] / "log.h5", path)
        with h5py.File(path, "r+") as f:
            fn(f)
    return edit


def _replace(key: str, data) -> Callable[[h5py.File], None]:
    def fn(f: h5py.File) -> None:
        del f[key]
        f.create_dataset(key, data=data)
    return fn


def _del_attr(name: str) -> Callable[[h5py.File], None]:
    return lambda f: f.attrs.__delitem__(name)


def _set_attr(name: str, value) -> Callable[[h5py.File], None]:
    return lambda f: f.attrs.__setitem__(name, value)


_FINISHED: list[Path] = []
LOG_EDITS = [
    ("string-round", _h5edit(_replace("rounds/round", np.array([b"a", b"b"])))),
    ("float-round", _h5edit(_replace("rounds/round", np.array([0.5, 1.5])))),
    ("unequal-lengths", _h5edit(_replace("rounds/test_accuracy", np.zeros(7)))),
    ("string-accuracy", _h5edit(_replace("rounds/test_accuracy", np.array([b"x", b"y"])))),
    ("clients-shape", _h5edit(_replace("clients/selected", np.zeros(3)))),
    ("num-samples-float", _h5edit(_replace("clients/num_samples", np.ones(4) / 2))),
    ("no-schema", _h5edit(_del_attr("schema_version"))),
    ("schema-99", _h5edit(_set_attr("schema_version", "99"))),
    ("no-status", _h5edit(_del_attr("status"))),
    ("config-not-mapping", _h5edit(_set_attr("config_yaml", "- 1\n- 2\n"))),
    ("config-bad-yaml", _h5edit(_set_attr("config_yaml", "a: [1\n"))),
    ("not-hdf5", lambda p: p.write_text("not a log")),
    ("empty-file", lambda p: p.write_bytes(b"")),
    ("truncated", lambda p: p.write_bytes((_FINISHED[0] / "log.h5").read_bytes()[:4000])),
    ("missing", lambda p: None),
    ("directory", lambda p: p.mkdir()),
]
LOG_CASES = [_log_case(id, edit, cmd) for id, edit in LOG_EDITS for cmd in ("report", "compare")]


# ------------------------------------------------------------- checkpoints
def _ckpt_case(id: str, edit: Callable[[Path], None], needle: str = "checkpoint.pt",
               more: tuple[str, ...] = ()) -> Case:
    def argv(tmp: Path) -> list[str]:
        out = tmp / "run"
        shutil.copytree(_FINISHED[0], out)
        edit(out)
        return ["run", CFG, *FAST, *more, "--out", str(out), "--resume"]
    return Case(f"checkpoint-{id}", argv, lambda tmp: str(tmp / "run" / needle))


def _flip_tensor_byte(out: Path) -> None:
    """Flip one bit inside the stored bytes of ``global_state``."""
    path = out / "checkpoint.pt"
    g = torch.load(path, weights_only=True)["global_state"]
    data = bytearray(path.read_bytes())
    at = bytes(data).find(g[100:116].numpy().tobytes())
    assert at > 0
    data[at + 3] ^= 0x10
    path.write_bytes(bytes(data))


def _resave(fn: Callable[[dict], None], rehash: bool = False) -> Callable[[Path], None]:
    """Edit the checkpoint's entries; ``rehash``: with a matching checksum, so that the
    check after the checksum is the one tested."""
    def edit(out: Path) -> None:
        ckpt = torch.load(out / "checkpoint.pt", weights_only=True)
        fn(ckpt)
        if rehash:
            ckpt.pop("checksum")
            ckpt["checksum"] = digest(ckpt)
        torch.save(ckpt, out / "checkpoint.pt")
    return edit


CHECKPOINT_CASES = [
    _ckpt_case("bit-flip", _flip_tensor_byte),
    _ckpt_case("nan-state", _resave(lambda c: c["global_state"].fill_(float("nan")))),
    _ckpt_case("nan-state-rehashed", _resave(lambda c: c["global_state"].fill_(float("nan")),
                                             rehash=True)),
    _ckpt_case("truncated", lambda out: (out / "checkpoint.pt").write_bytes(
        (out / "checkpoint.pt").read_bytes()[:5000])),
    _ckpt_case("foreign", lambda out: torch.save({"format": "x"}, out / "checkpoint.pt")),
    _ckpt_case("no-checksum", _resave(lambda c: c.pop("checksum"))),
    _ckpt_case("round-changed", _resave(lambda c: c.__setitem__("round", 1))),
    _ckpt_case("round-beyond-log", _resave(lambda c: c.__setitem__("round", 7), rehash=True)),
    _ckpt_case("missing-with-log", lambda out: (out / "checkpoint.pt").unlink()),
    _ckpt_case("other-run", lambda out: None, more=("--set", "data.partition.alpha=0.3")),
    _ckpt_case("log-missing", lambda out: (out / "log.h5").unlink(), needle="log.h5"),
]


# ------------------------------------------------------------- output paths
def _out_case(cmd: str, where: str) -> Case:
    def target(tmp: Path) -> Path:
        (tmp / "afile").write_text("x")
        return {"under-file": tmp / "afile" / "sub", "is-file": tmp / "afile",
                "proc": Path("/proc/fedmpi-test-out"),
                "read-only": _READONLY[0] / "sub" if _READONLY else Path("/proc/x")}[where]

    def argv(tmp: Path) -> list[str]:
        out = str(target(tmp))
        log = str(_FINISHED[0] / "log.h5")
        return {"run": ["run", CFG, *FAST, "--out", out],
                "partition": ["partition", CFG, *FAST, "--out", out],
                "report": ["report", log, "--out", out],
                "compare": ["compare", log, "--out", out],
                "run-out_dir": ["run", CFG, *FAST, "--set", f"runtime.out_dir={out}"]}[cmd]
    return Case(f"out-{cmd}-{where}", argv,
                lambda tmp: str(target(tmp)) if cmd != "run-out_dir" else str(target(tmp)))


# ---------------------------------------------------------------- user code
# One user module per case (its own name: a module raising at import stays broken),
# importable from the case's tmp dir. Every user-code error is ONE line
# "<object> (<import path>) raised <Type>: <message> at <file>:<line>", exit 2 at build time.
USER_CODE = """
import math
from torch import nn
from fedmpi.methods.base import Algorithm

class Net(nn.Module):
    def __init__(self, input_shape, num_classes):
        super().__init__()
        self.lin = nn.Linear(64, num_classes)
    def forward(self, x):
        return self.lin(x.flatten(1))

def exploding_model(input_shape, num_classes):
    raise RuntimeError("model factory exploded")

def wide(input_shape, num_classes):
    return nn.Sequential(nn.Flatten(), nn.Linear(64, num_classes + 3))

def one_logit(input_shape, num_classes):
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), 1))

def hospital_db():
    raise ConnectionError("hospital database unreachable")

class BadInit(Algorithm):
    def __init__(self, cfg, layout, num_clients):
        super().__init__(cfg, layout, num_clients)
        raise ValueError("method constructor exploded")

class BadSetup(Algorithm):
    def setup(self, ctx):
        raise ValueError("method setup exploded")

class WrongHook(Algorithm):
    def server_update(self, state, agg):
        pass
"""


def _user_case(id: str, sets: list[str], needle: str, import_error: bool = False,
               check: bool = False) -> Case:
    module = f"usercode_{id.replace('-', '_')}"

    def argv(tmp: Path) -> list[str]:
        import sys

        text = ("raise ImportError('half-written module')\n" if import_error else "") + USER_CODE
        (tmp / f"{module}.py").write_text(text)
        if str(tmp) not in sys.path:
            sys.path.insert(0, str(tmp))
        over = [x for kv in sets for x in ("--set", kv.replace("M:", f"{module}:"))]
        if check:
            return ["check", CFG, *FAST, *over, "--dry-run"]
        return ["run", CFG, *FAST, *over, "--out", str(tmp / "o")]
    return Case(f"usercode-{id}", argv, lambda tmp: needle.replace("M:", f"{module}:"))


USER_CASES = [
    _user_case("import", ["model.name=M:Net"], "model (M:Net) raised ImportError: half-written "
               "module at ", import_error=True),
    _user_case("model-construction", ["model.name=M:exploding_model"],
               "model (M:exploding_model) raised RuntimeError: model factory exploded at "),
    _user_case("dataset-construction", ["data.dataset=M:hospital_db"],
               "dataset (M:hospital_db) raised ConnectionError: hospital database unreachable at "),
    _user_case("method-construction", ["model.name=M:Net", "algorithm.name=M:BadInit"],
               "method (M:BadInit) raised ValueError: method constructor exploded at "),
    _user_case("method-setup", ["model.name=M:Net", "algorithm.name=M:BadSetup"],
               "method (M:BadSetup) raised ValueError: method setup exploded at "),
    _user_case("wrong-hook-signature", ["model.name=M:Net", "algorithm.name=M:WrongHook"],
               "WrongHook.server_update(self, state, agg) does not accept"),
    _user_case("wrong-output-width", ["model.name=M:wide"], "13 outputs per sample but the "
               "data has 10 classes"),
    _user_case("wrong-output-width-check", ["model.name=M:wide"], "13 outputs per sample",
               check=True),
    _user_case("one-logit", ["model.name=M:one_logit", "data.dataset=breast_cancer"],
               "'model.name' (M:one_logit): the model returns 1 output per sample but the data "
               "has 2 classes"),
    _user_case("one-logit-bce", ["model.name=M:one_logit", "data.dataset=breast_cancer",
                                 "train.loss=bce_logits"], "1 output per sample", check=True),
]

_READONLY: list[Path] = []
OUT_CASES = [_out_case(cmd, where) for cmd in ("run", "partition", "report", "compare", "run-out_dir")
             for where in ("under-file", "is-file", "proc", "read-only")]

RUN_CONFIG_CASES = [Case("run-" + c.id, lambda tmp, c=c: ["run", *c.argv(tmp)[1:], "--out",
                                                          str(tmp / "o")], c.needle)
                    for c in CONFIG_CASES if c.id.endswith(("-inf", "-nan", "-str"))][:40]

ALL = (CONFIG_CASES + YAML_CASES + RUN_CONFIG_CASES + PARTITION_CASES + DATASET_CASES
       + LOG_CASES + CHECKPOINT_CASES + OUT_CASES + USER_CASES)


@pytest.fixture(scope="module")
def readonly(tmp_path_factory):
    """A read-only tmpfs (needs root and mount); read-only cases use /proc otherwise."""
    d = tmp_path_factory.mktemp("ro")
    ok = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(d)],
                        capture_output=True).returncode == 0
    if ok:
        _READONLY.append(d)
    yield d if ok else None
    if ok:
        _READONLY.clear()
        subprocess.run(["umount", str(d)], capture_output=True)


def test_table_has_every_kind():
    """>= 150 cases; every config key and every input-file kind is in the table."""
    assert len(ALL) >= 150
    kinds = {c.id.split("-")[0] for c in ALL}
    assert {"config", "yaml", "json", "npz", "medmnist", "hdf5", "log", "checkpoint",
            "out", "run", "usercode"} <= kinds
    assert all(any(c.id.startswith(f"config-{k}-") for c in CONFIG_CASES) for k in SCHEMA)


@pytest.mark.parametrize("case", ALL, ids=[c.id for c in ALL])
def test_bad_input_exits_2_with_one_line(case, finished, readonly, tmp_path, capsys):
    _FINISHED[:] = [finished]
    argv = case.argv(tmp_path)
    capsys.readouterr()
    code = fedmpi_main(argv)
    err = capsys.readouterr().err
    assert code == 2, (argv, err[-2000:])
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fedmpi: error: "), err[-2000:]
    assert case.needle(tmp_path) in lines[0], lines[0]
    if argv[0] == "run" and "--out" in argv and case.id.startswith("usercode-"):
        assert not Path(argv[argv.index("--out") + 1]).exists()   # the dry run wrote nothing


@pytest.mark.mpi
def test_error_line_appears_once_under_mpiexec(tmp_path):
    (tmp_path / "afile").write_text("x")
    for args in (["--set", "train.lr=.inf"], ["--out", str(tmp_path / "afile")]):
        proc = run_fedmpi(["run", CFG, *FAST, *args], n=3, check=False, timeout=180)
        assert proc.returncode == 2, proc.stderr[-2000:]
        errors = [line for line in proc.stderr.splitlines() if line.startswith("fedmpi: error")]
        assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]


@pytest.mark.mpi
def test_silo_missing_on_one_rank_only_is_one_line(tmp_path):
    """Under mpiexec -n 3, client 2's silo file is absent; only rank 1 (its host) reads
    it: one line naming the file, exit 2, no run directory."""
    rng = np.random.default_rng(0)
    for k in range(3):
        (tmp_path / f"hospital_{k}.csv").write_text(
            "f0,f1,label\n" + "".join(f"{a:.3f},{b:.3f},{i % 2}\n"
                                       for i, (a, b) in enumerate(rng.normal(size=(40, 2)))))
    (tmp_path / "test.csv").write_text((tmp_path / "hospital_0.csv").read_text())
    (tmp_path / "hospital_2.csv").unlink()
    config = {"data": {"num_clients": 3, "partition": {"method": "silos"},
                       "silos": {"path": str(tmp_path / "hospital_{client}.csv"),
                                 "test": str(tmp_path / "test.csv")}},
              "model": {"name": "mlp"}, "train": {"rounds": 1},
              "runtime": {"progress": False, "threads": 1}}
    (tmp_path / "silos.yaml").write_text(yaml.safe_dump(config))
    proc = run_fedmpi(["run", str(tmp_path / "silos.yaml"), "--out", str(tmp_path / "o")], n=3,
                      check=False, timeout=240)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(lines) == 1 and "hospital_2.csv" in lines[0] and "rank 1" in lines[0], lines
    assert not (tmp_path / "o").exists()


RUNTIME_CODE = """
from fedmpi.methods.base import Algorithm

class ClientFails(Algorithm):
    def hooks(self, task, state, extras):
        if task.round == 2:
            raise ValueError("client update exploded")
        return super().hooks(task, state, extras)

class EveryRankFails(Algorithm):
    def begin_round(self, round, mask, state, extras):
        if round == 2:
            raise ValueError("begin_round exploded")

def hospital_db():
    raise ValueError("hospital database unreachable")
"""


@pytest.mark.mpi
@pytest.mark.parametrize("key, obj, what, code", [
    ("algorithm.name", "ClientFails", "method", 1),       # round 3, on the workers
    ("algorithm.name", "EveryRankFails", "method", 1),    # round 3, on every rank
    ("data.dataset", "hospital_db", "dataset", 2)])       # at construction, on every rank
def test_user_code_error_is_one_line_per_job(tmp_path, key, obj, what, code):
    """Under mpiexec -n 3: user code raising on several ranks (the issue: up to 111
    interleaved traceback lines) gives ONE line naming it; exit 1 once the run runs,
    2 while it is built."""
    (tmp_path / "runtime_i26.py").write_text(RUNTIME_CODE)
    proc = run_fedmpi(["run", CFG, *FAST, "--set", "train.rounds=4", "--set",
                       f"{key}=runtime_i26:{obj}", "--out", str(tmp_path / "o")],
                      n=3, check=False, timeout=240, env={"PYTHONPATH": str(tmp_path)})
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert proc.returncode == code, proc.stderr[-2000:]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert errors[0].startswith(f"fedmpi: error: {what} (runtime_i26:{obj}) raised "
                                "ValueError: "), errors
    assert "runtime_i26.py:" in errors[0]
