"""One loader for every YAML-backed config dataclass, and the one error type that names the bad field.

`load_config(cls, data, prefix)` turns plain data (what `yaml.safe_load` gives) into the dataclass `cls`:
- a key that is not a field of its dataclass is refused, and a field without a default must be given;
- each value is checked against its field's type hint: bool, int, float (an int is taken as a float), str,
  Any, Literal[...], unions and `X | None`, list[X], tuple[X, ...] and tuple[X, Y] (from a YAML list),
  dict[str, X], and nested dataclasses, built the same way. A null section (a nested dataclass, or a list of
  them, given as null, e.g. a YAML key whose entries are all commented out) means its defaults;
- a field may bring its own parser instead, in its metadata: `field(metadata={"parse": fn})`, where
  fn(value, dotted_name) returns the value or raises SpecError (the simulator's quantities with units);
- a field may declare its bounds beside it: `bounded(default, ge=1)`, `bounded(0.9, gt=0, lt=1)`,
  `bounded("auto", choices=("auto", "dense"))`, `bounded(120.0, gt=0, unit="seconds")`; `check_bounds(obj,
  prefix)` (called by the object's `validate`) checks every such field's type and bounds, with one wording;
- finally the root object's `validate(prefix)` runs. Validate methods check their parts too, so an object
  built in code is checked exactly like one loaded from YAML.

Every refusal is a `SpecError` whose `field` is the dotted path of the bad value from the root of the file:
``layout.trainer.gpus_per_task``, ``tasks[0].lora.rank``, ``tenant_quotas.bob.max_tasks``. Items of a list
of config objects are named `name[i]`, entries of a mapping of them `name.key`; a list or mapping of plain
values is checked, and named, as a whole. Error subclasses (`LayoutError`) are chosen by the caller.

This module imports nothing of the project, so every package may import it without a cycle.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import types
import typing
from typing import Any, Iterator, Literal, TypeVar

T = TypeVar("T")


class SpecError(ValueError):
    """A config or spec field is invalid. `field` is the dotted path of the field, e.g. ``algo.group_size``;
    `reason` what is wrong with it. str() is ``"<field>: <reason>"``."""

    def __init__(self, field_name: str, message: str):
        self.field = field_name
        self.reason = message
        super().__init__(f"{field_name}: {message}")

    def under(self, prefix: str) -> "SpecError":
        """The same error (same class) for a field one level down: its field becomes `prefix.field`."""
        return type(self)(join(prefix, self.field), self.reason)


def join(prefix: str, name: str) -> str:
    """Dotted path of field `name` inside the object at `prefix` ('' for the root); list items ('[0]') join
    without a dot."""
    if not prefix:
        return name
    return f"{prefix}{name}" if name.startswith("[") else f"{prefix}.{name}"


@contextlib.contextmanager
def fields_under(prefix: str) -> Iterator[None]:
    """Errors raised inside name fields relative to `prefix`: for checks written relative to their own object
    (a job layout validated as the job config's `layout`)."""
    try:
        yield
    except SpecError as exc:
        if not prefix:
            raise
        raise exc.under(prefix) from None


def check_fields(cls: type, data: Any, where: str, prefix: str = "",
                 error: type[SpecError] = SpecError) -> dict[str, dataclasses.Field]:
    """Refuses `data` unless it is a mapping whose keys are all fields of the dataclass `cls`; returns those
    fields by name. `where` names the mapping, `prefix` (ending in '.', or '') its keys."""
    if not isinstance(data, dict):
        raise error(where, f"must be a mapping, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields), key=str)
    if unknown:
        raise error(f"{prefix}{unknown[0]}", f"unknown field (known: {sorted(fields)})")
    return fields


def load_config(cls: type[T], data: Any, prefix: str = "", *, error: type[SpecError] = SpecError,
                root: str = "config") -> T:
    """The validated `cls` built from plain data (None: every default). `prefix` is the dotted path of the
    object in its file ('' at the root, where a non-mapping is reported as `root`)."""
    obj = _build(cls, {} if data is None else data, prefix, error, root)
    validate = getattr(obj, "validate", None)
    if validate is not None:
        validate(prefix)
    return obj


# ---------------------------------------------------------------------------------------------- bounds
@dataclasses.dataclass(frozen=True)
class Bounds:
    """What a field's value may be, beside its type hint (`bounded`)."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    choices: tuple | None = None
    unit: str = ""
    """Named in the refusal: 'must be a number of seconds > 0'."""

    def allows(self, value: Any) -> bool:
        if self.choices is not None:
            return value in self.choices
        if isinstance(value, float) and not math.isfinite(value):
            return False  # NaN passes every comparison, inf every lower bound
        return not ((self.ge is not None and value < self.ge) or (self.gt is not None and value <= self.gt)
                    or (self.le is not None and value > self.le) or (self.lt is not None and value >= self.lt))

    def describe(self, hint: Any) -> str:
        """'true or false', "one of ['a', 'b']", 'an integer >= 1', 'a number of MiB in (0, 1)'."""
        if hint is bool:
            return "true or false"
        if self.choices is not None:
            return f"one of {list(self.choices)}"
        kind = ("an integer" if hint is int else "a number") + (f" of {self.unit}" if self.unit else "")
        low = f"[{self.ge}" if self.ge is not None else f"({self.gt}" if self.gt is not None else None
        high = f"{self.le}]" if self.le is not None else f"{self.lt})" if self.lt is not None else None
        if low and high:
            return f"{kind} in {low}, {high}"
        if low:
            return f"{kind} {'>=' if self.ge is not None else '>'} {low[1:]}"
        if high:
            return f"{kind} {'<=' if self.le is not None else '<'} {high[:-1]}"
        return kind


def bounded(default: Any = dataclasses.MISSING, *, ge: float | None = None, gt: float | None = None,
            le: float | None = None, lt: float | None = None, choices: tuple | None = None,
            unit: str = "") -> Any:
    """A dataclass field with its bounds beside it, read by `check_bounds`."""
    return dataclasses.field(default=default, metadata={"bounds": Bounds(ge, gt, le, lt, choices, unit)})


def check_bounds(obj: Any, prefix: str = "", error: type[SpecError] = SpecError) -> None:
    """Every field of the dataclass `obj` declared with `bounded`: its value must have its hint's type and lie in
    its bounds; else `error` naming the field (`prefix.name`)."""
    hints = _hints(type(obj))
    for spec in dataclasses.fields(obj):
        bounds = spec.metadata.get("bounds")
        if bounds is None:
            continue
        value, hint = getattr(obj, spec.name), hints[spec.name]
        args = typing.get_args(hint)
        if _is_union(typing.get_origin(hint)) and type(None) in args:  # `int | None`: None means "not set"
            if value is None:
                continue
            hint = next(arg for arg in args if arg is not type(None))
        try:
            _scalar(value, hint) if hint in (bool, int, float, str) else _plain(value, hint)
            ok = bounds.allows(value)
        except (_Mismatch, TypeError):
            ok = False
        if not ok:
            wanted = bounds.describe(hint)
            if isinstance(value, float) and not math.isfinite(value):  # YAML's .nan / .inf
                wanted = wanted.replace("a number", "a finite number", 1)
            raise error(join(prefix, spec.name), f"must be {wanted}, got {value!r}")


# ---------------------------------------------------------------------------------------------- building
def _build(cls: type, data: Any, prefix: str, error: type[SpecError], root: str = "config") -> Any:
    fields = check_fields(cls, data, prefix or root, f"{prefix}." if prefix else "", error)
    hints = _hints(cls)
    kwargs = {}
    for key, value in data.items():
        name = join(prefix, key)
        parse = fields[key].metadata.get("parse")
        kwargs[key] = parse(value, name) if parse else _convert(value, hints[key], name, error)
    for key, spec in fields.items():
        if spec.init and key not in kwargs and spec.default is dataclasses.MISSING \
                and spec.default_factory is dataclasses.MISSING:
            raise error(join(prefix, key), "is required")
    return cls(**kwargs)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _convert(value: Any, hint: Any, name: str, error: type[SpecError]) -> Any:
    if dataclasses.is_dataclass(hint):
        return _build(hint, {} if value is None else value, name, error)
    if _holds_dataclass(hint):
        return _convert_sections(value, hint, name, error)
    try:
        return _plain(value, hint)
    except _Mismatch:
        raise error(name, f"expected {describe(hint)}, got {value!r}") from None


def _convert_sections(value: Any, hint: Any, name: str, error: type[SpecError]) -> Any:
    """A list, mapping or optional of config objects: each one is built and named on its own."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if _is_union(origin):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) != 1:
            raise TypeError(f"{name}: a union of several config types cannot be loaded")
        return _convert(value, inner[0], name, error)
    if origin is list:
        value = [] if value is None else value
        if not isinstance(value, list):
            raise error(name, f"expected a list, got {value!r}")
        return [_convert(item, args[0], f"{name}[{i}]", error) for i, item in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(key, str) for key in value):
            raise error(name, f"expected a mapping of names to {_plural(args[1])}, got {value!r}")
        return {key: _convert(item, args[1], join(name, key), error) for key, item in value.items()}
    raise TypeError(f"{name}: cannot load a {hint}")


def _holds_dataclass(hint: Any) -> bool:
    return dataclasses.is_dataclass(hint) or any(_holds_dataclass(a) for a in typing.get_args(hint))


def _is_union(origin: Any) -> bool:
    return origin is typing.Union or origin is types.UnionType


class _Mismatch(Exception):
    """A plain value does not have its hint's type (reported by the caller, which knows the field)."""


def _plain(value: Any, hint: Any) -> Any:
    """`value` checked against a hint made of plain types, converted where YAML's form differs (list -> tuple,
    int -> float)."""
    if hint is Any:
        return value
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if _is_union(origin):
        for arg in args:
            with contextlib.suppress(_Mismatch):
                return _plain(value, arg)
        raise _Mismatch
    if origin is Literal:
        if any(value == a and type(value) is type(a) for a in args):
            return value
        raise _Mismatch
    if origin in (list, tuple, dict):
        return _container(value, origin, args)
    return _scalar(value, hint)


def _scalar(value: Any, hint: Any) -> Any:
    if hint is type(None) and value is None:
        return value
    if hint is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if hint is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if hint in (bool, str) and isinstance(value, hint):
        return value
    if hint in (list, dict) and isinstance(value, hint):
        return value
    raise _Mismatch


def _container(value: Any, origin: type, args: tuple) -> Any:
    if origin is dict:
        if not isinstance(value, dict):
            raise _Mismatch
        key_hint, value_hint = args or (Any, Any)
        return {_plain(k, key_hint): _plain(v, value_hint) for k, v in value.items()}
    if not isinstance(value, (list, tuple)):
        raise _Mismatch
    if origin is list:
        return [_plain(v, args[0] if args else Any) for v in value]
    if len(args) == 2 and args[1] is Ellipsis:
        return tuple(_plain(v, args[0]) for v in value)
    if len(value) != len(args):
        raise _Mismatch
    return tuple(_plain(v, a) for v, a in zip(value, args))


_NAMES = {int: ("an integer", "integers"), float: ("a number", "numbers"), bool: ("true or false", "booleans"),
          str: ("a string", "strings"), type(None): ("null", "nulls"), list: ("a list", "lists"),
          dict: ("a mapping", "mappings")}


def describe(hint: Any) -> str:
    """A type hint as error messages say it: 'an integer or null', 'a list of strings', "one of ['a', 'b']"."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if _is_union(origin):
        return " or ".join(describe(a) for a in args)
    if origin is Literal:
        return f"one of {list(args)}"
    if hint is Any:
        return "any value"
    if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
        return f"a list of {len(args)} ({', '.join(describe(a) for a in args)})"
    if origin in (list, tuple):
        return f"a list of {_plural(args[0])}"
    if origin is dict:
        return f"a mapping of names to {_plural(args[1])}"
    return _NAMES[hint][0] if hint in _NAMES else getattr(hint, "__name__", str(hint))


def _plural(hint: Any) -> str:
    if hint is Any:
        return "values"
    if hint in _NAMES:
        return _NAMES[hint][1]
    return f"values of type {getattr(hint, '__name__', hint)}" if typing.get_origin(hint) is None \
        else f"values ({describe(hint)})"
