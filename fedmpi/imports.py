"""User code named in the config by import path: ``"pkg.module:attr"`` (Hydra's ``_target_`` habit).

Four config keys accept an import path instead of a built-in name:

==========================  ==============================================================
``model.name``              a callable ``(input_shape, num_classes) -> nn.Module``, or an
                            ``nn.Module`` class taking those two arguments
``data.dataset``            a callable ``() ->`` :class:`fedmpi.data.Dataset`, or ``->``
                            ``(train, test)`` map-style datasets of ``(x, label)`` items
``algorithm.name``          a subclass of :class:`fedmpi.methods.base.Algorithm`; its
                            parameters come from ``algorithm.params``, checked against the
                            class's ``params["params"]`` dataclass
                            (:func:`fedmpi.config.params.check_params`)
``aggregation.weighting``   a subclass of :class:`fedmpi.aggregation.weighting.Weighting`
``aggregation.rule``        a subclass of :class:`fedmpi.aggregation.rules.ServerRule`; its
                            parameters come from ``aggregation.params``
``transforms``              subclasses of :class:`fedmpi.transforms.base.UpdateTransform`
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
signature (also of a method's, weighting's or transform's overridden hooks), bad
parameters — is a :class:`~fedmpi.errors.ConfigError` (exit 2) whose one line names
the key and what was expected. User code that *raises* while the run is built (at
import, in a factory, in a constructor or ``setup``) is a
:class:`~fedmpi.errors.UserCodeError` (a ConfigError, exit 2):
``<object> (<import path>) raised <Type>: <message> at <file>:<line>`` (:func:`blame`). ``pkg.module`` is imported
with the current directory on ``sys.path`` (as ``python -m`` does), so a file
next to where ``fedmpi run`` is started can be named without installing it.
"""
from __future__ import annotations

import importlib
import inspect
import os
import re
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Callable, Optional

