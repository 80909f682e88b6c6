"""Checks of the single-value NCCL settings: flags, thread and channel counts, the CTA policy,
case-insensitive choices, ``NCCL_DEBUG_SUBSYS``, ``NCCL_THREAD_THRESHOLDS``, paths and plugins.

Each check replays how NCCL reads the value (the source named at each one, NVIDIA/nccl ``src/``)
and returns a :class:`~fastverify.nccl.findings.Verdict`.
"""

from __future__ import annotations

import re

from fastverify.nccl.findings import CHANNELS_64, V, Check, Ctx, Setting, Severity, Verdict, merge, show
from fastverify.nccl.intparse import C_SPACE, INT64_MAX, param_int


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
            return merge(note, Verdict(Severity.ERROR, f"NCCL tests {s.name} == 1: {n} is the same as 0",
                                       f"use {allowed}"))
        return merge(note, Verdict(Severity.WARNING, f"not one of {allowed}: NCCL treats {n} as 1", f"use {allowed}"))

    return check


def check_nthreads(lo: int, hi: int) -> Check:
    # getNthreads in src/graph/tuning.cc: <= 0 -> default; % 32 -> WARN and max; clamp to [lo, hi]
    def check(value: str, ctx: Ctx, s: Setting) -> Verdict:
        n, note = param_int(value, s.default)
        if n is None:
            return note  # type: ignore[return-value]
        if n <= 0:
            return merge(note, Verdict(Severity.ERROR, f"{n} <= 0 means unset: NCCL uses its default ({s.default})",
                                       "remove the variable or use 64, 128, 256 or 512"))
        if n % 32:
            return merge(note, Verdict(Severity.ERROR, f"{n} is not a multiple of 32 (warp size): NCCL warns "
                                       f"and uses {hi}", f"use a multiple of 32 in [{lo}, {hi}]"))
        if not lo <= n <= hi:
            edge = lo if n < lo else hi
            return merge(note, Verdict(Severity.ERROR, f"{n} is outside [{lo}, {hi}]: NCCL warns and uses {edge}",
                                       f"use a multiple of 32 in [{lo}, {hi}]"))
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
        deprecated = (not ctas and ctx.at_least(V(2, 17))
                      and Verdict(Severity.OK, f"deprecated since 2.17 for {replacement}"))
        if not ctas and n == -2:
            return merge(note, Verdict(Severity.OK, "-2 is NCCL's 'unset' marker: the default applies"))
        lo = 1 if (ctas or not minimum) else 0
        if n < lo:
            what = "ignores it" if ctas else f"uses {lo}"
            return merge(note, Verdict(Severity.ERROR, f"{n} is below {lo}: NCCL {what}",
                                       f"use a value in [{lo}, {top}]"))
        if n > top:
            return merge(note, Verdict(Severity.ERROR, f"{n} is above {ctx.nccl}'s {top} channels: NCCL caps it "
                                       f"to {top}" + ctx.assumed(f"{ctx.version}, 64 channels since 2.25"),
                                       f"use a value in [{lo}, {top}]"))
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
        return merge(note, Verdict(Severity.ERROR, f"{n} is not a policy in {ctx.nccl} (0..{top}): reset to 0",
                                   f"use 0..{top}"))
    if value.strip(C_SPACE) == "":
        return Verdict(Severity.WARNING, "empty: NCCL finds no policy and keeps DEFAULT", "remove the variable")
    if value[:1].isascii() and value[:1].isdigit():  # legacy: only the first character counts
        if value[0] in "012" and len(value) == 1:
            return Verdict(Severity.OK, f"legacy {value} = {('DEFAULT', 'EFFICIENCY', 'ZERO')[int(value[0])]}")
        if value[0] in "012":
            return Verdict(Severity.ERROR, f"NCCL reads only the first character of {show(value)}", "use DEFAULT, "
                           "EFFICIENCY or ZERO")
        return Verdict(Severity.ERROR, f"legacy policy {show(value)} is not 0, 1 or 2: NCCL uses DEFAULT",
                       "use DEFAULT, EFFICIENCY or ZERO")
    tokens = list(filter(None, value.split("|")))
    bad = [t for t in tokens if t.upper() not in ("DEFAULT", "EFFICIENCY", "ZERO")]
    if tokens and not bad:
        return Verdict(Severity.OK, "policy " + "|".join(t.upper() for t in tokens) + " (no effect on PCIe all-reduce)")
    sev = Severity.WARNING if len(bad) < len(tokens) else Severity.ERROR
    return Verdict(sev, f"NCCL ignores unknown policy {', '.join(map(show, bad)) or 'names'}" + ("" if tokens else
                   " (none given)"), "use DEFAULT, EFFICIENCY or ZERO, combined with |")


def check_choice(choices: dict[str, str], otherwise: str) -> Check:
    """A case-insensitive name (strcasecmp); anything else means ``otherwise``."""

    def check(value: str, ctx: Ctx, s: Setting) -> Verdict:
        if value == "":
            return Verdict(Severity.WARNING, f"empty: {otherwise}", "remove the variable or give a value")
        if value.upper() in choices:
            return Verdict(Severity.OK, choices[value.upper()])
        return Verdict(Severity.ERROR, f"{show(value)} is not one of {', '.join(choices)}: {otherwise}",
                       f"use one of {', '.join(choices)}")

    return check


SUBSYS = ("INIT", "COLL", "P2P", "SHM", "NET", "GRAPH", "TUNING", "ENV", "ALLOC", "ALLOC_HOST", "CALL", "PROXY",
          "NVLS", "BOOTSTRAP", "REG", "PROFILE", "RAS", "DESTROY", "ALL")  # src/debug.cc


def check_debug_subsys(value: str, ctx: Ctx, s: Setting) -> Verdict:
    """``NCCL_DEBUG_SUBSYS``: known subsystems, and whether the INIT lines topo reads survive."""
    exclude = value.startswith("^")
    tokens = list(filter(None, (value[1:] if exclude else value).split(",")))
    bad = [t for t in tokens if t.upper() not in SUBSYS]
    good = [t.upper() for t in tokens if t.upper() in SUBSYS]
    if not tokens and not exclude:
        return Verdict(Severity.ERROR, "empty list: NCCL logs no INFO line at all",
                       "remove the variable or list INIT,ENV")
    if bad and not good and not exclude:
        return Verdict(Severity.ERROR, f"no known subsystem in {show(value)}: NCCL logs no INFO line at all",
                       f"use names among {', '.join(SUBSYS)}")
    verdicts = [Verdict(Severity.WARNING, f"NCCL ignores {', '.join(map(show, bad))}", f"known: {', '.join(SUBSYS)}")
                if bad else None]
    if not exclude and not {"INIT", "ALL"} & set(good):
        verdicts.append(Verdict(Severity.WARNING, "replaces the default INIT,BOOTSTRAP,ENV: the INIT lines "
                                "(transports, rings, channels) that fastverify topo reads are lost",
                                "add INIT, e.g. INIT,ENV,GRAPH,TUNING"))
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
        return Verdict(Severity.ERROR, f"no number in {show(value)}: NCCL keeps its thresholds",
                       "write up to 6 integers separated by spaces")
    rest = value[pos:].strip(C_SPACE)
    if rest:
        return Verdict(Severity.WARNING, f"NCCL reads {numbers} and stops at {show(rest)}",
                       "separate the numbers with spaces only (Tree LL LL128 Simple, Ring LL LL128 Simple)")
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
