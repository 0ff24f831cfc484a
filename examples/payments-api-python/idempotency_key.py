"""The Idempotency-Key request header (draft-ietf-httpapi-idempotency-key-header):
an RFC 8941 String such as ``"8e03978e-40d5-43e8-bc93-6894a57f9324"``, or, as
older clients send it, one bare run of visible ASCII without quote,
backslash, comma or semicolon.  Keys are 1 to 255 characters (README, "Errors
and HTTP"): anything else is a client error, reported before anything is
claimed.  The same rules as examples/payments-api/idempotency-key.js."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import List, Optional

MAX_KEY_LENGTH = 255
_BARE = re.compile(r"[!#-+\--:<-\[\]-~]+")


@dataclass(frozen=True)
class ParsedKey:
    """``key`` when the header is valid; else ``missing`` and ``reason``."""

    key: Optional[str] = None
    missing: bool = False
    reason: str = ""


def parse_idempotency_key(values: List[str]) -> ParsedKey:
    """Parse the header's values (a header sent twice is malformed)."""
    if not values:
        return ParsedKey(missing=True, reason="The Idempotency-Key header is missing.")
    value = ", ".join(values).strip(" ")
    if value.startswith('"'):
        key = _parse_sf_string(value)
        if key is None:
            return ParsedKey(reason="The Idempotency-Key header is not a valid Structured Field String "
                                    "(printable ASCII inside double quotes, \\\" and \\\\ as the only "
                                    "escapes, nothing after the closing quote).")
    elif _BARE.fullmatch(value):
        key = value
    elif value == "":
        return ParsedKey(missing=True, reason="The Idempotency-Key header is empty.")
    else:
        return ParsedKey(reason="The Idempotency-Key header must be a quoted string, e.g. "
                                'Idempotency-Key: "8e03978e-40d5-43e8-bc93-6894a57f9324".')
    if key == "":
        return ParsedKey(reason="The Idempotency-Key must not be empty.")
    if len(key) > MAX_KEY_LENGTH:
        return ParsedKey(reason=f"The Idempotency-Key has {len(key)} characters; "
                                f"at most {MAX_KEY_LENGTH} are allowed.")
    return ParsedKey(key=key)


def _parse_sf_string(text: str) -> Optional[str]:
    """RFC 8941 4.2.5, the whole input being that one string."""
    out = []
    i = 1
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 1
            if i >= len(text) or text[i] not in '"\\':
                return None
            out.append(text[i])
        elif c == '"':
            return "".join(out) if i == len(text) - 1 else None
        elif not " " <= c <= "~":
            return None
        else:
            out.append(c)
        i += 1
    return None
