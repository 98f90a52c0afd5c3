"""Sizes as people write them: token counts (``1M``, ``128K``) and bytes (``141GiB``, ``2TiB``).

Token counts use binary multipliers, the long-context convention (``1M`` = 2**20 = 1,048,576
tokens, ``128K`` = 131,072). Byte sizes accept IEC units (``KiB`` ``MiB`` ``GiB`` ``TiB``,
powers of 1024), SI units (``KB`` ``MB`` ``GB`` ``TB``, powers of 1000) and bare ``K M G T``,
read as binary (``141G`` = 141 GiB). Fractions are allowed (``1.5M``); the result is rounded
down to a whole number.
"""

from __future__ import annotations

import re

from megatron_flat.plan.model import PlanError

_BINARY = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "P": 1 << 50}
_DECIMAL = {"K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15}
_PATTERN = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([KMGTP]?)(I?B?)\s*$", re.IGNORECASE)


def _parse(text: str, what: str, allow_bytes_suffix: bool) -> int:
    if isinstance(text, bool):
        raise PlanError(f"bad {what} {text!r}")
    if isinstance(text, int):
        value = text
    else:
        match = _PATTERN.match(str(text))
        if not match:
            example = "141GiB, 2TiB or 80GB" if allow_bytes_suffix else "1M or 128K"
            raise PlanError(f"bad {what} {text!r}: expected a number with an optional unit, "
                            f"e.g. {example}")
        number, prefix, suffix = match.groups()
        prefix, suffix = prefix.upper(), suffix.upper()
        if suffix and not allow_bytes_suffix:
            raise PlanError(f"bad {what} {text!r}: a token count takes K, M or G, not {suffix}")
        if suffix == "B" and prefix:  # KB, MB, GB, TB: decimal
            scale = _DECIMAL[prefix]
        elif suffix == "I":  # "Gi" without the B
            raise PlanError(f"bad {what} {text!r}: write {prefix}iB")
        else:  # bare prefix, or KiB/MiB/GiB/TiB, or plain B
            scale = _BINARY[prefix]
        value = int(float(number) * scale)
    if value <= 0:
        raise PlanError(f"bad {what} {text!r}: must be positive")
    return value


def parse_tokens(text) -> int:
    """``"1M"`` -> 1048576, ``"128K"`` -> 131072, ``"5000"`` -> 5000."""
    return _parse(text, "token count", allow_bytes_suffix=False)


def parse_bytes(text) -> int:
    """``"141GiB"`` -> 141 * 2**30, ``"80GB"`` -> 80 * 10**9, ``"2T"`` -> 2 * 2**40."""
    return _parse(text, "memory size", allow_bytes_suffix=True)


def format_bytes(n: float) -> str:
    """Binary units with two decimals (``"132.45 GiB"``); plain bytes below 1 KiB."""
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def format_tokens(n: int) -> str:
    """``1048576`` -> ``"1M"``, ``1572864`` -> ``"1.5M"``, ``3000`` -> ``"3000"``."""
    for unit, size in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= size and (n * 100) % size == 0:
            value = n / size
            return f"{value:g}{unit}"
    return str(n)
