"""Tests for fedmpi.config.schema: defaults, sources and precedence, validation messages."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from fedmpi.config.schema import SCHEMA, config_from_dict, load_config
from fedmpi.config.core import Config
from fedmpi.config.fields import Field
from fedmpi.config.framework import PartitionConfig
from fedmpi.errors import ConfigError, UserError


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def raises(match_parts: list[str], fn, *args, **kwargs) -> str:
    """Call fn, expect ConfigError, check every part is in its (one-line) message."""
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    msg = str(info.value)
    assert "\n" not in msg
    for part in match_parts:
        assert part in msg, f"{part!r} not in {msg!r}"
    return msg


# --------------------------------------------------------------------------- #
# Defaults, access, precedence
# --------------------------------------------------------------------------- #
def test_defaults_resolve_to_schema_defaults():
    cfg = load_config(None)
    assert isinstance(cfg, Config)
    for key, f in SCHEMA.items():
        assert cfg.get(key) == f.default, key
    assert cfg.name == "quickstart"
    assert cfg.train.lr == 0.05
    assert cfg.data.partition.alpha == 0.5
    assert cfg.train.clients_per_round is None
    assert cfg.get("adversary.clients") == []
    assert cfg.get("aggregation.fedvg.eps") == 1e-8


def test_config_error_is_user_error():
    assert issubclass(ConfigError, UserError)


def test_nested_access_and_get_agree():
    cfg = config_from_dict({"data": {"partition": {"alpha": 0.1}}, "train": {"lr": 0.2}})
    assert cfg.data.partition.alpha == 0.1 == cfg.get("data.partition.alpha")
    assert cfg.train.lr == 0.2 == cfg.get("train.lr")
    assert cfg.get("data").get("partition.alpha") == 0.1
    assert cfg.get("data.partition").to_dict()["alpha"] == 0.1
    assert isinstance(cfg.data.partition, PartitionConfig)
    with pytest.raises(AttributeError):
        cfg.train.lrr
    with pytest.raises(KeyError, match="train.lr"):
        cfg.get("train.lrr")
    assert cfg.get("train.lrr", None) is None


def test_config_is_immutable_and_lists_are_copies():
    cfg = config_from_dict({"adversary": {"clients": [1, 2]}})
    with pytest.raises(AttributeError):
        cfg.name = "x"
    with pytest.raises(AttributeError):
        cfg.train.lr = 0.1   # type: ignore[misc]
    cfg.get("adversary.clients").append(3)
    assert cfg.get("adversary.clients") == [1, 2]
    cfg.train.betas.append(0.5)   # the typed sections' lists too
    cfg.transforms.append("pkg.mod:T")
    assert cfg.train.betas == [0.9, 0.999] and cfg.transforms == []
    assert cfg.get("train.betas") == [0.9, 0.999]


def test_yaml_file_and_override_precedence(tmp_path):
    path = write(tmp_path / "c.yaml", "name: exp\ntrain:\n  lr: 0.1\n  rounds: 5\n")
    cfg = load_config(path)
    assert (cfg.name, cfg.train.lr, cfg.train.rounds) == ("exp", 0.1, 5)
    assert cfg.train.batch_size == SCHEMA["train.batch_size"].default  # untouched -> default

    cfg = load_config(path, ["train.lr=0.3", "adversary.clients=[1, 2]", "train.lr=0.4"])
    assert cfg.train.lr == 0.4  # override beats file; last override wins
    assert cfg.train.rounds == 5  # file beats default
    assert cfg.get("adversary.clients") == [1, 2]


def test_override_values_are_parsed_as_yaml():
    cfg = config_from_dict({"train": {"clients_per_round": 3}}, [
        "train.clients_per_round=null", "data.download=true", "train.grad_clip=1",
        "aggregation.fedvg.eps=1e-6", "runtime.device=cuda:1", "name=2024",
        "system.levels=[1, 0.25]", "system.allocation=[4, 6]",
    ])
    assert cfg.train.clients_per_round is None
    assert cfg.data.download is True
    assert cfg.train.grad_clip == 1.0 and isinstance(cfg.train.grad_clip, float)
    assert cfg.get("aggregation.fedvg.eps") == 1e-6  # exponent without '.' is a float, not a str
    assert cfg.runtime.device == "cuda:1"
    assert cfg.name == "2024"  # command-line text for a string key stays a string
    assert cfg.system.levels == [1.0, 0.25]
    assert cfg.system.allocation == [4, 6]


def test_int_is_accepted_for_float_and_stored_as_float():
    cfg = config_from_dict({"train": {"lr": 1}})
    assert cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float)


def test_empty_file_and_empty_section_mean_defaults(tmp_path):
    assert load_config(write(tmp_path / "e.yaml", "")).to_dict() == load_config(None).to_dict()
    cfg = load_config(write(tmp_path / "s.yaml", "train:\n"))
    assert cfg.train.lr == SCHEMA["train.lr"].default


def test_to_yaml_round_trips():
    cfg = config_from_dict(
        {"name": "rt", "train": {"lr": 0.01, "clients_per_round": 4},
         "aggregation": {"weighting": "fedvg", "fedvg": {"eps": 1e-10}},
         "system": {"levels": [1, 0.5], "allocation": [3, 7]}},
        ["adversary.clients=[0, 9]"],
    )
    text = cfg.to_yaml()
    back = config_from_dict(yaml.safe_load(text))
    assert back.to_dict() == cfg.to_dict()
    assert back == cfg
    assert list(yaml.safe_load(text)) == list(dict.fromkeys(k.split(".")[0] for k in SCHEMA))


def test_replace_returns_new_validated_config():
    cfg = load_config(None)
    new = cfg.replace(**{"train.lr": 0.1, "data.num_clients": 4})
    assert (new.train.lr, new.data.num_clients) == (0.1, 4)
    assert cfg.train.lr == 0.05  # original untouched
    raises(["train.lr", "> 0"], cfg.replace, **{"train.lr": 0})
    raises(["unknown config key 'train.lrr'", "did you mean 'train.lr'?"],
           cfg.replace, **{"train.lrr": 0.1})


# --------------------------------------------------------------------------- #
# Errors: unknown keys, types, ranges, choices
# --------------------------------------------------------------------------- #
def test_unknown_key_in_yaml_names_full_key_and_suggests(tmp_path):
    path = write(tmp_path / "c.yaml", "data:\n  partition:\n    alhpa: 0.3\n")
    raises(["unknown config key 'data.partition.alhpa'", "did you mean 'data.partition.alpha'?"],
           load_config, path)


def test_unknown_key_in_override_suggests():
    msg = raises(["unknown config key 'train.lrr'"], config_from_dict, {}, ["train.lrr=0.1"])
    assert msg == "unknown config key 'train.lrr' (did you mean 'train.lr'?)"
    raises(["unknown config key 'mu'", "did you mean 'algorithm.fedprox.mu'?"],
           config_from_dict, {}, ["mu=0.1"])
    raises(["unknown config key 'trian.lr'", "'train.lr'"], config_from_dict, {"trian": {"lr": 1}})


def test_wrong_type_messages():
    msg = raises(["train.rounds"], config_from_dict, {}, ["train.rounds=ten"])
    assert msg == "config key 'train.rounds' expects an integer, got 'ten' (str)"
    raises(["train.rounds", "integer", "True (bool)"], config_from_dict, {"train": {"rounds": True}})
    raises(["train.rounds", "integer", "2.5"], config_from_dict, {"train": {"rounds": 2.5}})
    raises(["train.lr", "a number", "'0.1' (str)"], config_from_dict, {"train": {"lr": "0.1"}})
    raises(["data.download", "boolean"], config_from_dict, {"data": {"download": 1}})
    raises(["train.rounds", "null"], config_from_dict, {"train": {"rounds": None}})
    raises(["adversary.clients", "list of integers"], config_from_dict, {}, ["adversary.clients=3"])
    raises(["adversary.clients", "item 1", "1.5"], config_from_dict, {}, ["adversary.clients=[0, 1.5]"])
    raises(["'train'", "mapping"], config_from_dict, {"train": 5})


@pytest.mark.parametrize("override, key, bound, shown", [
    ("data.partition.alpha=0", "data.partition.alpha", "> 0", "got 0.0"),
    ("data.partition.alpha=-1", "data.partition.alpha", "> 0", "got -1.0"),
    ("train.rounds=0", "train.rounds", ">= 1", "got 0"),
    ("data.validation.fraction=-0.1", "data.validation.fraction", "in [0, 1)", "got -0.1"),
    ("data.validation.fraction=1.0", "data.validation.fraction", "in [0, 1)", "got 1.0"),
    ("data.validation.fraction=1.5", "data.validation.fraction", "in [0, 1)", "got 1.5"),
    ("train.momentum=1", "train.momentum", "in [0, 1)", "got 1.0"),
    ("ecgr.beta=1.5", "ecgr.beta", "in [0, 1]", "got 1.5"),
    ("train.local_steps=0", "train.local_steps", ">= 1", "got 0"),
    ("train.lr=.nan", "train.lr", "> 0", "got nan"),
    ("system.levels=[1, 0]", "system.levels", "in (0, 1]", "item 1 is 0.0"),
])
def test_out_of_range(override, key, bound, shown):
    raises([f"config key {key!r}", bound, shown], config_from_dict, {}, [override])


def test_boundary_values_accepted():
    cfg = config_from_dict({}, ["data.validation.fraction=0", "ecgr.beta=1", "seed=0",
                                "train.local_steps=1", "system.levels=[1]",
                                "system.allocation=[10]"])
    assert cfg.data.validation.fraction == 0.0 and cfg.get("ecgr.beta") == 1.0


def test_bad_choice_names_key_and_choices():
    raises(["algorithm.name", "fedavg", "'fedavgg'", "did you mean 'fedavg'?"],
           config_from_dict, {"algorithm": {"name": "fedavgg"}})
    raises(["runtime.device", "'gpu'"], config_from_dict, {}, ["runtime.device=gpu"])
    raises(["data.dataset", "medmnist:<flag>"], config_from_dict, {}, ["data.dataset=medmnist:"])
    assert config_from_dict({}, ["data.dataset=medmnist:pathmnist"]).data.dataset == \
        "medmnist:pathmnist"
    raises(["aggregation.fedvg.norm"], config_from_dict, {}, ["aggregation.fedvg.norm=l3"])


def test_set_without_equals():
    raises(["KEY=VALUE", "train.lr"], config_from_dict, {}, ["train.lr"])
    raises(["KEY=VALUE"], load_config, None, ["train.lr 0.1"])


# --------------------------------------------------------------------------- #
# Errors: files
# --------------------------------------------------------------------------- #
def test_missing_config_file_names_path(tmp_path):
    path = tmp_path / "nope.yaml"
    raises([str(path)], load_config, path)


def test_yaml_syntax_error_names_file(tmp_path):
    path = write(tmp_path / "bad.yaml", "train:\n  lr: [0.1\n")
    raises([str(path), "YAML"], load_config, path)


def test_top_level_not_mapping(tmp_path):
    path = write(tmp_path / "list.yaml", "- 1\n- 2\n")
    raises([str(path), "mapping"], load_config, path)


def test_partition_file_required_and_must_exist(tmp_path):
    raises(["data.partition.file", "required"],
           config_from_dict, {}, ["data.partition.method=file"])
    raises(["data.partition.file", "not found", "missing.json"], config_from_dict, {},
           ["data.partition.method=file", f"data.partition.file={tmp_path / 'missing.json'}"])


def test_partition_file_resolved_against_config_dir_then_cwd(tmp_path, monkeypatch):
    conf_dir, cwd = tmp_path / "conf", tmp_path / "cwd"
    conf_dir.mkdir(), cwd.mkdir()
    monkeypatch.chdir(cwd)
    write(conf_dir / "parts.json", json.dumps([[0, 1], [2, 3]]))
    write(cwd / "other.json", json.dumps([[0], [1]]))
    text = "data:\n  partition:\n    method: file\n    file: {}\n"
    cfg = load_config(write(conf_dir / "a.yaml", text.format("parts.json")))
    assert cfg.data.partition.file == str((conf_dir / "parts.json").resolve())
    assert os.path.isabs(cfg.data.partition.file)
    cfg = load_config(write(conf_dir / "b.yaml", text.format("other.json")))  # not in conf dir
    assert cfg.data.partition.file == str((cwd / "other.json").resolve())
    # The stored absolute path survives a round trip from another directory.
    monkeypatch.chdir(tmp_path)
    assert config_from_dict(yaml.safe_load(cfg.to_yaml())).data.partition.file == \
        cfg.data.partition.file


# --------------------------------------------------------------------------- #
# Cross-field checks
# --------------------------------------------------------------------------- #
def test_clients_per_round_at_most_num_clients():
    raises(["train.clients_per_round", "data.num_clients", "11"],
           config_from_dict, {"data": {"num_clients": 10}, "train": {"clients_per_round": 11}})
    assert config_from_dict({}, ["train.clients_per_round=10"]).train.clients_per_round == 10
    # Override of num_clients is taken into account before the check.
    raises(["train.clients_per_round"], config_from_dict,
           {"train": {"clients_per_round": 5}}, ["data.num_clients=4"])


def test_system_allocation_checks():
    raises(["system.allocation", "sum", "9"], config_from_dict,
           {"system": {"levels": [1, 0.5], "allocation": [4, 5]}})
    raises(["system.allocation", "system.levels"], config_from_dict,
           {"system": {"levels": [1, 0.5, 0.25], "allocation": [4, 6]}})
    raises(["system.allocation"], config_from_dict, {"system": {"levels": [1, 0.5]}})
    raises(["system.levels"], config_from_dict, {"system": {"allocation": [10]}})
    raises(["system.allocation", ">= 0"], config_from_dict,
           {"system": {"levels": [1, 0.5], "allocation": [11, -1]}})


def test_adversary_ids_in_range():
    raises(["adversary.clients", "10"], config_from_dict, {}, ["adversary.clients=[0, 10]"])
    raises(["adversary.clients", "-1"], config_from_dict, {}, ["adversary.clients=[-1]"])
    raises(["adversary.clients", "twice"], config_from_dict, {}, ["adversary.clients=[2, 2]"])


def test_fedvg_needs_validation_set():
    raises(["data.validation.fraction", "fedvg"], config_from_dict, {},
           ["aggregation.weighting=fedvg", "data.validation.fraction=0"])
    # delta norm needs no validation pass; an external source is fine too.
    config_from_dict({}, ["aggregation.weighting=fedvg", "data.validation.fraction=0",
                          "aggregation.fedvg.norm=delta"])
    config_from_dict({}, ["aggregation.weighting=fedvg", "data.validation.fraction=0",
                          "data.validation.source=stl10"])


# --------------------------------------------------------------------------- #
# Schema extension
# --------------------------------------------------------------------------- #
def test_a_component_brings_its_keys_and_rules(monkeypatch):
    """A weighting registered after import: its params dataclass becomes the keys
    aggregation.<block>.* (typed, bounded, defaulted) and its check() runs when selected."""
    from dataclasses import dataclass

    from fedmpi.aggregation.weighting import WEIGHTINGS, Weighting
    from fedmpi.config.params import param

    @dataclass(frozen=True)
    class ToyParams:
        beta: float = param(0.9, "toy key", ge=0, lt=1)

    class Toy(Weighting):
        name = "toy_w"
        params = {"toy_w": ToyParams}

        @classmethod
        def check(cls, cfg):
            if cfg.get("aggregation.toy_w.beta") == 0.5 and cfg.seed == 1:
                raise ConfigError("config keys 'aggregation.toy_w.beta' and 'seed' disagree")

    monkeypatch.setitem(WEIGHTINGS, "toy_w", Toy)
    monkeypatch.setattr(WEIGHTINGS, "version", WEIGHTINGS.version + 1)
    cfg = config_from_dict({"aggregation": {"weighting": "toy_w", "toy_w": {"beta": 0.5}}})
    assert cfg.get("aggregation.toy_w.beta") == 0.5
    assert cfg.to_dict()["aggregation"]["toy_w"]["beta"] == 0.5
    assert load_config(None).get("aggregation.toy_w.beta") == 0.9
    raises(["aggregation.toy_w.beta", "in [0, 1)"], config_from_dict, {},
           ["aggregation.toy_w.beta=1"])
    raises(["aggregation.toy_w.beta", "seed"], config_from_dict, {},
           ["aggregation.weighting=toy_w", "aggregation.toy_w.beta=0.5", "seed=1"])
    config_from_dict({}, ["aggregation.toy_w.beta=0.5", "seed=1"])   # not selected: no rule


def test_field_type_names():
    assert Field(int | None, None).type_name == "an integer or null"
    assert Field(list[float], []).type_name == "a list of numbers"
    assert Field(dict, {}).type_name == "a mapping"
    with pytest.raises(TypeError):
        Field(set, set())


#: The flat method keys of pre-release versions (``renamed_from``, removed) and the keys
#: they became.
OLD_KEYS = {"algorithm.mu": "algorithm.fedprox.mu", "algorithm.beta1": "algorithm.fedadam.beta1",
            "algorithm.beta2": "algorithm.fedyogi.beta2", "algorithm.tau": "algorithm.fedadam.tau",
            "algorithm.alpha": "algorithm.feddyn.alpha",
            "algorithm.max_grad_norm": "algorithm.feddyn.max_grad_norm",
            "algorithm.elastic_mu": "algorithm.elastic.mu",
            "algorithm.elastic_tau": "algorithm.elastic.tau",
            "algorithm.elastic_sample": "algorithm.elastic.sample",
            "algorithm.server_momentum": "algorithm.fedavgm.server_momentum",
            "algorithm.nesterov": "algorithm.fedavgm.nesterov"}


@pytest.mark.parametrize("old", sorted(OLD_KEYS))
def test_flat_method_keys_of_earlier_versions_are_refused_naming_the_new_key(old):
    raises([f"unknown config key {old!r}", "did you mean ", repr(OLD_KEYS[old])],
           config_from_dict, {}, [f"{old}=0.25"])


def test_check_refuses_an_old_key_in_one_line(tmp_path, capsys):
    from fedmpi.cli import main

    path = tmp_path / "c.yaml"
    path.write_text("algorithm:\n  name: fedprox\n  mu: 0.3\n")
    assert main(["check", str(path)]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and "'algorithm.mu'" in err[0] and \
        "did you mean 'algorithm.fedprox.mu'" in err[0], err
    assert captured.out == ""
