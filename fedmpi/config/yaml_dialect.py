"""The YAML dialect of config files and ``--set`` values, and reading a config file.

YAML is read with a safe loader (:class:`YamlLoader`) that also recognises exponent
floats without a decimal point (``1e-8``), which plain YAML 1.1 would read as a
string, and that refuses a key repeated in one mapping instead of keeping the last.
"""
from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from fedmpi.config.fields import got_text
from fedmpi.errors import ConfigError

__all__ = ["YamlLoader", "read_yaml"]


class YamlLoader(yaml.SafeLoader):
    """SafeLoader that also reads ``1e-8`` / ``3E5`` as floats (YAML 1.2 style)."""


def _construct_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False):
    """A mapping whose keys are unique: a repeated key is an error naming it, not
    a silent "last one wins" (merge keys ``<<`` may still be overridden)."""
    seen: dict[Any, Any] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = loader.construct_object(key_node, deep=True)
        try:
            first = seen.setdefault(key, key_node.start_mark)
        except TypeError:
            continue   # unhashable: SafeLoader reports it below
        if first is not key_node.start_mark:
            raise yaml.constructor.ConstructorError(
                "while constructing a mapping", node.start_mark,
                f"duplicate key {key!r} (first given on line {first.line + 1})",
                key_node.start_mark)
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


YamlLoader.add_constructor("tag:yaml.org,2002:map", lambda loader, node: _yaml_map(loader, node))


def _yaml_map(loader: yaml.SafeLoader, node: yaml.MappingNode) -> Any:
    data: dict[Any, Any] = {}
    yield data
    data.update(_construct_mapping(loader, node))


YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def read_yaml(path: str | os.PathLike) -> Mapping[str, Any]:
    """The top-level mapping of a YAML config file; ConfigError naming the file otherwise."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise ConfigError(f"cannot read config file {path}: {reason}") from None
    try:
        data = yaml.load(text, Loader=YamlLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(exc, "problem", None) or type(exc).__name__
        raise ConfigError(f"invalid YAML in config file {path}{where}: {problem}") from None
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"config file {path} must contain a mapping of keys at the top "
                          f"level, {got_text(data)}")
    return data
