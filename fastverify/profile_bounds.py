"""A profile field past fastverify's plausibility bounds (:mod:`fastverify.bounds`), said in words:
msgspec's constraint message turned into the field's JSON path, its value and what the bound is.
Shared by the strict decoder (:mod:`fastverify.profile_record`) and tune's lenient view
(:mod:`fastverify.profile_view`)."""

from __future__ import annotations

import re
from typing import Any

import msgspec

from fastverify.bounds import MAX_BATCH, MAX_COUNT, MAX_DRAFT_TOKENS, MAX_EVENT_US, MAX_HIDDEN, MAX_MSG_BYTES

BOUND_NAMES = {
    MAX_MSG_BYTES: "1 TiB, fastverify's bound on one message",
    MAX_EVENT_US: "1 hour in µs, fastverify's bound on a time",
    MAX_COUNT: "fastverify's bound on a count", MAX_HIDDEN: "fastverify's bound on a hidden size",
    MAX_BATCH: "fastverify's bound on a batch", MAX_DRAFT_TOKENS: "fastverify's bound on draft tokens",
    MAX_BATCH * MAX_DRAFT_TOKENS: "fastverify's bound on tokens per step",
}
"""Each upper bound of the profile's fields → what it bounds, in words."""

_CONSTRAINT = re.compile(r"^Expected `(\w+)` (>=|<=) (-?[0-9.e+]+) - at `\$(.*)`$")
_PATH_PART = re.compile(r"\.([A-Za-z_][A-Za-z0-9_]*)|\[([0-9]+)\]|\[\.\.\.\]")


def _value_at(data: bytes, path: str) -> Any:
    """The JSON value at msgspec's ``path`` (``.ranks[0].msg_bytes``) in ``data``; None where the
    walk cannot follow it (a dict value, ``[...]``)."""
    value: Any = msgspec.json.decode(data)  # valid JSON: the typed decode got as far as a value
    for part in _PATH_PART.finditer(path):
        key, index = part.group(1), part.group(2)
        if key is not None and isinstance(value, dict) and key in value:
            value = value[key]
        elif index is not None and isinstance(value, list) and int(index) < len(value):
            value = value[int(index)]
        else:  # a dict value (``[...]``) or a path this walk does not follow: no value to show
            return None
    return value


def out_of_bounds(text: str, data: bytes) -> str | None:
    """msgspec's message for a value past a bound (``Expected `int` <= 1099511627776 - at
    `$.allreduce_by_msg_size[0].msg_bytes```), said with the value and what the bound is:
    ``allreduce_by_msg_size[0].msg_bytes = 1000000000000000 is past 1 TiB, …``; None for any other
    message."""
    m = _CONSTRAINT.match(text)
    if m is None:
        return None
    kind, op, bound, path = m.groups()
    value = _value_at(data, path)
    number = float(bound)
    name = BOUND_NAMES.get(int(number)) if op == "<=" and number == int(number) else None
    shown = "" if value is None else f" = {value!r}"
    if op == ">=":
        return f"{path.lstrip('.')}{shown} is below {bound}: expected {kind} >= {bound}"
    return (f"{path.lstrip('.')}{shown} is past {name or 'its bound'}: expected {kind} <= {bound}"
            " (values past fastverify's plausibility bounds are broken or hand-edited input)")
