"""User code named in the config by import path: ``"pkg.module:attr"`` (Hydra's ``_target_`` habit).

Four config keys accept an import path instead of a built-in name:

==========================  ==============================================================
``model.name``              a callable ``(input_shape, num_classes) -> nn.Module``, or an
                            ``nn.Module`` class taking those two arguments
``data.dataset``            a callable ``() ->`` :class:`fedmpi.data.Dataset`, or ``->``
                            ``(train, test)`` map-style datasets of ``(x, label)`` items
``algorithm.name``          a subclass of :class:`fedmpi.algorithms.Algorithm`; its
                            parameters come from ``algorithm.params``, checked against the
                            class's ``Params`` dataclass (:func:`method_params`)
``aggregation.weighting``   a subclass of :class:`fedmpi.algorithms.Weighting`
``aggregation.rule``        a subclass of :class:`fedmpi.algorithms.ServerRule`; its
                            parameters come from ``aggregation.params``
``data.silos.loader``       a callable ``(client) -> (x, y)`` (:mod:`fedmpi.data.silos`)
``eval.metrics`` items      a function ``(labels, probabilities) -> float``
                            (:mod:`fedmpi.metrics`)
==========================  ==============================================================

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

import dataclasses
import importlib
import inspect
import os
import re
import sys
import typing
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Optional

from .errors import OBJECTS, ConfigError, UserCodeError, UserError, code_error_line, user_frame

__all__ = ["UserCode", "is_import_path", "resolve", "model_factory", "dataset_factory",
           "algorithm_class", "weighting_class", "rule_class", "silo_loader", "method_params", "check_config_paths",
           "path_of"]

_PATTERN = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")


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
        raise UserCodeError(object_name(key), path, exc) from exc
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"config key {key!r}: {module_name!r} has no attribute {attr!r} "
                              f"(expected {expected})")
        obj = getattr(obj, part)
    return obj


def _accepts(obj: Any, nargs: int) -> bool:
    """Whether ``obj(*nargs positional arguments)`` binds (classes: their ``__init__``)."""
    try:
        inspect.signature(obj).bind(*([None] * nargs))
    except TypeError:
        return False
    except ValueError:   # builtins without a signature: give them the benefit of the doubt
        return True
    return True


def _named(obj: Any) -> str:
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
    if not callable(obj) or not _accepts(obj, 2):
        raise ConfigError(f"config key {key!r}: {_named(obj)} is not {MODEL_EXPECTED}")

    def build(input_shape: tuple[int, ...], num_classes: int):
        from torch import nn

        with blame(key, obj):
            model = obj(tuple(input_shape), int(num_classes))
        if not isinstance(model, nn.Module):
            raise ConfigError(f"config key {key!r}: {_named(obj)}({tuple(input_shape)}, "
                              f"{num_classes}) returned {type(model).__name__}, not an nn.Module")
        return model

    return build


# ---------------------------------------------------------------------- data
DATASET_EXPECTED = ("a callable () -> fedmpi.data.Dataset or (train, test) map-style datasets "
                    "of (x, label) items")


def dataset_factory(obj: Any, key: str = "data.dataset") -> Callable[[], Any]:
    """A zero-argument callable returning the pooled :class:`~fedmpi.data.Dataset`
    (converted with :func:`fedmpi.data.custom.as_dataset`)."""
    if isinstance(obj, str):
        obj = resolve(obj, key, DATASET_EXPECTED)
    from .data.custom import as_dataset

    if not callable(obj):   # an object: a Dataset or a (train, test) pair
        return lambda: as_dataset(obj, key)
    if not _accepts(obj, 0):
        raise ConfigError(f"config key {key!r}: {_named(obj)} must be callable without "
                          f"arguments ({DATASET_EXPECTED})")

    def load() -> Any:
        with blame(key, obj):
            made = obj()
        return as_dataset(made, key)

    return load


SILO_EXPECTED = "a callable (client) -> (x, y) arrays"


def silo_loader(obj: Any, key: str = "data.silos.loader") -> Callable[[int], Any]:
    """The per-client loader of silo-local data (called on the hosting rank only)."""
    if isinstance(obj, str):
        obj = resolve(obj, key, SILO_EXPECTED)
    if not callable(obj) or not _accepts(obj, 1):
        raise ConfigError(f"config key {key!r}: {_named(obj)} is not {SILO_EXPECTED}")
    return obj


# ------------------------------------------------------------------ methods
def _subclass(obj: Any, base: type, key: str, expected: str) -> type:
    if isinstance(obj, str):
        obj = resolve(obj, key, expected)
    if not (isinstance(obj, type) and issubclass(obj, base)):
        raise ConfigError(f"config key {key!r}: {_named(obj)} is not {expected}")
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


def algorithm_class(obj: Any, key: str = "algorithm.name") -> type:
    """A subclass of :class:`fedmpi.algorithms.Algorithm` (from a path or the class)."""
    from .algorithms.base import Algorithm

    return _subclass(obj, Algorithm, key, "a subclass of fedmpi.algorithms.Algorithm")


def weighting_class(obj: Any, key: str = "aggregation.weighting") -> type:
    """A subclass of :class:`fedmpi.algorithms.Weighting` (from a path or the class)."""
    from .algorithms.weighting import Weighting

    return _subclass(obj, Weighting, key, "a subclass of fedmpi.algorithms.Weighting")


def rule_class(obj: Any, key: str = "aggregation.rule") -> type:
    """A subclass of :class:`fedmpi.algorithms.ServerRule` (from a path or the class)."""
    from .algorithms.rules import ServerRule

    return _subclass(obj, ServerRule, key, "a subclass of fedmpi.algorithms.ServerRule")


def transform_class(obj: Any, key: str = "transforms") -> type:
    """A subclass of :class:`fedmpi.algorithms.UpdateTransform` (from a path or the class);
    it is constructed with the run's config."""
    from .algorithms.transforms import UpdateTransform

    return _subclass(obj, UpdateTransform, key, "a subclass of fedmpi.algorithms.UpdateTransform")


