"""The one encoder of stored responses and checkpoint states, and its decoder.

A decorated function's result is stored as JSON (jsonb) -- what psql, an
HTTP layer or another client sees -- and restored on replay to the type the
function's return annotation (or ``result_type=``) names.  The type is taken
from the annotation, never from the stored data: a stored response cannot
make the client build a type it was not told of.  So that the restoring is
exact, the stored form loses nothing the annotation cannot give back:

======================  ==========================================  ============================
Python value            stored as (JSON)                            restored when annotated as
======================  ==========================================  ============================
``None``, ``bool``,     itself (an ``int`` stays an ``int`` of any  itself
``int``, ``str``,       size, never a float; ``NaN`` and infinities
finite ``float``        are refused)
``Decimal``             its exact text, ``"12.50"``                 ``Decimal``
``datetime``, ``date``, ISO 8601 text, offset and microseconds      ``datetime``, ``date``,
``time``                kept, ``"2026-01-02T03:04:05.000006+00:00"``  ``time``
``UUID``                ``"0b1e..."`` (lower case, hyphens)         ``UUID``
``Enum`` member         its value, encoded                          the ``Enum`` class
dataclass instance      an object of its fields, encoded            the dataclass (fields by
                                                                    their annotations)
pydantic model (1, 2)   ``model_dump(mode="json")`` (1: ``.json()``)  the model (validated)
``dict``                an object (keys ``str``, or ``int``, which  ``dict[K, V]``, ``Mapping``
                        JSON turns into text), values encoded
``list``, ``tuple``     an array, items encoded                     ``list[X]``, ``tuple[...]``
======================  ==========================================  ============================

Anything else (a ``set``, an arbitrary object, ``bytes``) raises
``TypeError`` before anything is sent.  ``X | None`` and other unions are
restored by trying their members in order; an annotation of a JSON type
(``dict``, ``Any``, none at all) returns the stored JSON as it is.  pydantic
is never imported here: a model is recognised by its methods, so without
pydantic installed nothing changes but that path.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import types
import typing
import uuid
from collections.abc import Mapping, Sequence
from datetime import date, datetime, time
from decimal import Decimal
from typing import Any, cast

from psycopg.types.json import Jsonb

__all__ = ["encode", "decode", "to_jsonb", "dumps"]


def encode(value: Any) -> Any:
    """``value`` as JSON types (the table above); ``TypeError`` or
    ``ValueError`` for what cannot be stored."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"cannot store the float {value!r} as JSON")
        return value
    if isinstance(value, enum.Enum):
        return encode(value.value)
    if isinstance(value, Decimal):
        return str(value)
    if isinstance(value, (datetime, date, time)):
        return value.isoformat()
    if isinstance(value, uuid.UUID):
        return str(value)
    if hasattr(value, "model_dump") and hasattr(type(cast(object, value)), "model_validate"):   # pydantic 2
        return value.model_dump(mode="json")
    if hasattr(value, "json") and hasattr(type(cast(object, value)), "parse_obj"):              # pydantic 1
        return json.loads(value.json())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: encode(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        out: dict[Any, Any] = {}
        for k, v in cast(Mapping[Any, Any], value).items():
            if not isinstance(k, (str, int)) or isinstance(k, bool):
                raise TypeError(f"cannot store a dict key of type {type(k).__name__} as JSON")
            out[k] = encode(v)
        return out
    if isinstance(value, (list, tuple)):
        return [encode(v) for v in cast(Sequence[Any], value)]
    raise TypeError(f"cannot store a {type(value).__name__} as JSON (see idempotency_pg.encoding)")


def dumps(value: Any) -> str:
    """:func:`encode`'s result as JSON text."""
    return json.dumps(encode(value), allow_nan=False)


def to_jsonb(value: Any) -> Jsonb:
    """``value`` as a jsonb parameter, encoded here, before any statement is
    sent: a value that cannot be stored raises with nothing sent."""
    text = dumps(value)
    return Jsonb(None, dumps=lambda _: text)


_NONE = type(None)


def decode(value: Any, annotation: Any) -> Any:
    """The stored JSON ``value`` as ``annotation`` says (the table above).
    ``TypeError`` or ``ValueError`` when a value cannot be restored to a type
    that needs restoring (a ``datetime`` from a number)."""
    if annotation is None or annotation is Any or annotation is object:
        return value
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        return decode(value, args[0])
    if origin is typing.Union or (hasattr(types, "UnionType") and isinstance(annotation, types.UnionType)):
        if value is None and _NONE in args:
            return None
        for member in args:
            if member is _NONE:
                continue
            try:
                return decode(value, member)
            except (TypeError, ValueError):
                continue
        return value
    if origin is typing.Literal:
        return value
    if origin is not None:
        return _decode_generic(value, origin, args)
    if not isinstance(annotation, type):
        return value          # a TypeVar, a string that was never resolved, ...
    return _decode_class(value, annotation)


def _decode_generic(value: Any, origin: Any, args: tuple[Any, ...]) -> Any:
    import collections.abc as abc
    if isinstance(origin, type) and issubclass(origin, tuple):
        if not isinstance(value, list):
            return _decode_class(value, cast(type[Any], origin))
        items = cast(Sequence[Any], value)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(decode(v, args[0]) for v in items)
        if args and len(args) == len(items):
            return tuple(decode(v, a) for v, a in zip(items, args))
        return tuple(items)
    if isinstance(origin, type) and issubclass(origin, (dict, abc.Mapping)):
        if not isinstance(value, dict):
            return value
        vt = args[1] if len(args) == 2 else Any
        return {k: decode(v, vt) for k, v in cast(Mapping[Any, Any], value).items()}
    if isinstance(origin, type) and issubclass(origin, (list, abc.Sequence)) and not issubclass(origin, str):
        if not isinstance(value, list):
            return value
        it = args[0] if args else Any
        return [decode(v, it) for v in cast(Sequence[Any], value)]
    return value


def _decode_class(value: Any, cls: type[Any]) -> Any:
    if cls in (dict, list, str, int, float, bool, _NONE):
        return value          # JSON's own types: as stored
    if tuple in cls.__mro__ and not hasattr(cls, "_fields"):   # issubclass would narrow cls
        return tuple(cast(Sequence[Any], value)) if isinstance(value, list) else value
    if hasattr(cls, "model_validate"):                                 # pydantic 2
        return cls.model_validate(value)
    if hasattr(cls, "parse_obj") and hasattr(cls, "__fields__"):      # pydantic 1
        return cls.parse_obj(value)
    if issubclass(cls, enum.Enum):
        return cls(value)
    if issubclass(cls, Decimal):
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise TypeError(f"cannot restore a Decimal from {value!r}")
        return cls(str(value))
    if issubclass(cls, datetime):
        return cls.fromisoformat(_text(value, cls))
    if issubclass(cls, date):
        return cls.fromisoformat(_text(value, cls))
    if issubclass(cls, time):
        return cls.fromisoformat(_text(value, cls))
    if issubclass(cls, uuid.UUID):
        return cls(_text(value, cls))
    if dataclasses.is_dataclass(cls):
        if not isinstance(value, dict):
            raise TypeError(f"cannot restore a {cls.__name__} from {value!r}")
        hints = _hints(cls)
        kwargs = {f.name: decode(value[f.name], hints.get(f.name))
                  for f in dataclasses.fields(cls) if f.init and f.name in value}
        return cls(**kwargs)
    if isinstance(value, cls):
        return value
    raise TypeError(f"cannot restore a {cls.__name__} from stored JSON")


def _text(value: Any, cls: type) -> str:
    if not isinstance(value, str):
        raise TypeError(f"cannot restore a {cls.__name__} from {value!r}")
    return value


def _hints(cls: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls)
    except Exception:  # an annotation that does not resolve: keep those fields as stored
        return {}


def result_annotation(func: Any) -> Any | None:
    """The return annotation of ``func``, resolved; ``None`` when it has
    none or it cannot be resolved (then the stored JSON is returned as is)."""
    try:
        return typing.get_type_hints(func).get("return")
    except Exception:
        return None
