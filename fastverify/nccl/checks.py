"""The NCCL settings that matter for small all-reduces on one node, each with its check, and the validator.

:func:`validate_setting` says what NCCL does with one ``name=value``: it replays how NCCL parses
the value (``strtoll`` with base 0, case-sensitive ``strcmp``, the two ``NCCL_ALGO``/``NCCL_PROTO``
grammars) with the setting's check from :data:`CATALOGUE`. :func:`validate_settings` checks a whole
set of settings against each other (a minimum channel count above a maximum, an alias overridden
…), and :func:`validate_env` runs both. :func:`explain` and :func:`suggest` serve the command line.
What each severity means: :class:`~fastverify.nccl.findings.Severity`.

In this order below: how NCCL reads an integer; the checks, one part per kind of setting
(``NCCL_ALGO``/``NCCL_PROTO``, the P2P level, the buffer sizes, the single-value settings); the
catalogue that names each setting's check; and the validator over it.

Facts: NVIDIA/nccl's own source at tags v2.18.3 … v2.30.7 (``git show <tag>:<path>``); each
setting names its source file.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Iterable, Mapping
from typing import NamedTuple

from fastverify.errors import UserError, shown
from fastverify.nccl.findings import (
    ALWAYS,
    CHANNELS_64,
    Check,
    Ctx,
    Finding,
    Kind,
    Scope,
    Setting,
    Severity,
    V,
    Verdict,
    merge,
    names_at,
    show,
)
from fastverify.nccl.version import LIBRARY_ENV, NcclVersion

# How NCCL reads an integer setting: C's ``strtoll(value, &end, 0)`` (glibc) and the
# ``NCCL_PARAM`` loader around it (``src/misc/param.cc`` ``ncclLoadParam``).
#
# Decimal, ``0x`` hexadecimal and leading-``0`` octal are read; text after the digits is what
# ``strtoll`` leaves unread, which NCCL ignores.

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
        return None, Verdict(
            Severity.WARNING,
            f"empty: NCCL treats it as unset (default {default})",
            "remove the variable or give a value",
        )
    c = strtoll(value)
    if not c.digits:
        return None, Verdict(
            Severity.ERROR, f"{show(value)} is not an integer: NCCL's strtoll reads it as 0", "write an integer"
        )
    if c.value is None:
        return None, Verdict(
            Severity.ERROR,
            f"{show(value)} is out of the 64-bit range: NCCL uses the default ({default})",
            "write a smaller integer",
        )
    note = None
    if c.rest.strip(C_SPACE):
        return None, Verdict(
            Severity.ERROR,
            f"NCCL reads only the leading {c.value} of {show(value)} and ignores {show(c.rest)}",
            "write plain digits (no units, decimals or exponents)",
        )
    if c.base == 8 and c.value != int(value.strip(C_SPACE), 10):
        note = Verdict(
            Severity.WARNING, f"the leading 0 makes NCCL read {show(value)} as octal = {c.value}", "drop the leading 0"
        )
    elif c.base == 16:
        note = Verdict(Severity.OK, f"hexadecimal, = {c.value}")
    return c.value, note


# ``NCCL_ALGO`` and ``NCCL_PROTO``: the two list grammars NCCL parses them with, and the check.
#
# NCCL <= 2.23 reads one comma list for every collective (case-insensitive, a leading ``^``
# excludes, unknown names silently ignored); NCCL >= 2.24 reads ``list[;function:list]*`` and fails
# communicator init on an unknown name or function (NVIDIA/nccl ``src/graph/tuning.cc``
# ``parseList``, ``ncclTopoTuneModel``; names from ``ncclAlgoStr`` / ``ncclProtoStr`` in
# ``src/init.cc``).

GRAMMAR_2_24 = V(2, 24)  # NCCL_ALGO / NCCL_PROTO: per-function grammar, unknown token fails init

FUNCS = ("Broadcast", "Reduce", "AllGather", "ReduceScatter", "AllReduce")  # ncclFuncStr, src/init.cc
# (name, first release, first release without it); ncclAlgoStr / ncclProtoStr in src/init.cc
ALGOS = (
    ("Tree", V(2, 5), None),
    ("Ring", V(2, 5), None),
    ("CollNet", V(2, 6), V(2, 14)),
    ("CollNetDirect", V(2, 14), None),
    ("CollNetChain", V(2, 14), None),
    ("NVLS", V(2, 17), None),
    ("NVLSTree", V(2, 18), None),
    ("PAT", V(2, 23), None),
)
PROTOS = (("LL", V(2, 5), None), ("LL128", V(2, 5), None), ("Simple", V(2, 5), None))
_PCIE_ALLREDUCE_ALGOS = ("Ring", "Tree")  # the only all-reduce algorithms on one node without NVSwitch


def _why_unknown(token: str, table: tuple, ctx: Ctx) -> str:
    """``token`` for a reason line, with why NCCL does not know it where there is more to say."""
    bare = token.strip(C_SPACE)
    for n, first, gone in table:
        if bare.lower() == n.lower():
            if bare != token:
                return f"{show(token)} (NCCL does not trim spaces)"
            if not ctx.at_least(first):
                return f"{show(token)} (needs NCCL >= {first})"
            if gone is not None:
                return f"{show(token)} (removed in {gone}: use CollNetDirect or CollNetChain)"
    return show(token)


class Parsed(NamedTuple):
    """What NCCL enables per collective after reading the list."""

    enable: dict[str, dict[str, int]]  # function -> name -> 0 off / 1 on / 2 auto (LL128 default)
    caret: frozenset[str]  # functions whose final list was a '^' exclusion list
    unknown: tuple[str, ...]  # tokens NCCL <= 2.23 ignored
    error: str | None  # NCCL >= 2.24: the parse failure (init fails)


def _defaults(names: tuple[str, ...]) -> dict[str, dict[str, int]]:
    return {f: {n: (2 if n == "LL128" else 1) for n in names} for f in FUNCS}


def _match(token: str, names: tuple[str, ...]) -> str | None:
    return next((n for n in names if token.lower() == n.lower()), None)  # strcasecmp


def _parse_old(value: str, names: tuple[str, ...]) -> Parsed:
    """NCCL <= 2.23: one comma list for every function, optional leading '^'; unknown tokens ignored."""
    exclude = value.startswith("^")
    body = value[1:] if exclude else value
    row = {n: int(exclude) for n in names}
    unknown = []
    for token in filter(None, body.split(",")):  # strtok skips empty tokens
        hit = _match(token, names)
        if hit is None:
            unknown.append(token)
        else:
            row[hit] = int(not exclude)
    enable = {f: dict(row) for f in FUNCS}
    return Parsed(enable, frozenset(FUNCS) if exclude else frozenset(), tuple(unknown), None)


def _parse_new(value: str, names: tuple[str, ...], table: tuple, ctx: Ctx) -> Parsed:
    """NCCL >= 2.24: ``list[;func:list]*``; only the first entry may omit ``func:``; any unknown
    function or name is a WARN and ``ncclInvalidUsage`` at communicator init."""
    enable = _defaults(names)
    caret: set[str] = set()

    def fail(msg: str) -> Parsed:
        return Parsed(enable, frozenset(caret), (), msg)

    for index, entry in enumerate(filter(None, value.split(";"))):
        parts = [p for p in entry.split(":") if p]  # strtok skips empty fields
        if not parts:
            return fail(f"entry {show(entry)} has no function and no list")
        if len(parts) == 1:
            # Only the very first entry may lack a prefix; NCCL checks it starts the string.
            if index > 0 or value.startswith(";"):
                return fail(f"entry {show(entry)} has no 'function:' prefix (only the first entry may omit it)")
            prefix, body = None, parts[0]
        else:
            prefix, body = parts[0], parts[1]
        funcs = FUNCS if prefix is None else tuple(f for f in FUNCS if f.lower() == prefix.lower())
        if not funcs:
            return fail(f"unknown function {show(prefix or '')} (functions: {', '.join(FUNCS)})")
        exclude = body.startswith("^")
        tokens = list(filter(None, (body[1:] if exclude else body).split(",")))
        for f in funcs:
            enable[f] = {n: int(exclude) for n in names}
            (caret.add if exclude else caret.discard)(f)
            for token in tokens:
                hit = _match(token, names)
                if hit is None:
                    return fail(f"unknown name {_why_unknown(token, table, ctx)}")
                enable[f][hit] = int(not exclude)
    return Parsed(enable, frozenset(caret), (), None)


def table_of(name: str) -> tuple:
    """The ``(name, first release, first release without it)`` rows of ``NCCL_ALGO`` or ``NCCL_PROTO``."""
    return ALGOS if name == "NCCL_ALGO" else PROTOS


def parse_algo_proto(name: str, value: str, ctx: Ctx) -> Parsed:
    """How the NCCL of ``ctx`` reads ``name`` (``NCCL_ALGO`` / ``NCCL_PROTO``) = ``value``: the
    2.24+ grammar or the older one, with the names that release knows."""
    table = table_of(name)
    names = names_at(table, ctx)
    return _parse_new(value, names, table, ctx) if ctx.at_least(GRAMMAR_2_24) else _parse_old(value, names)


def check_list(value: str, ctx: Ctx, s: Setting) -> Verdict:
    """``NCCL_ALGO`` / ``NCCL_PROTO``: what the list leaves AllReduce, and what NCCL does with it."""
    is_algo = s.name == "NCCL_ALGO"
    table = table_of(s.name)
    names = names_at(table, ctx)
    new = ctx.at_least(GRAMMAR_2_24)
    grammar = "the NCCL >= 2.24 grammar" if new else "the NCCL <= 2.23 grammar"
    note = ctx.assumed("the 2.24+ grammar and names")
    if value == "" and new:
        return Verdict(
            Severity.WARNING, f"empty: {ctx.nccl} parses no entry and keeps the defaults" + note, "remove the variable"
        )
    if value == "" and is_algo:
        return Verdict(
            Severity.WARNING,
            f"empty: {ctx.nccl} disables every algorithm, then falls back to Ring and Tree",
            "remove the variable",
        )
    parsed = parse_algo_proto(s.name, value, ctx)
    if parsed.error:
        return Verdict(
            Severity.ERROR,
            f"{parsed.error}: {ctx.nccl} fails communicator init (ncclInvalidUsage), per {grammar}" + note,
            f"valid names: {', '.join(names)}; e.g. {s.name}=allreduce:" + ("ring,tree" if is_algo else "ll,simple"),
        )
    verdicts: list[Verdict] = []
    known_tokens = [t for t in filter(None, value.lstrip("^").split(",")) if _match(t, names)]
    if parsed.unknown:
        shown = ", ".join(_why_unknown(t, table, ctx) for t in parsed.unknown)
        fix = (
            f"the 'function:list' form needs NCCL >= 2.24; on {ctx.version} write a plain list"
            if any(c in value for c in ":;")
            else f"valid names in {ctx.nccl}: {', '.join(names)}"
        )
        if known_tokens or value.startswith("^"):
            verdicts.append(Verdict(Severity.WARNING, f"{ctx.nccl} silently ignores {shown}", fix))
        else:
            what = (
                "disables every algorithm, then falls back to Ring and Tree because CollNet is "
                "unavailable on one node: the value has no effect"
                if is_algo
                else "disables every protocol: the first collective fails ('no algorithm/protocol available')"
            )
            return Verdict(Severity.ERROR, f"no name {ctx.nccl} knows in {show(value)} ({shown}): it {what}", fix)
    enable = parsed.enable
    if is_algo and not new:
        # NCCL <= 2.23 with CollNet unavailable (always on one node): nothing of Ring, Tree, NVLS,
        # NVLSTree left -> Ring and Tree are switched back on (src/graph/tuning.cc).
        for f in FUNCS:
            if not any(enable[f].get(n) for n in ("Ring", "Tree", "NVLS", "NVLSTree")):
                enable[f]["Ring"] = enable[f]["Tree"] = 1
    allreduce = enable["AllReduce"]
    on = [n for n in names if allreduce[n]]
    if is_algo:
        if not any(allreduce[n] for n in _PCIE_ALLREDUCE_ALGOS):
            verdicts.append(
                Verdict(
                    Severity.WARNING,
                    f"leaves AllReduce only {', '.join(on) or 'nothing'}: on one "
                    "node without NVSwitch NCCL then has no algorithm and the first all-reduce "
                    "fails" + note,
                    f"keep Ring or Tree for AllReduce, e.g. {s.name}=allreduce:ring,tree"
                    if new
                    else f"keep Ring or Tree, e.g. {s.name}=Ring,Tree",
                )
            )
    else:
        empty = [f for f in FUNCS if not any(enable[f].values())]
        if empty:
            sev = Severity.ERROR if "AllReduce" in empty else Severity.WARNING
            verdicts.append(
                Verdict(
                    sev,
                    f"leaves no protocol for {', '.join(empty)}: the first such collective "
                    "fails ('no algorithm/protocol available')" + note,
                    "keep at least Simple",
                )
            )
        if allreduce["LL128"] == 1:
            how = (
                "the '^' exclusion list also forces LL128 on"
                if "AllReduce" in parsed.caret
                else "listing LL128 forces it on"
            )
            verdicts.append(
                Verdict(
                    Severity.WARNING,
                    f"{how} for AllReduce and skips NCCL's LL128 checks; NCCL leaves "
                    "LL128 off on PCIe-only nodes because it can corrupt data there (docs: NCCL_PROTO)",
                    "on PCIe write the protocols to keep without LL128, e.g. LL,Simple",
                )
            )
    if not verdicts or all(v.severity == Severity.OK for v in verdicts):
        shown_on = ", ".join(n + (" (auto)" if allreduce[n] == 2 else "") for n in on)
        return Verdict(Severity.OK, f"AllReduce may use {shown_on}, per {grammar}" + note)
    return merge(*verdicts)


# ``NCCL_P2P_LEVEL`` and ``NCCL_P2P_DISABLE``: how far NCCL uses the P2P transport.
#
# NCCL compares level names case-sensitively (``strcmp``) and maps the legacy integers 0..5 to
# LOC, PIX, PXB, PHB, SYS, SYS (``levelsOldToNew``); a value it does not understand is ignored and
# the default PXB applies. Only ``NCCL_P2P_DISABLE=1`` disables P2P (NVIDIA/nccl
# ``src/graph/paths.cc`` ``ncclGetLevel``, level names in ``src/graph/topo.cc``).

# Level names NCCL accepts (topoPathTypeStr up to PATH_SYS), with the release that added them.
_LEVELS = (
    ("LOC", V(2, 3, 4), None),
    ("NVL", V(2, 3, 4), None),
    ("NVB", V(2, 3, 4), None),
    ("C2C", V(2, 26), None),
    ("PIX", V(2, 3, 4), None),
    ("PXB", V(2, 3, 4), None),
    ("P2C", V(2, 27), None),
    ("PXN", V(2, 12), None),
    ("PHB", V(2, 3, 4), None),
    ("SYS", V(2, 3, 4), None),
)
_LEVEL_MEANING = {
    "LOC": "never use P2P",
    "NVL": "P2P over NVLink only",
    "NVB": "P2P over NVLink, also through a GPU",
    "C2C": "P2P up to a C2C link",
    "PIX": "P2P under one PCIe switch",
    "PXB": "P2P across PCIe switches (NCCL's default)",
    "P2C": "P2P up to PCIe + C2C",
    "PXN": "P2P up to PXN paths",
    "PHB": "P2P through the CPU's host bridge (same NUMA node)",
    "SYS": "P2P across CPU sockets too",
}
_LEGACY_LEVELS = ("LOC", "PIX", "PXB", "PHB", "SYS", "SYS")  # levelsOldToNew, 2.3.4 .. 2.30.7


def check_p2p_level(value: str, ctx: Ctx, s: Setting) -> Verdict:
    """``NCCL_P2P_LEVEL``: a level name of this NCCL, a legacy integer, or a value NCCL ignores."""
    names = names_at(_LEVELS, ctx)
    if value in names:
        return Verdict(Severity.OK, f"{value}: {_LEVEL_MEANING[value]}")
    if value[:1].isascii() and value[:1].isdigit():
        c = strtoll(value)
        if c.value is None or c.value > INT32_MAX:
            return Verdict(
                Severity.ERROR, f"legacy level {show(value)} overflows NCCL's int", "use a level name, e.g. SYS"
            )
        old = c.value
        level = _LEGACY_LEVELS[min(old, len(_LEGACY_LEVELS) - 1)]
        if old > len(_LEGACY_LEVELS) - 1:
            return Verdict(
                Severity.ERROR, f"legacy level {old} is above 5: NCCL clamps it to 5 = {level}", f"use {level}"
            )
        if c.rest:
            return Verdict(
                Severity.WARNING,
                f"NCCL reads the legacy level {old} = {level} and ignores {show(c.rest)}",
                f"use {level}",
            )
        if c.base == 8 and old != int(value, 10):
            return Verdict(
                Severity.WARNING, f"the leading 0 makes {show(value)} octal = {old} = {level}", f"use {level}"
            )
        return Verdict(
            Severity.OK,
            f"legacy integer {old} means {level} (NCCL maps 0..5 to LOC, PIX, PXB, PHB, "
            "SYS, SYS; NCCL docs discourage integers)",
            f"use {level}",
        )
    bare = value.strip(C_SPACE).upper()
    if bare in names:
        how = "case-sensitively (strcmp)" if value.strip(C_SPACE) != bare else "exactly (spaces included)"
        return Verdict(
            Severity.ERROR,
            f"NCCL compares level names {how}: {show(value)} is silently ignored and the default PXB applies",
            f"use {bare}",
        )
    for name, first, _ in _LEVELS:
        if bare == name:
            return Verdict(
                Severity.ERROR,
                f"{name} is a level name only since NCCL {first}: {ctx.nccl} ignores it",
                f"use one of {', '.join(names)}",
            )
    if value == "":
        return Verdict(
            Severity.WARNING, "empty: ignored, the default PXB applies", "remove the variable or use a level name"
        )
    guess = difflib.get_close_matches(bare, names, n=1, cutoff=0.5)
    return Verdict(
        Severity.ERROR,
        f"{show(value)} is not a P2P level: NCCL ignores it and the default PXB applies"
        + ctx.assumed(str(ctx.version)),
        f"did you mean {guess[0]}?" if guess else f"use one of {', '.join(names)}",
    )


def check_p2p_disable(value: str, ctx: Ctx, s: Setting) -> Verdict:
    """``NCCL_P2P_DISABLE``: only 1 disables P2P."""
    if value == "":
        return Verdict(Severity.WARNING, "empty: NCCL reads it as 0, P2P stays enabled", "remove the variable")
    c = strtoll(value)  # strtol(str, NULL, 0); only == 1 disables (src/graph/paths.cc)
    if c.value == 1:
        if value.strip(C_SPACE) == "1":
            return Verdict(Severity.OK, "P2P disabled between all GPUs (level LOC); NCCL_P2P_LEVEL is then ignored")
        return Verdict(Severity.WARNING, f"NCCL reads {show(value)} as 1: P2P disabled", "write 1")
    if c.value == 0 and c.digits and not c.rest.strip(C_SPACE):
        return Verdict(Severity.OK, "0: P2P stays enabled (same as unset)")
    return Verdict(
        Severity.ERROR,
        f"only 1 disables P2P; NCCL reads {show(value)} as {c.value if c.digits else 0} and ignores it",
        "write 1 to disable P2P, or remove the variable",
    )


# ``NCCL_BUFFSIZE``, ``NCCL_LL_BUFFSIZE``, ``NCCL_LL128_BUFFSIZE``: per-peer FIFO sizes in bytes.
#
# A buffer too small for its protocol's chunk (``NCCL_BUFFSIZE`` < 4096, ``NCCL_LL_BUFFSIZE`` < 256,
# ``NCCL_LL128_BUFFSIZE`` < 16384 since NCCL 2.22) is an error: NCCL takes it unchecked and
# divides by a 0-byte chunk (:func:`buffsize_minimum`; the comment above ``_BUFF_CHUNK`` says how).

# The smallest buffer each protocol can run a collective with. NCCL takes the value unchecked
# (src/init.cc computeBuffSizes: anything but -2 is the size). calcCollChunking (src/enqueue.cc)
# makes a chunk of one step, buffSize / NCCL_STEPS (8), for every protocol but Ring/Simple (whose
# chunk is 4 steps): LL halves it (a 16-B line carries 8 B), LL128 keeps 15 of 16 words of each
# 128-B line; since 2.22 the chunk is then rounded down to the protocol's grain
# (ncclProtoGrainSize, src/include/device.h: LL 16 B, LL128 32 x 8 / 16 x 15 x 8 = 1920 B, Simple
# 512 B) and divided into the bytes (DIVUP(nBytes, nChannels x nchunksPerLoop x chunkSize)). A
# buffer that leaves a chunk of 0 B is an integer division by zero on the host: the process dies
# with SIGFPE at the first collective that picks the protocol (Tree/Simple for NCCL_BUFFSIZE).
_NCCL_STEPS = 8  # src/include/device.h
GRAIN_2_22 = V(2, 22)  # chunk rounded down to ncclProtoGrainSize (v2.22.3-1 src/enqueue.cc; not in v2.21.5-1)
# setting -> (protocol, grain B, what a chunk is, chunk bytes of a buffer of n bytes)
_BUFF_CHUNK: dict[str, tuple[str, int, str, Callable[[int], int]]] = {
    "NCCL_BUFFSIZE": (
        "one-step Simple (Tree/Simple, a Ring broadcast)",
        512,
        "a one-step Simple chunk is BUFFSIZE/8",
        lambda n: n // _NCCL_STEPS,
    ),
    "NCCL_LL_BUFFSIZE": (
        "LL",
        16,
        "an LL chunk is half a step (8 data bytes per 16-B line), LL_BUFFSIZE/8/2",
        lambda n: n // _NCCL_STEPS // 2,
    ),
    "NCCL_LL128_BUFFSIZE": (
        "LL128",
        1920,
        "an LL128 chunk is 15/16 of a step (15 data words per 128-B line), LL128_BUFFSIZE/8/16*15",
        lambda n: n // _NCCL_STEPS // 16 * 15,
    ),
}


def buffsize_minimum(name: str, version: NcclVersion | None = None) -> int:
    """The smallest ``name`` (``NCCL_BUFFSIZE``, ``NCCL_LL_BUFFSIZE``, ``NCCL_LL128_BUFFSIZE``) whose
    chunk is not 0 B for NCCL ``version`` (``None``: the newest): 4096 / 256 / 16384 bytes since 2.22
    (the chunk must hold one grain), 8 / 16 / 128 bytes before."""
    _, grain, _, chunk = _BUFF_CHUNK[name]
    least = grain if version is None or version >= GRAIN_2_22 else 1
    n = 1
    while chunk(n) < least:
        n *= 2
    while n > 1 and chunk(n - 1) >= least:  # the smallest, not only the smallest power of 2
        n -= 1
    return n


def _buffsize_floor(n: int, ctx: Ctx, s: Setting) -> Verdict | None:
    """An error when ``n`` bytes leave the protocol a chunk of 0 B (see the comment above)."""
    proto, grain, how, chunk = _BUFF_CHUNK[s.name]
    new = ctx.at_least(GRAIN_2_22)
    least = buffsize_minimum(s.name, ctx.version if new else V(2, 21))
    if n >= least:
        if not new and n < buffsize_minimum(s.name):
            return Verdict(
                Severity.WARNING,
                f"{n} bytes: {how} = {chunk(n)} B, under the {grain}-B grain that NCCL >= "
                f"2.22 rounds it down to (0 B: a division by zero there); older releases run it untested",
                f"use at least {buffsize_minimum(s.name)} bytes; NCCL's default is {s.default}",
            )
        return None
    rounded = f", below the {grain}-B grain NCCL rounds it down to, so 0 B" if new and chunk(n) else ""
    size = "1 byte" if n == 1 else f"{n} bytes"
    return Verdict(
        Severity.ERROR,
        f"{size}: {how} = {chunk(n)} B{rounded}; NCCL takes the value unchecked "
        f"(src/init.cc computeBuffSizes) and divides by that chunk (src/enqueue.cc calcCollChunking): "
        f"the first {proto} collective kills the process (SIGFPE)" + ctx.assumed("NCCL >= 2.22"),
        f"use at least {least} bytes, a power of 2; NCCL's default is {s.default}",
    )


def check_buffsize(value: str, ctx: Ctx, s: Setting) -> Verdict:
    """A buffer size: positive, fits an int, leaves every chunk > 0 B, a power of 2."""
    n, note = param_int(value, s.default)  # src/init.cc computeBuffSizes: used as is unless -2
    if n is None:
        return note  # type: ignore[return-value]
    if n == -2:
        return merge(note, Verdict(Severity.OK, "-2 is NCCL's 'unset' marker: the default applies"))
    if n <= 0:
        return merge(
            note,
            Verdict(
                Severity.ERROR,
                f"{n} bytes: NCCL uses it as the buffer size unchecked",
                f"use a positive power of 2 (default {s.default})",
            ),
        )
    if n > INT32_MAX:
        return merge(note, Verdict(Severity.ERROR, f"{n} does not fit NCCL's int buffer size", "use at most 1 GiB"))
    floor = _buffsize_floor(n, ctx, s)
    if floor is not None and floor.severity is Severity.ERROR:
        return merge(note, floor)
    if floor is not None:
        note = merge(note, floor)
    if n & (n - 1) and s.name == "NCCL_BUFFSIZE":  # the LL/LL128 defaults are not powers of 2 themselves
        return merge(
            note,
            Verdict(Severity.WARNING, f"{n} bytes is not a power of 2 (NCCL docs recommend one)", "use a power of 2"),
        )
    return merge(note, Verdict(Severity.OK, f"{n} bytes"))


# Checks of the single-value NCCL settings: flags, thread and channel counts, the CTA policy,
# case-insensitive choices, ``NCCL_DEBUG_SUBSYS``, ``NCCL_THREAD_THRESHOLDS``, paths and plugins.
#
# Each check replays how NCCL reads the value (the source named at each one, NVIDIA/nccl ``src/``)
# and returns a :class:`~fastverify.nccl.findings.Verdict`.


def flag(only_one: bool, extra: dict[int, str] | None = None) -> Check:
    """0/1 flag. ``only_one``: NCCL tests ``== 1`` (other values are 0); else any non-zero is 1."""
    meanings = {0: "off", 1: "on", **(extra or {})}

    def check(value: str, ctx: Ctx, s: Setting) -> Verdict:
        n, note = param_int(value, s.default)
        if n is None:
            return note  # type: ignore[return-value]
        if n in meanings:
            return merge(note, Verdict(Severity.OK, f"{n}: {meanings[n]}"))
        allowed = "/".join(str(k) for k in meanings)
        if only_one:
            return merge(
                note, Verdict(Severity.ERROR, f"NCCL tests {s.name} == 1: {n} is the same as 0", f"use {allowed}")
            )
        return merge(note, Verdict(Severity.WARNING, f"not one of {allowed}: NCCL treats {n} as 1", f"use {allowed}"))

    return check


def check_nthreads(lo: int, hi: int) -> Check:
    # getNthreads in src/graph/tuning.cc: <= 0 -> default; % 32 -> WARN and max; clamp to [lo, hi]
    def check(value: str, ctx: Ctx, s: Setting) -> Verdict:
        n, note = param_int(value, s.default)
        if n is None:
            return note  # type: ignore[return-value]
        if n <= 0:
            return merge(
                note,
                Verdict(
                    Severity.ERROR,
                    f"{n} <= 0 means unset: NCCL uses its default ({s.default})",
                    "remove the variable or use 64, 128, 256 or 512",
                ),
            )
        if n % 32:
            return merge(
                note,
                Verdict(
                    Severity.ERROR,
                    f"{n} is not a multiple of 32 (warp size): NCCL warns and uses {hi}",
                    f"use a multiple of 32 in [{lo}, {hi}]",
                ),
            )
        if not lo <= n <= hi:
            edge = lo if n < lo else hi
            return merge(
                note,
                Verdict(
                    Severity.ERROR,
                    f"{n} is outside [{lo}, {hi}]: NCCL warns and uses {edge}",
                    f"use a multiple of 32 in [{lo}, {hi}]",
                ),
            )
        return merge(note, Verdict(Severity.OK, f"{n} threads per block"))

    return check


def check_channels(minimum: bool, ctas: bool) -> Check:
    # NCHANNELS/NRINGS: ncclMinNchannels/ncclMaxNchannels in src/graph/connect.cc (min -> [0, MAX],
    # max -> [1, MAX]); CTAS: src/init.cc (<= 0 ignored, > MAXCHANNELS capped).
    def check(value: str, ctx: Ctx, s: Setting) -> Verdict:
        top = 64 if ctx.at_least(CHANNELS_64) else 32
        n, note = param_int(value, s.default)
        if n is None:
            return note  # type: ignore[return-value]
        replacement = "NCCL_MIN_CTAS" if minimum else "NCCL_MAX_CTAS"
        deprecated = (
            not ctas and ctx.at_least(V(2, 17)) and Verdict(Severity.OK, f"deprecated since 2.17 for {replacement}")
        )
        if not ctas and n == -2:
            return merge(note, Verdict(Severity.OK, "-2 is NCCL's 'unset' marker: the default applies"))
        lo = 1 if (ctas or not minimum) else 0
        if n < lo:
            what = "ignores it" if ctas else f"uses {lo}"
            return merge(
                note, Verdict(Severity.ERROR, f"{n} is below {lo}: NCCL {what}", f"use a value in [{lo}, {top}]")
            )
        if n > top:
            return merge(
                note,
                Verdict(
                    Severity.ERROR,
                    f"{n} is above {ctx.nccl}'s {top} channels: NCCL caps it "
                    f"to {top}" + ctx.assumed(f"{ctx.version}, 64 channels since 2.25"),
                    f"use a value in [{lo}, {top}]",
                ),
            )
        return merge(note, deprecated or None, Verdict(Severity.OK, f"{n} channels"))

    return check


def check_cta_policy(value: str, ctx: Ctx, s: Setting) -> Verdict:
    """``NCCL_CTA_POLICY``: an integer before 2.29, names combined with ``|`` since."""
    if not ctx.at_least(V(2, 29)):
        # 2.27 / 2.28: NCCL_PARAM integer, DEFAULT=0, EFFICIENCY=1 (+ ZERO=2 in 2.28); others reset to 0
        top = 2 if ctx.at_least(V(2, 28)) else 1
        n, note = param_int(value, s.default)
        if n is None:
            needs = Verdict(Severity.ERROR, "policy names need NCCL >= 2.29")
            return merge(note, needs if value[:1].isalpha() else None)
        if 0 <= n <= top:
            return merge(note, Verdict(Severity.OK, f"policy {n}"))
        return merge(
            note, Verdict(Severity.ERROR, f"{n} is not a policy in {ctx.nccl} (0..{top}): reset to 0", f"use 0..{top}")
        )
    if value.strip(C_SPACE) == "":
        return Verdict(Severity.WARNING, "empty: NCCL finds no policy and keeps DEFAULT", "remove the variable")
    if value[:1].isascii() and value[:1].isdigit():  # legacy: only the first character counts
        if value[0] in "012" and len(value) == 1:
            return Verdict(Severity.OK, f"legacy {value} = {('DEFAULT', 'EFFICIENCY', 'ZERO')[int(value[0])]}")
        if value[0] in "012":
            return Verdict(
                Severity.ERROR,
                f"NCCL reads only the first character of {show(value)}",
                "use DEFAULT, EFFICIENCY or ZERO",
            )
        return Verdict(
            Severity.ERROR,
            f"legacy policy {show(value)} is not 0, 1 or 2: NCCL uses DEFAULT",
            "use DEFAULT, EFFICIENCY or ZERO",
        )
    tokens = list(filter(None, value.split("|")))
    bad = [t for t in tokens if t.upper() not in ("DEFAULT", "EFFICIENCY", "ZERO")]
    if tokens and not bad:
        return Verdict(Severity.OK, "policy " + "|".join(t.upper() for t in tokens) + " (no effect on PCIe all-reduce)")
    sev = Severity.WARNING if len(bad) < len(tokens) else Severity.ERROR
    return Verdict(
        sev,
        f"NCCL ignores unknown policy {', '.join(map(show, bad)) or 'names'}" + ("" if tokens else " (none given)"),
        "use DEFAULT, EFFICIENCY or ZERO, combined with |",
    )


def check_choice(choices: dict[str, str], otherwise: str) -> Check:
    """A case-insensitive name (strcasecmp); anything else means ``otherwise``."""

    def check(value: str, ctx: Ctx, s: Setting) -> Verdict:
        if value == "":
            return Verdict(Severity.WARNING, f"empty: {otherwise}", "remove the variable or give a value")
        if value.upper() in choices:
            return Verdict(Severity.OK, choices[value.upper()])
        return Verdict(
            Severity.ERROR,
            f"{show(value)} is not one of {', '.join(choices)}: {otherwise}",
            f"use one of {', '.join(choices)}",
        )

    return check


SUBSYS = (
    "INIT",
    "COLL",
    "P2P",
    "SHM",
    "NET",
    "GRAPH",
    "TUNING",
    "ENV",
    "ALLOC",
    "ALLOC_HOST",
    "CALL",
    "PROXY",
    "NVLS",
    "BOOTSTRAP",
    "REG",
    "PROFILE",
    "RAS",
    "DESTROY",
    "ALL",
)  # src/debug.cc


def check_debug_subsys(value: str, ctx: Ctx, s: Setting) -> Verdict:
    """``NCCL_DEBUG_SUBSYS``: known subsystems, and whether the INIT lines topo reads survive."""
    exclude = value.startswith("^")
    tokens = list(filter(None, (value[1:] if exclude else value).split(",")))
    bad = [t for t in tokens if t.upper() not in SUBSYS]
    good = [t.upper() for t in tokens if t.upper() in SUBSYS]
    if not tokens and not exclude:
        return Verdict(
            Severity.ERROR, "empty list: NCCL logs no INFO line at all", "remove the variable or list INIT,ENV"
        )
    if bad and not good and not exclude:
        return Verdict(
            Severity.ERROR,
            f"no known subsystem in {show(value)}: NCCL logs no INFO line at all",
            f"use names among {', '.join(SUBSYS)}",
        )
    verdicts = [
        Verdict(Severity.WARNING, f"NCCL ignores {', '.join(map(show, bad))}", f"known: {', '.join(SUBSYS)}")
        if bad
        else None
    ]
    if not exclude and not {"INIT", "ALL"} & set(good):
        verdicts.append(
            Verdict(
                Severity.WARNING,
                "replaces the default INIT,BOOTSTRAP,ENV: the INIT lines "
                "(transports, rings, channels) that fastverify topo reads are lost",
                "add INIT, e.g. INIT,ENV,GRAPH,TUNING",
            )
        )
    logged = f"logs {'all but ' if exclude else ''}{','.join(good) or 'everything'}"
    return merge(*verdicts, Verdict(Severity.OK, logged))


def check_thread_thresholds(value: str, ctx: Ctx, s: Setting) -> Verdict:
    """``NCCL_THREAD_THRESHOLDS``: up to 6 integers read as ``sscanf`` reads them."""
    # sscanf(str, "%ld %ld %ld %ld %ld %ld"): Tree LL/LL128/Simple, Ring LL/LL128/Simple; < 0 keeps default
    numbers, pos = [], 0
    for m in re.finditer(r"[ \t\n\v\f\r]*([+-]?)([0-9]+)", value):
        if m.start() != pos or len(numbers) == 6:
            break
        digits = m[2].lstrip("0") or "0"
        n = int(digits) if len(digits) <= 19 else INT64_MAX  # %ld saturates
        numbers.append(-n if m[1] == "-" else n)
        pos = m.end()
    if not numbers:
        return Verdict(
            Severity.ERROR,
            f"no number in {show(value)}: NCCL keeps its thresholds",
            "write up to 6 integers separated by spaces",
        )
    rest = value[pos:].strip(C_SPACE)
    if rest:
        return Verdict(
            Severity.WARNING,
            f"NCCL reads {numbers} and stops at {show(rest)}",
            "separate the numbers with spaces only (Tree LL LL128 Simple, Ring LL LL128 Simple)",
        )
    return Verdict(Severity.OK, f"thresholds {numbers} (Tree LL, LL128, Simple, Ring LL, LL128, Simple; < 0 keeps one)")


def check_text(what: str) -> Check:
    """A path or plugin name: only an empty one is flagged."""

    def check(value: str, ctx: Ctx, s: Setting) -> Verdict:
        if value.strip(C_SPACE) == "":
            return Verdict(Severity.WARNING, f"empty {what}", "remove the variable or give a value")
        return Verdict(Severity.OK, f"{what} {show(value)}")

    return check


def check_tuner_plugin(value: str, ctx: Ctx, s: Setting) -> Verdict:
    """``NCCL_TUNER_PLUGIN``: ``none`` or a plugin name."""
    if value.lower() == "none":
        return Verdict(Severity.OK, "none: no tuner plugin, NCCL's own model decides")
    return check_text("plugin (tries the name, then libnccl-tuner-<name>.so)")(value, ctx, s)


# The catalogue: each NCCL setting fastverify checks, as a :class:`~fastverify.nccl.findings.Setting`
# with its check, and the other ``NCCL_*`` names NCCL (or other software) reads.
#
# Each entry says what values NCCL accepts (per NCCL version where that changed), the default,
# whether NCCL reads it once per process or at each communicator init, and the NCCL source file
# that reads it. Facts: NVIDIA/nccl's own source at tags v2.18.3 … v2.30.7.


def _check_no_cache(value: str, ctx: Ctx, s: Setting) -> Verdict:
    """``NCCL_NO_CACHE``: full names of settings NCCL keeps in an ``NCCL_PARAM`` cache, or ALL."""
    tokens = list(filter(None, value.split(",")))
    if not tokens:
        return Verdict(Severity.WARNING, "empty: nothing is re-read", "remove the variable")
    unknown = [t for t in tokens if t != "ALL" and t not in CATALOGUE_BY_NAME and t not in OTHER_NAMES]
    not_param = [
        t for t in tokens if t in CATALOGUE_BY_NAME and not CATALOGUE_BY_NAME[t].source.startswith("NCCL_PARAM")
    ]
    verdicts = []
    if unknown:
        verdicts.append(
            Verdict(
                Severity.WARNING,
                f"not NCCL variable names (exact, with NCCL_): {', '.join(map(show, unknown))}",
                "list full names such as NCCL_NTHREADS, or ALL",
            )
        )
    if not_param:
        verdicts.append(
            Verdict(
                Severity.WARNING,
                f"no effect on {', '.join(not_param)}: not kept in an NCCL_PARAM cache",
                "remove it from the list; changing it needs a fresh process",
            )
        )
    effective = [t for t in tokens if t not in unknown and t not in not_param]
    return merge(*verdicts, Verdict(Severity.OK, "re-read at each use: " + ", ".join(effective)) if effective else None)


P, C = Scope.PROCESS, Scope.COMMUNICATOR
_LIST_CHANGES = (
    "<= 2.23: comma list, case-insensitive, leading ^ excludes; unknown names silently ignored",
    ">= 2.24: list[;function:list]*, function in Broadcast/Reduce/AllGather/ReduceScatter/AllReduce; "
    "an unknown name or function fails communicator init",
)

_ENTRIES: tuple[tuple[Setting, Check], ...] = (
    (
        Setting(
            "NCCL_ALGO",
            Kind.LIST,
            "Ring, Tree, CollNetDirect, CollNetChain (2.14+), NVLS (2.17+), NVLSTree (2.18+), "
            "PAT (2.23+); CollNet 2.6-2.13",
            "all (only Ring and Tree can run an all-reduce on one PCIe node)",
            C,
            V(2, 5),
            "algorithms NCCL's cost model may pick",
            "src/graph/tuning.cc (ncclTopoTuneModel, parseList)",
            _LIST_CHANGES,
        ),
        check_list,
    ),
    (
        Setting(
            "NCCL_PROTO",
            Kind.LIST,
            "LL, LL128, Simple",
            "LL and Simple; LL128 only where NCCL deems it safe (NVLink, never PCIe-only)",
            C,
            V(2, 5),
            "protocols NCCL's cost model may pick; forcing LL128 skips its safety checks",
            "src/graph/tuning.cc (ncclTopoTuneModel, parseList)",
            _LIST_CHANGES,
        ),
        check_list,
    ),
    (
        Setting(
            "NCCL_MIN_NCHANNELS",
            Kind.INT,
            "0..64 (0..32 before 2.25)",
            "-2 (unset: platform dependent)",
            P,
            V(2, 5),
            "lower bound on channels (CUDA blocks) per communicator",
            "NCCL_PARAM MinNchannels, src/graph/connect.cc",
            ("2.17: deprecated for NCCL_MIN_CTAS", "2.25: limit 32 -> 64"),
        ),
        check_channels(True, False),
    ),
    (
        Setting(
            "NCCL_MAX_NCHANNELS",
            Kind.INT,
            "1..64 (1..32 before 2.25)",
            "-2 (unset: up to 64)",
            P,
            V(2, 5),
            "upper bound on channels (CUDA blocks) per communicator",
            "NCCL_PARAM MaxNchannels, src/graph/connect.cc",
            ("2.17: deprecated for NCCL_MAX_CTAS", "2.25: limit 32 -> 64"),
        ),
        check_channels(False, False),
    ),
    (
        Setting(
            "NCCL_MIN_NRINGS",
            Kind.INT,
            "as NCCL_MIN_NCHANNELS",
            "-2 (unset)",
            P,
            V(2, 2),
            "old name of NCCL_MIN_NCHANNELS, ignored when that is set",
            "NCCL_PARAM MinNrings, src/graph/connect.cc",
            alias_of="NCCL_MIN_NCHANNELS",
        ),
        check_channels(True, False),
    ),
    (
        Setting(
            "NCCL_MAX_NRINGS",
            Kind.INT,
            "as NCCL_MAX_NCHANNELS",
            "-2 (unset)",
            P,
            V(2, 0, 5),
            "old name of NCCL_MAX_NCHANNELS, ignored when that is set",
            "NCCL_PARAM MaxNrings, src/graph/connect.cc",
            alias_of="NCCL_MAX_NCHANNELS",
        ),
        check_channels(False, False),
    ),
    (
        Setting(
            "NCCL_MIN_CTAS",
            Kind.INT,
            "1..64 (1..32 before 2.25)",
            "unset (ncclConfig_t.minCTAs or automatic)",
            P,
            V(2, 17),
            "lower bound on CTAs (channels); overrides ncclConfig_t.minCTAs",
            "NCCL_PARAM MinCTAs, src/init.cc (envConfigOverride)",
        ),
        check_channels(True, True),
    ),
    (
        Setting(
            "NCCL_MAX_CTAS",
            Kind.INT,
            "1..64 (1..32 before 2.25)",
            "unset (ncclConfig_t.maxCTAs or 64)",
            P,
            V(2, 17),
            "upper bound on CTAs (channels); overrides ncclConfig_t.maxCTAs",
            "NCCL_PARAM MaxCTAs, src/init.cc (envConfigOverride)",
        ),
        check_channels(False, True),
    ),
    (
        Setting(
            "NCCL_NTHREADS",
            Kind.INT,
            "multiple of 32 in [64, 512] (docs: 64, 128, 256, 512)",
            "512; Ring/Simple 256 when ring bandwidth x channels <= 12 GB/s",
            P,
            ALWAYS,
            "threads per CUDA block for LL and Simple",
            "NCCL_PARAM Nthreads, src/graph/tuning.cc (getNthreads)",
        ),
        check_nthreads(64, 512),
    ),
    (
        Setting(
            "NCCL_LL128_NTHREADS",
            Kind.INT,
            "multiple of 32 in [160, 640]",
            "640",
            P,
            V(2, 5),
            "threads per CUDA block for LL128",
            "NCCL_PARAM Ll128Nthreads, src/graph/tuning.cc (getNthreads)",
        ),
        check_nthreads(160, 640),
    ),
    (
        Setting(
            "NCCL_BUFFSIZE",
            Kind.INT,
            "bytes >= 4096 (less crashes NCCL >= 2.22), power of 2 recommended",
            "4194304 (4 MiB)",
            P,
            ALWAYS,
            "per-peer FIFO size of the Simple protocol",
            "NCCL_PARAM BuffSize, src/init.cc (computeBuffSizes)",
        ),
        check_buffsize,
    ),
    (
        Setting(
            "NCCL_LL_BUFFSIZE",
            Kind.INT,
            "bytes >= 256 (less crashes NCCL >= 2.22)",
            "524288 (8 lines x 512 threads x 8 steps x 16 B)",
            P,
            V(2, 7),
            "per-peer FIFO size of the LL protocol",
            "NCCL_PARAM LlBuffSize, src/init.cc (computeBuffSizes)",
        ),
        check_buffsize,
    ),
    (
        Setting(
            "NCCL_LL128_BUFFSIZE",
            Kind.INT,
            "bytes >= 16384 (less crashes NCCL >= 2.22)",
            "4915200 (120 x 640 threads x 8 steps x 8 B)",
            P,
            V(2, 7),
            "per-peer FIFO size of the LL128 protocol",
            "NCCL_PARAM Ll128BuffSize, src/init.cc (computeBuffSizes)",
        ),
        check_buffsize,
    ),
    (
        Setting(
            "NCCL_P2P_LEVEL",
            Kind.CHOICE,
            "LOC, NVL, NVB, C2C (2.26+), PIX, PXB, P2C (2.27+), PXN (2.12+), PHB, SYS "
            "(exact case); legacy 0..5 = LOC, PIX, PXB, PHB, SYS, SYS",
            "PXB (SYS on AMD x86 with <= 2 GPUs)",
            P,
            V(2, 3, 4),
            "farthest GPU-to-GPU path on which NCCL uses the P2P transport (else SHM through the host)",
            "src/graph/paths.cc (ncclGetLevel, static ncclTopoUserP2pLevel)",
            ("2.26: C2C added", "2.27: P2C added"),
        ),
        check_p2p_level,
    ),
    (
        Setting(
            "NCCL_P2P_DISABLE",
            Kind.FLAG,
            "1 disables; anything else is ignored",
            "unset (P2P enabled)",
            P,
            ALWAYS,
            "disable the P2P transport (level LOC, overrides NCCL_P2P_LEVEL)",
            "src/graph/paths.cc (ncclGetLevel)",
        ),
        check_p2p_disable,
    ),
    (
        Setting(
            "NCCL_SHM_DISABLE",
            Kind.FLAG,
            "0, 1 (only 1 has an effect)",
            "0",
            P,
            ALWAYS,
            "disable the SHM transport; without P2P and SHM GPUs talk through NET (sockets)",
            "NCCL_PARAM ShmDisable, src/transport/shm.cc",
        ),
        flag(True),
    ),
    (
        Setting(
            "NCCL_P2P_USE_CUDA_MEMCPY",
            Kind.FLAG,
            "0, 1",
            "0",
            P,
            V(2, 13),
            "P2P copies by the copy engine through the proxy thread (log suffix /CE); for bandwidth, not latency",
            "NCCL_PARAM P2pUseCudaMemcpy, src/transport/p2p.cc",
        ),
        flag(False),
    ),
    (
        Setting(
            "NCCL_CUMEM_ENABLE",
            Kind.FLAG,
            "0, 1 (-2 = auto)",
            "auto since 2.19 (on if the driver supports cuMem); 0 in 2.18",
            P,
            V(2, 18),
            "cuMem/VMM allocations and fd-based IPC (P2P/CUMEM) instead of legacy CUDA IPC (P2P/IPC)",
            "NCCL_PARAM CuMemEnable, src/misc/cudawrap.cc",
            ("2.19: default 0 -> auto",),
        ),
        flag(False, {-2: "auto (on if supported)"}),
    ),
    (
        Setting(
            "NCCL_NVLS_ENABLE",
            Kind.FLAG,
            "0, 1, 2",
            "2",
            P,
            V(2, 17),
            "NVLink SHARP; needs NVSwitch and sm90+, no effect on PCIe",
            "NCCL_PARAM NvlsEnable, src/transport/nvls.cc",
        ),
        flag(False, {0: "off", 1: "on (no effect without NVSwitch)", 2: "auto (no effect without NVSwitch)"}),
    ),
    (
        Setting(
            "NCCL_GRAPH_REGISTER",
            Kind.FLAG,
            "0, 1",
            "1",
            P,
            V(2, 11),
            "register user buffers during CUDA-graph capture",
            "NCCL_PARAM GraphRegister, src/enqueue.cc",
        ),
        flag(False),
    ),
    (
        Setting(
            "NCCL_LAUNCH_MODE",
            Kind.CHOICE,
            "PARALLEL, GROUP (case-insensitive)",
            "PARALLEL",
            C,
            V(2, 1),
            "kernel launch mode for several GPUs per process; re-read at each init but kept process-wide; "
            "GROUP deprecated since 2.9",
            "src/init.cc (ncclGetEnv NCCL_LAUNCH_MODE)",
        ),
        check_choice({"PARALLEL": "PARALLEL (default)", "GROUP": "GROUP (deprecated since 2.9)"}, "NCCL uses PARALLEL"),
    ),
    (
        Setting(
            "NCCL_TUNER_PLUGIN",
            Kind.TEXT,
            "library path, suffix (libnccl-tuner-<name>.so) or none",
            "libnccl-tuner.so, else the net plugin's tuner, else NCCL's model",
            P,
            V(2, 19),
            "external tuner that picks algorithm, protocol and channels; load status is kept per process",
            "src/plugin/tuner.cc",
        ),
        check_tuner_plugin,
    ),
    (
        Setting(
            "NCCL_TUNER_CONFIG_FILE",
            Kind.TEXT,
            "path of a CSV config",
            "nccl_tuner.conf in the working directory",
            C,
            V(2, 27, 5),
            "config of NCCL's example tuner plugin only (read by its init, once per communicator)",
            "plugins/tuner/example/plugin.c (ext-tuner/example before 2.29.7)",
        ),
        check_text("config file"),
    ),
    (
        Setting(
            "NCCL_CTA_POLICY",
            Kind.CHOICE,
            "DEFAULT, EFFICIENCY, ZERO combined with | (2.29+); legacy 0, 1, 2",
            "DEFAULT",
            P,
            V(2, 27),
            "CTA policy; EFFICIENCY/ZERO only change NVLS and symmetric kernels, no effect on a PCIe all-reduce",
            "src/init.cc (getEnvCtaPolicyOnce, envConfigOverride)",
            ("2.27: integer 0..1", "2.28: integer 0..2", "2.29: names with |, legacy digit = first character"),
        ),
        check_cta_policy,
    ),
    (
        Setting(
            "NCCL_IGNORE_CPU_AFFINITY",
            Kind.FLAG,
            "0, 1",
            "0",
            P,
            V(2, 4, 6),
            "1: pin NCCL threads to the GPU's NUMA CPUs, ignoring the process affinity",
            "NCCL_PARAM IgnoreCpuAffinity, src/graph/topo.cc",
        ),
        flag(False),
    ),
    (
        Setting(
            "NCCL_NET_DISABLE_INTRA",
            Kind.FLAG,
            "0, 1 (only 1 has an effect)",
            "0",
            P,
            V(2, 12),
            "1: never route intra-node traffic through a NIC",
            "NCCL_PARAM NetDisableIntra, src/graph/paths.cc",
        ),
        flag(True),
    ),
    (
        Setting(
            "NCCL_IGNORE_DISABLED_P2P",
            Kind.FLAG,
            "0, 1, 2",
            "0",
            P,
            V(2, 12),
            "1: no warning when NVML reports P2P disabled; 2: skip the NVML P2P check (P2P is then tried anyway)",
            "NCCL_PARAM IgnoreDisabledP2p, src/graph/paths.cc (ncclTopoCheckP2p)",
        ),
        flag(False, {1: "silence the 'P2P is disabled' message (P2P stays off)", 2: "skip NVML's P2P status check"}),
    ),
    (
        Setting(
            "NCCL_GRAPH_FILE",
            Kind.TEXT,
            "path of an XML graph",
            "unset",
            C,
            V(2, 6),
            "load the ring/tree graphs from a file instead of searching",
            "src/graph/search.cc",
        ),
        check_text("graph file"),
    ),
    (
        Setting(
            "NCCL_TOPO_FILE",
            Kind.TEXT,
            "path of an XML topology",
            "unset",
            C,
            V(2, 6),
            "load the topology from a file before detection",
            "src/graph/topo.cc",
        ),
        check_text("topology file"),
    ),
    (
        Setting(
            "NCCL_DEBUG",
            Kind.CHOICE,
            "VERSION, WARN, INFO, ABORT, TRACE (case-insensitive)",
            "unset (no log)",
            P,
            ALWAYS,
            "log level",
            "src/debug.cc",
        ),
        check_choice(
            {
                "VERSION": "VERSION: the version line only",
                "WARN": "WARN: errors only",
                "INFO": "INFO: the init and per-subsystem lines",
                "ABORT": "ABORT",
                "TRACE": "TRACE",
            },
            "NCCL logs nothing",
        ),
    ),
    (
        Setting(
            "NCCL_DEBUG_SUBSYS",
            Kind.LIST,
            ", ".join(SUBSYS) + " (comma list, ^ excludes)",
            "INIT,BOOTSTRAP,ENV",
            P,
            V(2, 3, 4),
            "which subsystems log INFO lines; GRAPH and TUNING give the graph and model tables",
            "src/debug.cc",
        ),
        check_debug_subsys,
    ),
    (
        Setting(
            "NCCL_NO_CACHE",
            Kind.LIST,
            "comma list of NCCL_ names, or ALL (exact case)",
            "unset",
            P,
            V(2, 29, 7),
            "re-read the listed NCCL_PARAM settings at each use instead of once per process",
            "src/misc/param.cc, src/param/param.cc",
        ),
        _check_no_cache,
    ),
    (
        Setting(
            "NCCL_THREAD_THRESHOLDS",
            Kind.LIST,
            "up to 6 integers: Tree LL LL128 Simple, Ring LL LL128 Simple",
            "per protocol (Ring LL x nRanks)",
            C,
            V(2, 5),
            "bytes per thread below which NCCL halves the threads of a collective",
            "src/graph/tuning.cc",
        ),
        check_thread_thresholds,
    ),
)

CATALOGUE: tuple[Setting, ...] = tuple(s for s, _ in _ENTRIES)
CATALOGUE_BY_NAME: dict[str, Setting] = {s.name: s for s in CATALOGUE}
CHECKS: dict[str, Check] = {s.name: check for s, check in _ENTRIES}

# Every other NCCL_* variable some NCCL release (2.18 .. 2.30.7) reads (NCCL_PARAM, ncclGetEnv, getenv
# in src/ and the plugins) or env.rst documents: known, so not "unknown", but not checked here.
OTHER_NAMES = frozenset(
    "NCCL_" + n
    for n in """