def method_params(cls: type, given: Mapping[str, Any], key: str = "algorithm.params") -> Any:
    """``algorithm.params`` checked against the method's parameters dataclass.

    Convention (that of :mod:`fedmpi.params` for the built-in methods): a method
    names its parameter dataclasses by config block in the class attribute
    ``params``; a method given by import path reads the block ``algorithm.params``,
    so it declares ``params = {"params": MyParams}`` and gets the instance from
    ``self.hparams("params")``. Fields have defaults where optional and types
    ``int``, ``float``, ``str``, ``bool``, ``list[...]`` or ``X | None`` (the
    config's typing rules: an integer is accepted for a float, never a bool for an
    integer); bounds and choices in a field's metadata (``fedmpi.params.param``,
    keys ``ge``, ``gt``, ``le``, ``lt``, ``choices``) are checked too. Unknown,
    missing and mistyped entries raise a ConfigError naming
    ``algorithm.params.<field>``. Without a ``"params"`` block the mapping must be
    empty. Returns the dataclass instance (None without one).
    """
    spec = (getattr(cls, "params", None) or {}).get("params")
    if spec is None:
        if given:
            raise ConfigError(f"config key {key!r}: {cls.__qualname__} declares no parameters "
                              f"(params = {{'params': <dataclass>}}); got {sorted(given)}")
        return None
    if not dataclasses.is_dataclass(spec) or not isinstance(spec, type):
        raise ConfigError(f"config key {key!r}: {cls.__qualname__}.params['params'] must be a "
                          "dataclass")
    from .config import Field, _check_value, _suggest

    hints = typing.get_type_hints(spec)
    fields = {f.name: f for f in dataclasses.fields(spec) if f.init}
    unknown = sorted(set(given) - set(fields))
    if unknown:
        raise ConfigError(f"config key '{key}.{unknown[0]}' is not a parameter of "
                          f"{cls.__qualname__}{_suggest(unknown[0], list(fields))}; "
                          f"parameters: {', '.join(fields) or 'none'}")
    values = {}
    for name, f in fields.items():
        if name not in given:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(f"config key '{key}.{name}' is required by {cls.__qualname__}")
            continue
        bounds = {k: f.metadata[k] for k in ("ge", "gt", "le", "lt", "choices")
                  if f.metadata.get(k) is not None}
        try:
            field_spec = Field(hints[name], None, **bounds)
        except TypeError:   # a type the config cannot check (e.g. a callable): passed as is
            values[name] = given[name]
            continue
        value = _check_value(f"{key}.{name}", field_spec, given[name])
        values[name] = list(value) if isinstance(value, tuple) else value
    return spec(**values)


