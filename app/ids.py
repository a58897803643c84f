"""Identifiers that sort by creation time, so ids double as pagination cursors."""

from __future__ import annotations

import secrets
import time

_ALPHABET = "0123456789abcdefghjkmnpqrstvwxyz"  # Crockford base32, lower case


def _b32(value: int, width: int) -> str:
    out = []
    for _ in range(width):
        value, rem = divmod(value, 32)
        out.append(_ALPHABET[rem])
    return "".join(reversed(out))


def new_id(prefix: str) -> str:
    """`<prefix>_` + 10 chars of milliseconds + 16 random chars (80 bits)."""
    millis = time.time_ns() // 1_000_000
    return f"{prefix}_{_b32(millis, 10)}{_b32(secrets.randbits(80), 16)}"