AGG_CHANNEL_SIZE ALLGATHERV_ENABLE ALLOC_P2P_NET_LL_BUFFERS CGA_CLUSTER_SIZE CHECKS_DISABLE CHECK_MODE
CHECK_POINTERS CHUNK_SIZE COLLNET_ENABLE COLLNET_NODE_THRESHOLD COMM_BLOCKING COMM_ID COMM_SHRINK_SHARE_RESOURCES
COMM_SPLIT_SHARE_RESOURCES CONF_FILE CONNECT_ROUND_MAX_PEERS CREATE_THREAD_CONTEXT CROSS_NIC CUDA_PATH
CUMEM_HOST_ENABLE DEBUG_FILE DEBUG_TIMESTAMP_FORMAT DEBUG_TIMESTAMP_LEVELS DEV_API_JIT DISABLE_MEM_MANAGER
DMABUF_ENABLE ELASTIC_BUFFER_REGISTER ENABLE_VERSION_CHECK ENV_PLUGIN GDAKI_USE_RELIABLE_DB GDRCOPY_ENABLE
GDRCOPY_FIFO_ENABLE GDRCOPY_FLUSH_ENABLE GDRCOPY_SYNC_ENABLE GDR_FLUSH_DISABLE GIN_COUNTER_POOL_SIZE GIN_ENABLE
GIN_ERROR_QUERY_SEC GIN_EXCLUSIVE_CONTEXTS GIN_GDAKI_MAX_DEST_RD_ATOMIC GIN_GDAKI_MAX_QP_RD_ATOMIC
GIN_GDAKI_NIC_HANDLER GIN_GDAKI_QP_DEPTH GIN_IB_TC GIN_NCONNECTIONS GIN_NCONTEXTS GIN_PLUGIN GIN_PLUGIN_REF_COUNT
GIN_PROXY_QUEUE_SIZE GIN_SIGNAL_POOL_SIZE GIN_TYPE GRAPH_DUMP_FILE GRAPH_DUMP_FILE_RANK GRAPH_HELPER_DISABLE
GRAPH_MIXING_SUPPORT GRAPH_STREAM_ORDERING GROUP_CUDA_STREAM HOSTID IBVERBS_LIB IB_ADAPTIVE_ROUTING IB_ADDR_FAMILY
IB_ADDR_RANGE IB_AR_THRESHOLD IB_CUDA_SUPPORT IB_DATA_DIRECT IB_DEVICE_PCI_ORDER IB_DISABLE IB_ECE_ENABLE IB_FIFO_TC
IB_GID_INDEX IB_HCA IB_MERGE_NICS IB_MERGE_VFS IB_MQP_RETRY_ALL IB_MQP_RETRY_CNT IB_MQP_RETRY_SLEEP_MSEC IB_OOO_RQ
IB_PCI_RELAXED_ORDERING IB_PKEY IB_PREPOST_RECEIVE_WORK_REQUESTS IB_QPS_PER_CONNECTION IB_QUERY_PORT_SPEED
IB_RECEIVER_SIDE_MATCHING_SCHEME IB_RESILIENCY_PORT_FAILOVER IB_RESILIENCY_PORT_FAILOVER_MAX_ATTEMPTS
IB_RESILIENCY_PORT_FAILOVER_PROBE_DELAY IB_RESILIENCY_PORT_RECOVERY IB_RESILIENCY_PORT_RECOVERY_ACK_TIMEOUT
IB_RESILIENCY_PORT_RECOVERY_ALIVE_MSG_BATCH_INTERVAL IB_RESILIENCY_PORT_RECOVERY_ALIVE_MSG_BATCH_SIZE
IB_RESILIENCY_PORT_RECOVERY_ALIVE_MSG_SEQUENCE_SIZE IB_RESILIENCY_PORT_RECOVERY_ALIVE_MSG_TIMEOUT
IB_RESILIENCY_PORT_RECOVERY_ATTEMPTS_MAX IB_RESILIENCY_PORT_RECOVERY_START_DELAY IB_RETRY_CNT IB_RETURN_ASYNC_EVENTS
IB_ROCE_VERSION_NUM IB_ROUTABLE_FLID_GID_INDEX IB_SL IB_SPLIT_DATA_ON_QPS IB_SUBNET_AWARE_ROUTING
IB_SUBNET_PREFIX_LEN IB_TC IB_TIMEOUT IB_USE_INLINE IB_WARN_RAIL_LOCAL IGNORE_COLLNET_MISMATCH IGNORE_NET_MISMATCH
INSPECTOR_COLL_POOL_SIZE INSPECTOR_COMM_POOL_SIZE INSPECTOR_DUMP_COLL_RING_SIZE INSPECTOR_DUMP_DIR
INSPECTOR_DUMP_MIN_SIZE_BYTES INSPECTOR_DUMP_P2P_RING_SIZE INSPECTOR_DUMP_THREAD_ENABLE
INSPECTOR_DUMP_THREAD_INTERVAL_MICROSECONDS INSPECTOR_DUMP_VERBOSE INSPECTOR_ENABLE INSPECTOR_ENABLE_P2P
INSPECTOR_P2P_POOL_SIZE INSPECTOR_POOL_GROW INSPECTOR_PROM_DUMP INSPECTOR_REQUIRE_KERNEL_TIMING
IPC_USE_ABSTRACT_SOCKET L1_SHARED_MEMORY_CARVEOUT LAUNCH_ORDER_IMPLICIT LAUNCH_RACE_FATAL LEGACY_CUDA_REGISTER
LL128_C2C LL_THRESHOLD LOCAL_REGISTER LSA_TEAM_SIZE MAX_P2P_NCHANNELS MEM_SYNC_DOMAIN MIN_P2P_NCHANNELS
MLOPART_RDMA_ENABLE MNNVL_CLIQUE_ID MNNVL_CROSS_CLIQUE MNNVL_ENABLE MNNVL_RAIL_PER_HOST MNNVL_SCATTER_NETS_ENABLE
MNNVL_UUID MULTI_RANK_GPU_ENABLE MULTI_SEGMENT_REGISTER NCHANNELS_PER_NET_PEER NET NETDEVS_POLICY NET_FORCE_FLUSH
NET_FORCE_MERGE NET_GDR_C2C NET_GDR_MLOPART NET_GDR_READ NET_MERGE_LEVEL NET_MERGE_POLICY
NET_OPTIONAL_RECV_COMPLETION NET_OVERHEAD NET_PLUGIN NET_PLUGIN_REF_COUNT NET_SHARED_BUFFERS NET_SHARED_COMMS
NSOCKS_PERTHREAD NUM_RMA_CTX NVB_DISABLE NVB_PRECONNECT NVLINK_UTIL_CENTRIC_SCHED_ENABLE NVLSTREE_MAX_CHUNKSIZE
NVLS_CHUNKSIZE NVLS_NCHANNELS NVTX_DISABLE OOB_NET_ENABLE OOB_NET_IFNAME P2P_DIRECT_DISABLE P2P_EPOCH_ENABLE
P2P_LL_THRESHOLD P2P_MAX_PEERS P2P_NET_CHUNKSIZE P2P_NVL_CHUNKSIZE P2P_PCI_CHUNKSIZE P2P_PER_CHANNEL_NET_BW
P2P_PXN_LEVEL P2P_READ_ENABLE P2P_SCHEDULE_GROUP_SIZE PARAM_DUMP_ALL PAT_ENABLE
PROFILER_CE_POLLER_INTERVAL_MICROSECONDS PROFILER_CE_TIMING PROFILER_PLUGIN PROFILE_CE_BATCH_POOL_SIZE
PROFILE_CE_COLL_POOL_SIZE PROFILE_CE_SYNC_POOL_SIZE PROFILE_COLL_API_POOL_SIZE PROFILE_COLL_POOL_SIZE
PROFILE_DUMP_FILE PROFILE_EVENT_MASK PROFILE_GROUP_API_POOL_SIZE PROFILE_GROUP_POOL_SIZE
PROFILE_KERNEL_LAUNCH_POOL_SIZE PROFILE_P2P_API_POOL_SIZE PROFILE_P2P_POOL_SIZE PROFILE_PROXY_CTRL_POOL_SIZE
PROFILE_PROXY_DETACH_POOL_SIZE PROGRESS_APPENDOP_FREQ PROXY_APPEND_BATCH_SIZE PROXY_CPUSET PROXY_DUMP_SIGNAL
PROXY_PROFILE PXN_C2C PXN_DISABLE RAS_ADDR RAS_ENABLE RAS_TIMEOUT_FACTOR REPORT_CONNECT_PROGRESS RMA_DISABLE
RMA_PLUGIN RMA_PLUGIN_REF_COUNT RMA_PROXY_DUMP_SIGNAL RMA_PROXY_QUEUE_SIZE RUNTIME_CONNECT SET_CPU_STACK_SIZE
SET_STACK_SIZE SET_THREAD_NAME SHADOW_MEMPOOL_MAX_SIZE SHM_LOCALITY SHM_MEMCPY_MODE SHM_USE_CUDA_MEMCPY
SINGLE_PROC_MEM_REG_ENABLE SINGLE_RING_THRESHOLD SOCKET_FAMILY SOCKET_IFNAME SOCKET_INLINE SOCKET_MAGIC
SOCKET_MIN_TASKSIZE SOCKET_NTHREADS SOCKET_POLL_TIMEOUT_MSEC SOCKET_RCVBUF SOCKET_RETRY_CNT SOCKET_RETRY_SLEEP_MSEC
SOCKET_SNDBUF SYM_CE_THRESHOLD SYM_CTAS SYM_GIN_KERNELS_ENABLE SYM_KERNEL SYM_NOWIN_ENABLE SYM_REUSE_SYSMEM_HANDLES
SYM_RS_GIN_CHUNK_SIZE SYM_TMA_ENABLE TOPO_DUMP_FILE TOPO_DUMP_FILE_RANK TOPO_SPLIT_MLOPART TREE_THRESHOLD
UID_STAGGER_RATE UID_STAGGER_THRESHOLD UNPACK_DOUBLE_NCHANNELS WARN_ENABLE_DEBUG_INFO WIN_ENABLE WIN_STRIDE
WORK_ARGS_BYTES WORK_FIFO_BYTES WORK_FIFO_DEPTH
""".split()
)
# NCCL_-prefixed names read by other software (torch 2.13 c10d/ProcessGroupNCCL.hpp: old names of TORCH_NCCL_*).
FOREIGN_NAMES = {
    LIBRARY_ENV: "read by fastverify to locate libnccl, not by NCCL",
    "NCCL_ASYNC_ERROR_HANDLING": "read by PyTorch (old name of TORCH_NCCL_ASYNC_ERROR_HANDLING), not by NCCL",
    "NCCL_BLOCKING_WAIT": "read by PyTorch (old name of TORCH_NCCL_BLOCKING_WAIT), not by NCCL",
    "NCCL_DESYNC_DEBUG": "read by PyTorch (old name of TORCH_NCCL_DESYNC_DEBUG), not by NCCL",
    "NCCL_ENABLE_TIMING": "read by PyTorch (old name of TORCH_NCCL_ENABLE_TIMING), not by NCCL",
    "NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK": "read by PyTorch, not by NCCL",
}
ALL_NAMES = tuple(sorted(set(CATALOGUE_BY_NAME) | OTHER_NAMES | set(FOREIGN_NAMES)))


def suggest(name: str) -> str | None:
    """The known NCCL variable closest to ``name``, or ``None``.

    difflib on the whole name, confirmed on the part after ``NCCL_`` (the shared prefix alone
    makes ``NCCL_FOO`` look like ``NCCL_PROTO``); else a known name that extends ``name``
    (``NCCL_CUMEM`` -> ``NCCL_CUMEM_ENABLE``), catalogued settings first.
    """
    upper = name.upper()[:64] if isinstance(name, str) else ""
    if not upper.startswith("NCCL_"):
        upper = "NCCL_" + upper
    for close in difflib.get_close_matches(upper, ALL_NAMES, n=3, cutoff=0.75):
        if difflib.SequenceMatcher(None, upper[5:], close[5:]).ratio() >= 0.55:
            return close
    longer = sorted((n not in CATALOGUE_BY_NAME, n) for n in ALL_NAMES if n.startswith(upper + "_"))
    return longer[0][1] if longer else None


def _check_name(name: str, value: str) -> Finding | None:
    """A finding when ``name`` is not a catalogued setting; ``None`` when it is."""
    if name in CATALOGUE_BY_NAME:
        return None
    if name in FOREIGN_NAMES:
        return Finding(name, value, Severity.OK, FOREIGN_NAMES[name])
    if name in OTHER_NAMES:
        return Finding(name, value, Severity.OK, "an NCCL setting outside fastverify's catalogue: value not checked")
    if name.upper() in ALL_NAMES:
        return Finding(
            name,
            value,
            Severity.ERROR,
            f"environment names are case-sensitive: NCCL never reads {show(name)}",
            f"rename it {name.upper()}",
        )
    guess = suggest(name)
    what = "unknown NCCL setting" if name.startswith("NCCL_") else "not an NCCL setting (NCCL reads NCCL_* names)"
    return Finding(
        name,
        value,
        Severity.ERROR,
        f"{what} {show(name)}: NCCL ignores it",
        f"did you mean {guess}?" if guess else "see the NCCL environment variable docs",
    )


def validate_setting(name: str, value: str, version: NcclVersion | None = None) -> Finding:
    """What NCCL ``version`` does with ``name=value``; never raises on text input.

    Parameters
    ----------
    name, value
        The environment variable as set (``value`` exactly, spaces included).
    version
        The NCCL the process will load (:func:`fastverify.nccl.version.read_nccl_version`);
        ``None`` checks against the newest grammar (NCCL_ALGO/PROTO 2.24+, 64 channels, all level
        names) and says so in the reason where the version matters.
    """
    name, value = str(name), str(value)
    unknown = _check_name(name, value)
    if unknown is not None:
        return unknown
    setting = CATALOGUE_BY_NAME[name]
    ctx = Ctx.of(version)
    if version is not None and version < setting.since:
        return Finding(
            name,
            value,
            Severity.WARNING,
            f"NCCL {version} does not read {name} (added in {setting.since})",
            f"upgrade NCCL to >= {setting.since} or remove it",
        )
    verdict = CHECKS[name](value, ctx, setting)
    return Finding(name, value, verdict.severity, verdict.reason.replace("\n", " "), verdict.fix)


def validate_env(env: Mapping[str, str], version: NcclVersion | None = None) -> list[Finding]:
    """Findings for every NCCL_* variable of ``env`` (also mis-cased ``nccl_*`` ones), in name order
    (:func:`validate_setting`), then those of the settings taken together (:func:`validate_settings`:
    an alias overridden, P2P_LEVEL under P2P_DISABLE, a minimum channel count above a maximum …)."""
    names = sorted(k for k in env if isinstance(k, str) and k.upper().startswith("NCCL_"))
    findings = [validate_setting(k, env[k], version) for k in names]
    return findings + validate_settings({k: str(env[k]) for k in names}, version)


def validate_settings(
    pairs: Mapping[str, str] | Iterable[tuple[str, str]], version: NcclVersion | None = None
) -> list[Finding]:
    """What NCCL ``version`` does with a whole set of settings that it resolves silently, one
    :class:`Finding` per interaction (each value on its own is :func:`validate_setting`'s job).

    ``pairs`` is a mapping or ``(name, value)`` pairs (a later pair of a name wins, as in an
    environment). Never raises on text input. Findings (facts: NCCL 2.18 .. 2.30.7):

    * ``error``: a minimum channel count above a maximum one. NCCL caps the communicator's channels
      at the maximum, then copies channels up to the minimum (``src/graph/connect.cc``, "max, then
      min"), so it runs the minimum and the maximum is not honoured; ``NCCL_MIN_CTAS`` above
      ``NCCL_MAX_CTAS`` is instead lowered to it (``src/init.cc``: "minCTAs … is larger than maxCTAs,
      set both to …"). Each pair of ``NCCL_MIN_NCHANNELS`` / ``NCCL_MIN_NRINGS`` / ``NCCL_MIN_CTAS``
      and ``NCCL_MAX_NCHANNELS`` / ``NCCL_MAX_NRINGS`` / ``NCCL_MAX_CTAS`` is compared as NCCL reads
      and clamps them (the NCHANNELS name wins over its NRINGS alias; out-of-range values clamped).
    * ``warning``: an NRINGS alias overridden by its NCHANNELS name; ``NCCL_P2P_LEVEL`` ignored under
      ``NCCL_P2P_DISABLE=1``; P2P and SHM both disabled (GPUs of one node then use the network).
    """
    present: dict[str, str] = {}
    for name, value in pairs.items() if isinstance(pairs, Mapping) else pairs:
        present[str(name)] = str(value)
    ctx = Ctx.of(version)
    findings: list[Finding] = []
    for old, new in (("NCCL_MIN_NRINGS", "NCCL_MIN_NCHANNELS"), ("NCCL_MAX_NRINGS", "NCCL_MAX_NCHANNELS")):
        if old in present and new in present:
            findings.append(
                Finding(old, present[old], Severity.WARNING, f"ignored: {new} is also set and wins", f"remove {old}")
            )
    if "NCCL_P2P_LEVEL" in present and strtoll(present.get("NCCL_P2P_DISABLE", "")).value == 1:
        findings.append(
            Finding(
                "NCCL_P2P_LEVEL",
                present["NCCL_P2P_LEVEL"],
                Severity.WARNING,
                "ignored: NCCL_P2P_DISABLE=1 sets the level to LOC",
                "remove one of the two",
            )
        )
    if strtoll(present.get("NCCL_P2P_DISABLE", "")).value == 1 and present.get("NCCL_SHM_DISABLE", "").strip() == "1":
        findings.append(
            Finding(
                "NCCL_SHM_DISABLE",
                present["NCCL_SHM_DISABLE"],
                Severity.WARNING,
                "with P2P and SHM both disabled, GPUs of one node talk through the network (sockets)",
                "keep SHM enabled",
            )
        )
    findings += _channel_bounds(present, ctx)
    return findings


def _channel_read(present: Mapping[str, str], names: tuple[str, ...], ctx: Ctx) -> tuple[str, int] | None:
    """The first of ``names`` that is set and that NCCL reads as a number: (name, value NCCL uses,
    clamped as ``ncclMinNchannels``/``ncclMaxNchannels``/``envConfigOverride`` clamp it); None if none."""
    top = 64 if ctx.at_least(CHANNELS_64) else 32
    for name in names:
        if name not in present:
            continue
        if name.endswith("_CTAS") and not ctx.at_least(V(2, 17)):
            return None  # this NCCL does not read NCCL_MIN_CTAS / NCCL_MAX_CTAS
        n, _ = param_int(present[name], "")
        if n is None:
            return None  # not a number NCCL reads: validate_setting says so; the default applies
        if name.endswith("_CTAS"):
            return None if n <= 0 else (name, min(n, top))  # <= 0: "too low, leaving it set"
        if n == -2:
            return None  # NCCL_PARAM's unset marker
        lo = 0 if "_MIN_" in name else 1
        return name, max(lo, min(n, top))
    return None


def _channel_bounds(present: Mapping[str, str], ctx: Ctx) -> list[Finding]:
    """Error findings for each minimum channel setting above a maximum one (see :func:`validate_settings`)."""
    mins = [
        m
        for m in (
            _channel_read(present, ("NCCL_MIN_NCHANNELS", "NCCL_MIN_NRINGS"), ctx),
            _channel_read(present, ("NCCL_MIN_CTAS",), ctx),
        )
        if m
    ]
    maxs = [
        m
        for m in (
            _channel_read(present, ("NCCL_MAX_NCHANNELS", "NCCL_MAX_NRINGS"), ctx),
            _channel_read(present, ("NCCL_MAX_CTAS",), ctx),
        )
        if m
    ]
    ctas_max = next((hi for name, hi in maxs if name == "NCCL_MAX_CTAS"), None)
    out = []
    for lo_name, asked in mins:
        for hi_name, hi in maxs:
            lo = asked
            if lo_name == "NCCL_MIN_CTAS" and hi_name != "NCCL_MAX_CTAS" and ctas_max is not None:
                lo = min(asked, ctas_max)  # minCTAs is first lowered to maxCTAs (reported on its own)
            if lo <= hi:
                continue
            pair = f"{lo_name}={present[lo_name]} and {hi_name}={present[hi_name]}"
            if lo_name == "NCCL_MIN_CTAS" and hi_name == "NCCL_MAX_CTAS":
                out.append(
                    Finding(
                        lo_name,
                        present[lo_name],
                        Severity.ERROR,
                        f"{pair} contradict: the minimum ({lo}) is above the maximum ({hi}), and "
                        f"{ctx.nccl} lowers minCTAs to {hi} (src/init.cc: 'minCTAs is larger than maxCTAs, "
                        f"set both to {hi}'), so {lo_name} is not honoured",
                        f"set {lo_name} <= {hi_name}, or drop one of them",
                    )
                )
                continue
            out.append(
                Finding(
                    hi_name,
                    present[hi_name],
                    Severity.ERROR,
                    f"{pair} contradict: the minimum ({lo}) is above the maximum ({hi}); {ctx.nccl} "
                    f"caps the communicator at {hi} channel(s), then copies them up to {lo} "
                    f"(src/graph/connect.cc, 'max, then min'), so it runs {lo} channels and {hi_name} "
                    f"is not honoured",
                    f"set {lo_name} <= {hi_name}, or drop one of them",
                )
            )
    return out


def explain(name: str) -> str:
    """A few lines about one setting, for the command line.

    Raises
    ------
    UserError
        ``name`` is not in the catalogue (the message suggests the closest name).
    """
    s = CATALOGUE_BY_NAME.get(name) or CATALOGUE_BY_NAME.get(str(name).upper())
    if s is None:
        guess = suggest(str(name))
        hint = f"; did you mean {guess}?" if guess else ""
        raise UserError(f"{name!r} is not in fastverify's NCCL catalogue{hint}")
    scope = (
        "read once per process: set it before the process starts"
        if s.scope is Scope.PROCESS
        else "re-read at each communicator init"
    )
    lines = [
        f"{s.name}: {s.meaning}",
        f"  values:  {s.values}",
        f"  default: {s.default}",
        f"  scope:   {scope}",
        f"  since:   NCCL {s.since}",
    ]
    lines += [f"  change:  {c}" for c in s.changes]
    if s.alias_of:
        lines.append(f"  alias of {s.alias_of}")
    lines.append(f"  source:  {s.source}")
    return "\n".join(lines)


def split_set(item: str) -> tuple[str, str]:
    """``(name, value)`` of one ``--set NAME=VALUE`` flag (``topo`` and ``tune``), its form only.

    Raises
    ------
    UserError
        No ``=``, no name, or an empty value (refused as the env file refuses it, :mod:`fastverify.envfile`).
    """
    name, eq, value = item.partition("=")
    if not eq or not name:
        raise UserError(f"--set {item!r}: expected NAME=VALUE, e.g. NCCL_P2P_LEVEL=SYS")
    if value == "":
        raise UserError(f"--set {item!r}: {name} has an empty value (leave the setting out instead)")
    return name, value


def apply_sets(items: Iterable[str], env: Mapping[str, str], version: NcclVersion | None) -> dict[str, str]:
    """``env`` with the ``--set NAME=VALUE`` flags ``items`` on top, each checked strictly
    (:func:`validate_setting`), then against each other and the environment (:func:`validate_settings`:
    MIN over MAX channels, ...).

    Raises
    ------
    UserError
        A form :func:`split_set` refuses, a NAME given twice (NCCL reads one value; the later one
        would win silently), an unknown name, or a value NCCL ``version`` rejects.
    """
    out = dict(env)
    given: dict[str, str] = {}
    for item in items:
        name, value = split_set(item)
        if name in given:
            raise UserError(
                f"--set {shown(name, 80)} is given twice ({shown(given[name], 40)} and "
                f"{shown(value, 40)}); give each setting once"
            )
        finding = validate_setting(name, value, version)
        if finding.severity is Severity.ERROR:
            raise UserError(f"--set {name}={value}: {finding.reason}" + (f" ({finding.fix})" if finding.fix else ""))
        out[name] = value
        given[name] = value
    if given:
        for f in validate_settings({k: v for k, v in out.items() if k.startswith("NCCL_")}, version):
            if f.severity is Severity.ERROR and (f.name in given or any(g in f.reason for g in given)):
                raise UserError(f"--set {f.name}={f.value}: {f.reason}" + (f" ({f.fix})" if f.fix else ""))
    return out