# ------------------------------------------------------------ objects in hand
@dataclass(frozen=True)
class UserCode:
    """Objects given to :func:`fedmpi.run` that replace the config's names.

    ``model``: a factory ``(input_shape, num_classes) -> nn.Module`` (or an
    ``nn.Module`` class); ``data``: a :class:`~fedmpi.data.Dataset`, a
    ``(train, test)`` pair or a zero-argument callable returning either;
    ``algorithm``: an :class:`~fedmpi.algorithms.Algorithm` subclass;
    ``weighting``: a :class:`~fedmpi.algorithms.Weighting` subclass; ``rule``: a
    :class:`~fedmpi.algorithms.ServerRule` subclass. None: the config's name.
    Every rank must be given the same objects.
    """

    model: Optional[Callable[..., Any]] = None
    data: Any = None
    algorithm: Optional[type] = None
    weighting: Optional[type] = None
    rule: Optional[type] = None

    def algorithm_class(self, cfg: Any) -> Any:
        """The method class: the one given, else ``algorithm.name``'s."""
        if self.algorithm is not None:
            return algorithm_class(self.algorithm)
        from .algorithms import algorithm_class as by_name

        return by_name(cfg)

    def build_weighting(self, cfg: Any, num_samples: Any) -> Any:
        """The weighting: the class given, else ``aggregation.weighting``'s."""
        if self.weighting is not None:
            return weighting_class(self.weighting)(num_samples)
        from .algorithms import build_weighting

        return build_weighting(cfg.aggregation.weighting, num_samples)

    def rule_class(self, cfg: Any) -> type:
        """The server rule's class: the one given, else ``aggregation.rule``'s."""
        if self.rule is not None:
            return rule_class(self.rule)
        from .algorithms.rules import rule_class_for

        return rule_class_for(cfg.aggregation.rule)


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


# --------------------------------------------------------------- fedmpi check
def check_rule(cfg: Any, rule_cls: Any, algo_cls: Any) -> None:
    """The server rule's parameters and cross-key rules, and that it can combine the
    method's update: a per-client rule needs the model update Δ_k as a *weighted*
    statistic, which the submodel family's coverage averaging is not."""
    if is_import_path(cfg.aggregation.rule):
        method_params(rule_cls, cfg.aggregation.params, "aggregation.params")
    elif cfg.aggregation.params:
        raise ConfigError("config key 'aggregation.params' is for a rule given by import path; "
                          f"{cfg.aggregation.rule!r} takes its parameters from its own keys")
    if rule_cls.per_client and not algo_cls.weighted_update:
        raise ConfigError(f"config keys 'aggregation.rule' and 'algorithm.name': rule "
                          f"{cfg.aggregation.rule!r} combines per-client weighted updates; method "
                          f"{cfg.algorithm.name!r} aggregates its update otherwise (coverage sums)")
    rule_cls.check(cfg)


def check_config_paths(cfg: Any) -> None:
    """Resolve and check every import path of ``cfg`` (``fedmpi check``); raises ConfigError."""
    if is_import_path(cfg.model.name):
        model_factory(cfg.model.name)
    if is_import_path(cfg.data.dataset):
        dataset_factory(cfg.data.dataset)
    if cfg.data.silos.loader is not None:
        silo_loader(cfg.data.silos.loader)
    if is_import_path(cfg.aggregation.weighting):
        weighting_class(cfg.aggregation.weighting)
    rule_cls: Any = UserCode().rule_class(cfg)
    check_rule(cfg, rule_cls, UserCode().algorithm_class(cfg))
    if cfg.privacy.secure_aggregation:
        from .algorithms.weighting import WEIGHTINGS
        from .privacy.secagg import refuse_per_client

        weighting = (weighting_class(cfg.aggregation.weighting)
                     if is_import_path(cfg.aggregation.weighting)
                     else WEIGHTINGS.get(cfg.aggregation.weighting))
        refuse_per_client(cfg, bool(getattr(weighting, "per_client", False)), rule_cls.per_client, [])
    for i, path in enumerate(cfg.transforms):
        transform_class(path, f"transforms[{i}]")
    from .metrics import is_user_metric, user_metric

    for metric in cfg.eval.metrics:
        if is_user_metric(metric):
            user_metric(metric)
    if is_import_path(cfg.algorithm.name):
        method_params(algorithm_class(cfg.algorithm.name), cfg.algorithm.params)
    elif cfg.algorithm.params:
        raise ConfigError(f"config key 'algorithm.params' is for a method given by import path; "
                          f"{cfg.algorithm.name!r} takes its parameters from its own keys")
