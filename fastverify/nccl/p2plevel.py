"""``NCCL_P2P_LEVEL`` and ``NCCL_P2P_DISABLE``: how far NCCL uses the P2P transport.

NCCL compares level names case-sensitively (``strcmp``) and maps the legacy integers 0..5 to
LOC, PIX, PXB, PHB, SYS, SYS (``levelsOldToNew``); a value it does not understand is ignored and
the default PXB applies. Only ``NCCL_P2P_DISABLE=1`` disables P2P (NVIDIA/nccl
``src/graph/paths.cc`` ``ncclGetLevel``, level names in ``src/graph/topo.cc``).
"""

from __future__ import annotations

import difflib

from fastverify.nccl.findings import V, Ctx, Setting, Severity, Verdict, names_at, show
from fastverify.nccl.intparse import C_SPACE, INT32_MAX, strtoll

# Level names NCCL accepts (topoPathTypeStr up to PATH_SYS), with the release that added them.
_LEVELS = (("LOC", V(2, 3, 4), None), ("NVL", V(2, 3, 4), None), ("NVB", V(2, 3, 4), None), ("C2C", V(2, 26), None),
           ("PIX", V(2, 3, 4), None), ("PXB", V(2, 3, 4), None), ("P2C", V(2, 27), None),
           ("PXN", V(2, 12), None), ("PHB", V(2, 3, 4), None), ("SYS", V(2, 3, 4), None))
_LEVEL_MEANING = {
    "LOC": "never use P2P", "NVL": "P2P over NVLink only", "NVB": "P2P over NVLink, also through a GPU",
    "C2C": "P2P up to a C2C link", "PIX": "P2P under one PCIe switch", "PXB": "P2P across PCIe switches "
    "(NCCL's default)", "P2C": "P2P up to PCIe + C2C", "PXN": "P2P up to PXN paths",
    "PHB": "P2P through the CPU's host bridge (same NUMA node)", "SYS": "P2P across CPU sockets too",
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
            return Verdict(Severity.ERROR, f"legacy level {show(value)} overflows NCCL's int",
                           "use a level name, e.g. SYS")
        old = c.value
        level = _LEGACY_LEVELS[min(old, len(_LEGACY_LEVELS) - 1)]
        if old > len(_LEGACY_LEVELS) - 1:
            return Verdict(Severity.ERROR, f"legacy level {old} is above 5: NCCL clamps it to 5 = {level}",
                           f"use {level}")
        if c.rest:
            return Verdict(Severity.WARNING, f"NCCL reads the legacy level {old} = {level} and ignores {show(c.rest)}",
                           f"use {level}")
        if c.base == 8 and old != int(value, 10):
            return Verdict(Severity.WARNING, f"the leading 0 makes {show(value)} octal = {old} = {level}",
                           f"use {level}")
        return Verdict(Severity.OK, f"legacy integer {old} means {level} (NCCL maps 0..5 to LOC, PIX, PXB, PHB, "
                       "SYS, SYS; NCCL docs discourage integers)", f"use {level}")
    bare = value.strip(C_SPACE).upper()
    if bare in names:
        how = "case-sensitively (strcmp)" if value.strip(C_SPACE) != bare else "exactly (spaces included)"
        return Verdict(Severity.ERROR, f"NCCL compares level names {how}: {show(value)} is silently ignored and the "
                       "default PXB applies", f"use {bare}")
    for name, first, _ in _LEVELS:
        if bare == name:
            return Verdict(Severity.ERROR, f"{name} is a level name only since NCCL {first}: {ctx.nccl} ignores it",
                           f"use one of {', '.join(names)}")
    if value == "":
        return Verdict(Severity.WARNING, "empty: ignored, the default PXB applies",
                       "remove the variable or use a level name")
    guess = difflib.get_close_matches(bare, names, n=1, cutoff=0.5)
    return Verdict(Severity.ERROR, f"{show(value)} is not a P2P level: NCCL ignores it and the default PXB applies"
                   + ctx.assumed(str(ctx.version)),
                   f"did you mean {guess[0]}?" if guess else f"use one of {', '.join(names)}")


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
    return Verdict(Severity.ERROR, f"only 1 disables P2P; NCCL reads {show(value)} as {c.value if c.digits else 0} and "
                   "ignores it", "write 1 to disable P2P, or remove the variable")
