"""A client-side ``idem_fingerprint``: the same bytes as the server's.

The server hashes (SHA-256) each argument as a tag byte -- 0 for NULL, 1 for
a value -- and, for a value, the length of its text form as four bytes
big-endian followed by the text form (docs/api.md, "API reference").  So
``('a', 'bc')`` and ``('ab', 'c')`` differ, and so do ``None`` and ``''``.

The text form of a Python value is the one PostgreSQL prints for the type
psycopg sends it as; only types whose text form does not depend on session
settings are accepted (README: pass timestamps and floats as text of a fixed
format).
"""

from __future__ import annotations

import hashlib
import uuid
from decimal import Decimal
from typing import cast

#: the values :func:`fingerprint` accepts
FingerprintValue = None | str | int | bool | Decimal | uuid.UUID


def text_form(value: FingerprintValue) -> str | None:
    """The text form PostgreSQL gives ``value`` (``None`` for NULL).

    ``str`` is itself (``text``); ``bool`` is ``t``/``f`` (``boolean``);
    ``int`` is its decimal digits (``bigint``, ``numeric``); ``Decimal`` is
    ``numeric``'s form (``1.50``, ``100`` for ``1E+2``, ``NaN``); ``UUID`` is
    lower-case with hyphens.  Raises ``TypeError`` for any other type.
    """
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "t" if value else "f"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, Decimal):
        if value.is_nan():
            return "NaN"
        if value.is_infinite():
            return "-Infinity" if value < 0 else "Infinity"
        text = format(value, "f")
        return text.lstrip("-") if value.is_zero() else text
    if isinstance(cast(object, value), uuid.UUID):   # checked at run time: untyped callers
        return str(value)
    raise TypeError(f"cannot fingerprint a {type(value).__name__}: its text form may depend on "
                    "session settings; pass it as str of a fixed format")


def fingerprint(*values: FingerprintValue) -> bytes:
    """``idem_fingerprint(values...)``, computed here: 32 bytes, equal to what
    the server returns for the same values with the types :func:`text_form`
    names.  Raises ``TypeError`` for a value of another type."""
    parts = bytearray()
    for value in values:
        text = text_form(value)
        if text is None:
            parts += b"\x00"
        else:
            encoded = text.encode("utf-8")
            parts += b"\x01" + len(encoded).to_bytes(4, "big") + encoded
    return hashlib.sha256(bytes(parts)).digest()
