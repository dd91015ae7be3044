"""User code named in the config by import path: ``"pkg.module:attr"`` (Hydra's ``_target_`` habit).

Four config keys accept an import path instead of a built-in name:

==========================  ==============================================================
``model.name``              a callable ``(input_shape, num_classes) -> nn.Module``, or an
                            ``nn.Module`` class taking those two arguments
``data.dataset``            a callable ``() ->`` :class:`fedmpi.data.Dataset`, or ``->``
                            ``(train, test)`` map-style datasets of ``(x, label)`` items
``algorithm.name``          a subclass of :class:`fedmpi.algorithms.Algorithm`; its
                            parameters come from ``algorithm.params``, checked against the
                            class's ``params["params"]`` dataclass
                            (:func:`fedmpi.params.check_params`)
``aggregation.weighting``   a subclass of :class:`fedmpi.algorithms.Weighting`
``aggregation.rule``        a subclass of :class:`fedmpi.algorithms.ServerRule`; its
                            parameters come from ``aggregation.params``
``transforms``              subclasses of :class:`fedmpi.algorithms.UpdateTransform`
``data.silos.loader``       a callable ``(client) -> (x, y)`` (:mod:`fedmpi.data.silos`)
``eval.metrics`` items      a function ``(labels, probabilities) -> float``
                            (:mod:`fedmpi.metrics`)
==========================  ==============================================================

This module is the bottom layer of user code: it resolves a path and checks the
kind of object (:func:`subclass` for component classes), and imports nothing of
fedmpi but its errors. The objects handed to :func:`fedmpi.run` in place of
names are :class:`fedmpi.usercode.UserCode`; the datasets are converted in
:mod:`fedmpi.data.custom`.

Every failure — unknown module, unknown attribute, wrong kind of object, wrong
signature, bad parameters — is a :class:`~fedmpi.errors.ConfigError` (exit 2)
whose one line names the key and what was expected. ``pkg.module`` is imported
with the current directory on ``sys.path`` (as ``python -m`` does), so a file
next to where ``fedmpi run`` is started can be named without installing it.
"""
from __future__ import annotations

import importlib
import inspect
import os
import re
import sys
from typing import Any, Callable, Optional

from .errors import ConfigError

__all__ = ["IMPORT_PATTERN", "is_import_path", "resolve", "model_factory", "silo_loader",
           "subclass", "path_of"]

#: ``pkg.module:attr``, a Python object named by import path.
IMPORT_PATTERN = r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*"
_PATTERN = re.compile(IMPORT_PATTERN)


def is_import_path(value: Any) -> bool:
    """Whether ``value`` is a ``pkg.module:attr`` string (and not a built-in name)."""
    return isinstance(value, str) and not value.startswith("medmnist:") and \
        _PATTERN.fullmatch(value) is not None


def resolve(path: str, key: str, expected: str) -> Any:
    """Import ``module`` and follow the dotted ``attr`` of ``"module:attr"``.

    ``expected`` says, for the error message, what the key needs
    (e.g. "a callable (input_shape, num_classes) -> nn.Module").
    """
    if not is_import_path(path):
        raise ConfigError(f"config key {key!r} expects an import path pkg.module:attr naming "
                          f"{expected}, got {path!r}")
    module_name, attr = path.split(":", 1)
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)   # a module next to where fedmpi runs, as with python -m
    try:
        obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and module_name.startswith(exc.name):   # the module itself
            raise ConfigError(f"config key {key!r}: no module named {exc.name!r} (from {path!r}; "
                              f"expected {expected})") from None
        raise ConfigError(f"config key {key!r}: importing {module_name!r} failed: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - user code failed at import time
        raise ConfigError(f"config key {key!r}: importing {module_name!r} failed: "
                          f"{type(exc).__name__}: {exc}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"config key {key!r}: {module_name!r} has no attribute {attr!r} "
                              f"(expected {expected})")
        obj = getattr(obj, part)
    return obj


def accepts(obj: Any, nargs: int) -> bool:
    """Whether ``obj(*nargs positional arguments)`` binds (classes: their ``__init__``)."""
    try:
        inspect.signature(obj).bind(*([None] * nargs))
    except TypeError:
        return False
    except ValueError:   # builtins without a signature: give them the benefit of the doubt
        return True
    return True


def named(obj: Any) -> str:
    return getattr(obj, "__qualname__", None) or type(obj).__name__


# --------------------------------------------------------------------- models
MODEL_EXPECTED = "a callable (input_shape, num_classes) -> nn.Module, or an nn.Module class"


def model_factory(obj: Any, key: str = "model.name") -> Callable[[tuple[int, ...], int], Any]:
    """Check a model factory; returned wrapped so its result is checked to be an ``nn.Module``."""
    if isinstance(obj, str):
        obj = resolve(obj, key, MODEL_EXPECTED)
    if not callable(obj) or not accepts(obj, 2):
        raise ConfigError(f"config key {key!r}: {named(obj)} is not {MODEL_EXPECTED}")

    def build(input_shape: tuple[int, ...], num_classes: int):
        from torch import nn

        model = obj(tuple(input_shape), int(num_classes))
        if not isinstance(model, nn.Module):
            raise ConfigError(f"config key {key!r}: {named(obj)}({tuple(input_shape)}, "
                              f"{num_classes}) returned {type(model).__name__}, not an nn.Module")
        return model

    return build


SILO_EXPECTED = "a callable (client) -> (x, y) arrays"


def silo_loader(obj: Any, key: str = "data.silos.loader") -> Callable[[int], Any]:
    """The per-client loader of silo-local data (called on the hosting rank only)."""
    if isinstance(obj, str):
        obj = resolve(obj, key, SILO_EXPECTED)
    if not callable(obj) or not accepts(obj, 1):
        raise ConfigError(f"config key {key!r}: {named(obj)} is not {SILO_EXPECTED}")
    return obj


# -------------------------------------------------------------- components
def subclass(obj: Any, base: type, key: str) -> type:
    """A subclass of ``base`` (a component base class such as
    :class:`fedmpi.algorithms.Algorithm`), given as such or as ``pkg.module:Class``."""
    expected = f"a subclass of fedmpi.algorithms.{base.__name__}"
    if isinstance(obj, str):
        obj = resolve(obj, key, expected)
    if not (isinstance(obj, type) and issubclass(obj, base)):
        raise ConfigError(f"config key {key!r}: {named(obj)} is not {expected}")
    return obj


# ------------------------------------------------------------ objects in hand
def path_of(obj: Any) -> Optional[str]:
    """``"module:qualname"`` of ``obj`` if importing it by that path gives ``obj`` back
    (what :func:`fedmpi.run` records in the config), else None (lambdas, local classes)."""
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    path = f"{module}:{qualname}"
    if not (module and qualname and is_import_path(path)):
        return None
    try:
        return path if resolve(path, "", "") is obj else None
    except ConfigError:
        return None
