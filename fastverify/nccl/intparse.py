"""How NCCL reads an integer setting: C's ``strtoll(value, &end, 0)`` (glibc) and the
``NCCL_PARAM`` loader around it (``src/misc/param.cc`` ``ncclLoadParam``).

Decimal, ``0x`` hexadecimal and leading-``0`` octal are read; text after the digits is what
``strtoll`` leaves unread, which NCCL ignores.
"""

from __future__ import annotations

from typing import NamedTuple

from fastverify.nccl.findings import Severity, Verdict, show

C_SPACE = " \t\n\v\f\r"  # what C isspace() skips
_INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INT32_MAX = 2**31 - 1
_DIGITS = {8: "01234567", 10: "0123456789", 16: "0123456789abcdefABCDEF"}


class CInt(NamedTuple):
    """What ``strtoll`` returns, and how far it read."""

    value: int | None  # None: out of int64 range (strtoll sets ERANGE)
    digits: bool  # at least one digit was read
    rest: str  # what strtoll left unread
    base: int


def strtoll(text: str) -> CInt:
    """What C's ``strtoll(text, &end, 0)`` returns (glibc): value, whether it read digits, the tail."""
    i, n = 0, len(text)
    while i < n and text[i] in C_SPACE:
        i += 1
    sign = 1
    if i < n and text[i] in "+-":
        sign = -1 if text[i] == "-" else 1
        i += 1
    base = 10
    if text.startswith(("0x", "0X"), i) and i + 2 < n and text[i + 2] in _DIGITS[16]:
        base, i = 16, i + 2
    elif i < n and text[i] == "0":
        base = 8
    start = i
    while i < n and text[i] in _DIGITS[base]:
        i += 1
    if i == start:
        return CInt(0, False, text, 10)
    if len(text[start:i].lstrip("0")) > 24:  # beyond int64 in any base; also avoids int()'s digit limit
        return CInt(None, True, text[i:], base)
    value = sign * int(text[start:i], base)
    return CInt(value if _INT64_MIN <= value <= INT64_MAX else None, True, text[i:], base)


def param_int(value: str, default: str) -> tuple[int | None, Verdict | None]:
    """How an ``NCCL_PARAM`` integer reads ``value`` (src/misc/param.cc ``ncclLoadParam``).

    Returns the integer NCCL uses and an optional verdict about the text itself; the integer is
    ``None`` when NCCL uses its default instead (then the verdict says why).
    """
    if value == "":
        return None, Verdict(Severity.WARNING, f"empty: NCCL treats it as unset (default {default})",
                             "remove the variable or give a value")
    c = strtoll(value)
    if not c.digits:
        return None, Verdict(Severity.ERROR, f"{show(value)} is not an integer: NCCL's strtoll reads it as 0",
                             "write an integer")
    if c.value is None:
        return None, Verdict(Severity.ERROR, f"{show(value)} is out of the 64-bit range: NCCL uses the default "
                             f"({default})", "write a smaller integer")
    note = None
    if c.rest.strip(C_SPACE):
        return None, Verdict(Severity.ERROR, f"NCCL reads only the leading {c.value} of {show(value)} "
                             f"and ignores {show(c.rest)}", "write plain digits (no units, decimals or exponents)")
    if c.base == 8 and c.value != int(value.strip(C_SPACE), 10):
        note = Verdict(Severity.WARNING, f"the leading 0 makes NCCL read {show(value)} as octal = {c.value}",
                       "drop the leading 0")
    elif c.base == 16:
        note = Verdict(Severity.OK, f"hexadecimal, = {c.value}")
    return c.value, note
