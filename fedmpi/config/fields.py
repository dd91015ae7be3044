"""Config keys one at a time: the declaration of a key (:class:`Field`) and the check of
one value against it (:func:`check_value`).

Typing rules: an integer is accepted where a float is expected (and stored as
float); ``bool`` is never an integer; a string is never a number; lists are
typed (``list[int]``, ``list[float]``); ``null`` is accepted only for fields
whose type is ``X | None``. Every problem raises :class:`~fedmpi.errors.ConfigError`
with a one-line message that names the dotted key and says what is expected.
The schema of a run and the config built from it are :mod:`fedmpi.config.core`.
"""
from __future__ import annotations

import difflib
import math
import re
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fedmpi.errors import ConfigError

__all__ = ["Field", "check_value", "deep_copy_mapping", "describe_allowed", "got_text", "plain",
           "suggest"]

_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "a boolean",
               dict: "a mapping"}
_ITEM_NAMES = {int: "integers", float: "numbers", str: "strings", bool: "booleans"}


@dataclass(frozen=True)
class Field:
    """Declaration of one config key.

    Args:
        type: ``int``, ``float``, ``str``, ``bool``, ``list[int]``, ``list[float]``,
            ``list[str]``, each optionally ``| None`` (then ``null`` is allowed); or
            ``dict``: a free-form mapping (``algorithm.params``) whose entries are
            validated later by whoever consumes them, set whole or entry by entry
            (``--set algorithm.params.width=8``).
        default: value used when no source sets the key.
        help: one-line description for humans.
        choices: allowed values (strings; for ``list[str]`` each item). Together
            with ``pattern``, a value is accepted if it is one of the choices *or*
            fully matches the pattern.
        pattern: regular expression (``re.fullmatch``) for accepted strings.
        pattern_help: how to describe ``pattern`` in error messages.
        ge, gt, le, lt: inclusive / exclusive bounds for numbers (for lists:
            for each item).
        file: the value is a file path; a relative path is resolved against
            the config file's directory when it exists there, else the CWD,
            and stored absolute.
    """

    type: Any
    default: Any
    help: str = ""
    choices: tuple[str, ...] | None = None
    pattern: str | None = None
    pattern_help: str | None = None
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    file: bool = False
    #: the value names an entry of a live registry (method or weighting names):
    #: ``choices`` lists the built-ins for the docs; names registered later count too
    registry: Callable[[], Iterable[str]] | None = field(default=None, compare=False)
    # Derived from ``type`` in __post_init__.
    base: type = field(init=False, repr=False, compare=False)
    item: type | None = field(init=False, repr=False, compare=False)
    optional: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        tp, optional = self.type, False
        if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
            args = [a for a in typing.get_args(tp) if a is not type(None)]
            if len(args) != 1:
                raise TypeError(f"unsupported field type {tp!r}")
            tp, optional = args[0], True
        item = None
        if typing.get_origin(tp) is list:
            (item,) = typing.get_args(tp)
            tp = list
        if tp not in (int, float, str, bool, list, dict) or item not in (None, int, float, str, bool):
            raise TypeError(f"unsupported field type {self.type!r}")
        object.__setattr__(self, "base", tp)
        object.__setattr__(self, "item", item)
        object.__setattr__(self, "optional", optional)

    @property
    def type_name(self) -> str:
        """Human name of the accepted type, e.g. ``'a list of integers or null'``."""
        name = f"a list of {_ITEM_NAMES[self.item]}" if self.base is list else _TYPE_NAMES[self.base]
        return name + (" or null" if self.optional else "")

    @property
    def range_text(self) -> str | None:
        """Accepted range in words, e.g. ``'in [0, 1)'`` or ``'> 0'``; None if unbounded."""
        lo = ("[", self.ge) if self.ge is not None else ("(", self.gt) if self.gt is not None else None
        hi = ("]", self.le) if self.le is not None else (")", self.lt) if self.lt is not None else None
        if lo and hi:
            return f"in {lo[0]}{_fmt(lo[1])}, {_fmt(hi[1])}{hi[0]}"
        if lo:
            return (">= " if lo[0] == "[" else "> ") + _fmt(lo[1])
        if hi:
            return ("<= " if hi[0] == "]" else "< ") + _fmt(hi[1])
        return None

    def in_range(self, x: float) -> bool:
        """Whether number ``x`` satisfies the bounds (NaN never does if any bound is set)."""
        return not (
            (self.ge is not None and not x >= self.ge)
            or (self.gt is not None and not x > self.gt)
            or (self.le is not None and not x <= self.le)
            or (self.lt is not None and not x < self.lt)
        )


def deep_copy_mapping(m: Mapping) -> dict:
    """``m`` as a plain dict, nested mappings copied too."""
    return {k: deep_copy_mapping(v) if isinstance(v, Mapping) else v for k, v in m.items()}


def plain(value: Any) -> Any:
    """A caller's copy of a stored value: lists and tuples as fresh lists, mappings copied;
    anything else as it is."""
    if isinstance(value, (list, tuple)):
        return list(value)
    return deep_copy_mapping(value) if isinstance(value, Mapping) else value