from fedmpi.errors import (OBJECTS, ConfigError, UserCodeError, UserError, code_error_line,
    user_frame)

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
            raise ConfigError(f"config key {key!r}: no module named {exc.name!r}"
                              f"{_near_module(exc.name)} (from {path!r}; expected {expected})"
                              ) from None
        raise ConfigError(f"config key {key!r}: importing {module_name!r} failed: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - user code failed at import time
        raise UserCodeError(object_name(key), path, exc) from exc
    for part in attr.split("."):
        if not hasattr(obj, part):
            from fedmpi.config.fields import suggest

            near = suggest(part, [n for n in dir(obj) if not n.startswith("_")])
            raise ConfigError(f"config key {key!r}: {module_name!r} has no attribute {attr!r}"
                              f"{near} (expected {expected})")
        obj = getattr(obj, part)
    return obj


def _near_module(name: str) -> str:
    """`` (did you mean 'pkg.mod'?)`` for a module ``name`` that does not exist: the
    closest name among its would-be siblings (the modules and package folders on
    ``sys.path``, or the modules of its parent package)."""
    import pkgutil

    from fedmpi.config.fields import suggest

    parent, _, _ = name.rpartition(".")
    try:
        where = list(importlib.import_module(parent).__path__) if parent else \
            [p or os.getcwd() for p in sys.path]
    except (ImportError, AttributeError):
        return ""
    names = {m.name for m in pkgutil.iter_modules(where)}
    for d in where:   # namespace packages (a folder of modules without __init__.py)
        try:
            names.update(e.name for e in os.scandir(d) if e.is_dir() and e.name.isidentifier())
        except OSError:
            pass
    return suggest(name, sorted(f"{parent}.{n}" if parent else n for n in names))


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


def object_name(key: str) -> str:
    """What the object of config key ``key`` is called in an error line ("model", "method")."""
    return OBJECTS.get(key.split("[", 1)[0], key)


def code_path(obj: Any) -> Optional[str]:
    """``module:qualname`` of a function or class (of an instance: of its class); an
    import path string as it is."""
    if isinstance(obj, str):
        return obj if is_import_path(obj) else None
    target = obj if inspect.isclass(obj) or inspect.isroutine(obj) else type(obj)
    module, qualname = getattr(target, "__module__", None), getattr(target, "__qualname__", None)
    return f"{module}:{qualname}" if module and qualname else None


def is_user_code(obj: Any) -> bool:
    """Whether ``obj`` (or its class) is defined outside fedmpi."""
    path = code_path(obj)
    return path is not None and path.split(":", 1)[0].split(".", 1)[0] not in ("fedmpi",
                                                                               "builtins")


def _defined_in(obj: Any, frame: Any, by_name: bool) -> bool:
    target = obj if inspect.isclass(obj) or inspect.isroutine(obj) else type(obj)
    try:
        source = inspect.getsourcefile(target)
    except TypeError:
        return False
    if source is None or os.path.abspath(source) != os.path.abspath(frame.filename):
        return False
    qualname = getattr(target, "__qualname__", "")
    return not by_name or frame.qualname == qualname or frame.qualname.startswith(qualname + ".")


def run_objects(algo: Any, model: Any, weighting: Any, transforms: Any,
                rule: Any = None) -> dict[str, Any]:
    """What a round runs, by config key: the objects :func:`runtime_error_line` blames."""
    return {"algorithm.name": algo, "model.name": model, "aggregation.weighting": weighting,
            "aggregation.rule": rule, **{f"transforms[{i}]": tr for i, tr in enumerate(transforms)}}


def runtime_error_line(exc: BaseException, objects: Mapping[str, Any]) -> tuple[str, bool]:
    """One line for an exception raised while a run runs (a client's training, the
    server step): blamed on the user object of ``objects`` (config key -> object, e.g.
    ``{"model.name": model, "algorithm.name": algo}``) whose code holds the innermost
    user frame — matched by qualified name, else by file — else on "user code"; without
    a user frame, on fedmpi ("run"). Returns (line, whether user code was blamed)."""
    frame = user_frame(exc)
    if frame is None:
        return code_error_line("run", None, exc), False
    users = [(k, o) for k, o in objects.items() if is_user_code(o)]
    for by_name in (True, False):
        for key, obj in users:
            if _defined_in(obj, frame, by_name):
                return code_error_line(object_name(key), code_path(obj), exc), True
    return code_error_line("user code", None, exc), True


@contextmanager
def blame(key: str, obj: Any) -> Iterator[None]:
    """Inside: an exception raised by user code becomes one :class:`UserCodeError` line
    naming ``key``'s object and ``obj``'s import path. Blamed: ``obj`` is user code, or
    the exception's innermost frame outside fedmpi and the libraries is. fedmpi's own
    errors (:class:`UserError`) and its bugs pass through unchanged."""
    try:
        yield
    except UserError:
        raise
    except Exception as exc:
        if not (is_user_code(obj) or user_frame(exc) is not None):
            raise
        raise UserCodeError(object_name(key), code_path(obj) if is_user_code(obj) else None,
                            exc) from exc


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

        with blame(key, obj):
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
    :class:`fedmpi.methods.base.Algorithm`), given as such or as ``pkg.module:Class``."""
    expected = f"a subclass of {base.__module__}.{base.__qualname__}"
    if isinstance(obj, str):
        obj = resolve(obj, key, expected)
    if not (isinstance(obj, type) and issubclass(obj, base)):
        raise ConfigError(f"config key {key!r}: {named(obj)} is not {expected}")
    check_overrides(obj, base, key)
    return obj


def _call_args(sig: inspect.Signature) -> tuple[list[None], dict[str, None]]:
    """The arguments fedmpi passes to a hook of signature ``sig``: its positional
    parameters by position, its keyword-only ones by name."""
    args = [None for p in sig.parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    kwargs = {p.name: None for p in sig.parameters.values() if p.kind == p.KEYWORD_ONLY}
    return args, kwargs


def check_overrides(cls: type, base: type, key: str) -> None:
    """Every hook of ``base`` that ``cls`` overrides must accept the arguments fedmpi
    calls it with (the base's signature); a ConfigError names the first one that does not,
    so a wrong hook signature stops the run before it starts instead of in round 0."""
    for name, hook in vars(base).items():
        if name.startswith("__") or not inspect.isfunction(hook):
            continue
        mine = inspect.getattr_static(cls, name, None)
        if mine is hook or not inspect.isfunction(mine):
            continue   # inherited, or a property/classmethod (not a hook called by fedmpi)
        args, kwargs = _call_args(inspect.signature(hook))
        try:
            inspect.signature(mine).bind(*args, **kwargs)
        except TypeError:
            wanted = str(inspect.signature(hook)).split(" ->")[0]
            raise ConfigError(f"config key {key!r}: {cls.__qualname__}.{name}"
                              f"{str(inspect.signature(mine)).split(' ->')[0]} does not accept "
                              f"the arguments fedmpi calls it with: {name}{wanted}") from None
        except ValueError:
            continue


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