def _fmt(x: float) -> str:
    return repr(x) if isinstance(x, int) else f"{x:g}"


def got_text(value: Any) -> str:
    """``got <value> (<type>)`` for messages, ``got null`` for None."""
    return "got null" if value is None else f"got {value!r} ({type(value).__name__})"


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _coerce_scalar(tp: type, x: Any) -> tuple[bool, Any]:
    """Return ``(ok, value)`` for scalar ``x`` against type ``tp`` (int -> float widening)."""
    if tp is float:
        # float(): a numpy float64 (a float subclass) is stored as a plain float
        ok = _is_int(x) or isinstance(x, float)
        return ok, (float(x) if ok else x)
    if tp is int:
        return _is_int(x), x
    return isinstance(x, tp), x


def suggest(word: str, options: Sequence[str]) -> str:
    match = difflib.get_close_matches(word, options, n=1)
    return f" (did you mean {match[0]!r}?)" if match else ""


#: Largest float32: the model and its updates are float32, so a larger (or non-finite)
#: float key would turn the run into inf/NaN arithmetic (issue 18).
FLOAT32_MAX = 3.4028234663852886e38


def _check_finite(key: str, f: Field, x: Any, where: str = "") -> None:
    """Reject NaN, ±inf and floats beyond float32 range for a float key."""
    if isinstance(x, float) and not (math.isfinite(x) and abs(x) <= FLOAT32_MAX):
        bounds = f" {f.range_text}" if f.range_text else ""
        raise ConfigError(f"config key {key!r} must be a finite number{bounds} with |x| <= "
                          f"{FLOAT32_MAX:.4g} (float32){where}, got {x!r}")


def check_value(key: str, f: Field, value: Any) -> Any:
    """Validate one value against its field; return it normalised (floats, tuples)."""
    if value is None:
        if f.optional:
            return None
        raise ConfigError(f"config key {key!r} expects {f.type_name}, got null")
    if f.base is dict:
        if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
            raise ConfigError(f"config key {key!r} expects a mapping with string keys, "
                              f"{got_text(value)}")
        return {k: value[k] for k in value}
    if f.base is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"config key {key!r} expects {f.type_name}, {got_text(value)}")
        items = []
        for i, x in enumerate(value):
            ok, x = _coerce_scalar(f.item, x)
            if not ok:
                raise ConfigError(f"config key {key!r} expects {f.type_name}; item {i} is "
                                  f"{'null' if x is None else f'{x!r} ({type(x).__name__})'}")
            if f.item is float:
                _check_finite(key, f, x, f"; item {i}")
            if f.item in (int, float) and not f.in_range(x):
                raise ConfigError(
                    f"config key {key!r} items must each be {f.range_text}; item {i} is {x!r}")
            matches = f.pattern is not None and isinstance(x, str) and \
                re.fullmatch(f.pattern, x) is not None
            if f.choices is not None and x not in f.choices and not matches:
                alt = f" or {f.pattern_help}" if f.pattern_help else ""
                raise ConfigError(f"config key {key!r} item {i} expects one of "
                                  f"{', '.join(f.choices)}{alt}, got {x!r}"
                                  f"{suggest(x, f.choices)}")
            if f.choices is not None and x in items:
                raise ConfigError(f"config key {key!r} lists {x!r} twice")
            if f.choices is None and f.pattern is not None and not matches:
                raise ConfigError(f"config key {key!r} item {i} expects "
                                  f"{f.pattern_help or f.pattern}, got {x!r}")
            items.append(x)
        return tuple(items)
    ok, value = _coerce_scalar(f.base, value)
    if not ok:
        raise ConfigError(f"config key {key!r} expects {f.type_name}, {got_text(value)}")
    if f.base is float:
        _check_finite(key, f, value)
    if f.base in (int, float) and not f.in_range(value):
        raise ConfigError(f"config key {key!r} must be {f.range_text}, got {value!r}")
    if f.choices is not None or f.pattern is not None:
        choices = tuple(f.registry()) if f.registry else f.choices
        if not ((choices and value in choices)
                or (f.pattern and re.fullmatch(f.pattern, value))):
            allowed = ", ".join(choices or ())
            if f.pattern:
                alt = f.pattern_help or f"a string matching {f.pattern}"
                allowed = f"{allowed} or {alt}" if allowed else alt
            hint = suggest(value, choices) if choices else ""
            raise ConfigError(
                f"config key {key!r} expects one of {allowed}, got {value!r}{hint}"
                if choices else f"config key {key!r} expects {allowed}, got {value!r}")
    return value


def describe_allowed(field: Field) -> str:
    """Allowed values of ``field`` in words (for the reference table)."""
    parts = []
    if field.choices:
        parts.append(" \\| ".join(f"`{c}`" for c in field.choices))
    if field.pattern_help:
        parts.append(f"`{field.pattern_help}`")
    for op, bound in (("≥", field.ge), (">", field.gt), ("≤", field.le), ("<", field.lt)):
        if bound is not None:
            parts.append(f"{op} {bound:g}")
    return ", ".join(parts)
