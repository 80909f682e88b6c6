"""``NCCL_ALGO`` and ``NCCL_PROTO``: the two list grammars NCCL parses them with, and the check.

NCCL <= 2.23 reads one comma list for every collective (case-insensitive, a leading ``^``
excludes, unknown names silently ignored); NCCL >= 2.24 reads ``list[;function:list]*`` and fails
communicator init on an unknown name or function (NVIDIA/nccl ``src/graph/tuning.cc``
``parseList``, ``ncclTopoTuneModel``; names from ``ncclAlgoStr`` / ``ncclProtoStr`` in
``src/init.cc``).
"""

from __future__ import annotations

from typing import NamedTuple

from fastverify.nccl.findings import V, Ctx, Setting, Severity, Verdict, merge, names_at, show
from fastverify.nccl.intparse import C_SPACE

GRAMMAR_2_24 = V(2, 24)  # NCCL_ALGO / NCCL_PROTO: per-function grammar, unknown token fails init

FUNCS = ("Broadcast", "Reduce", "AllGather", "ReduceScatter", "AllReduce")  # ncclFuncStr, src/init.cc
# (name, first release, first release without it); ncclAlgoStr / ncclProtoStr in src/init.cc
ALGOS = (("Tree", V(2, 5), None), ("Ring", V(2, 5), None), ("CollNet", V(2, 6), V(2, 14)),
         ("CollNetDirect", V(2, 14), None), ("CollNetChain", V(2, 14), None), ("NVLS", V(2, 17), None),
         ("NVLSTree", V(2, 18), None), ("PAT", V(2, 23), None))
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


def parse(name: str, value: str, ctx: Ctx) -> Parsed:
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
        return Verdict(Severity.WARNING, f"empty: {ctx.nccl} parses no entry and keeps the defaults" + note,
                       "remove the variable")
    if value == "" and is_algo:
        return Verdict(Severity.WARNING, f"empty: {ctx.nccl} disables every algorithm, then falls back to Ring "
                       "and Tree", "remove the variable")
    parsed = parse(s.name, value, ctx)
    if parsed.error:
        return Verdict(Severity.ERROR, f"{parsed.error}: {ctx.nccl} fails communicator init (ncclInvalidUsage), "
                       f"per {grammar}" + note, f"valid names: {', '.join(names)}; e.g. {s.name}=allreduce:"
                       + ("ring,tree" if is_algo else "ll,simple"))
    verdicts: list[Verdict] = []
    known_tokens = [t for t in filter(None, value.lstrip("^").split(",")) if _match(t, names)]
    if parsed.unknown:
        shown = ", ".join(_why_unknown(t, table, ctx) for t in parsed.unknown)
        fix = (f"the 'function:list' form needs NCCL >= 2.24; on {ctx.version} write a plain list"
               if any(c in value for c in ":;") else f"valid names in {ctx.nccl}: {', '.join(names)}")
        if known_tokens or value.startswith("^"):
            verdicts.append(Verdict(Severity.WARNING, f"{ctx.nccl} silently ignores {shown}", fix))
        else:
            what = ("disables every algorithm, then falls back to Ring and Tree because CollNet is "
                    "unavailable on one node: the value has no effect" if is_algo else
                    "disables every protocol: the first collective fails ('no algorithm/protocol available')")
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
            verdicts.append(Verdict(Severity.WARNING, f"leaves AllReduce only {', '.join(on) or 'nothing'}: on one "
                                    "node without NVSwitch NCCL then has no algorithm and the first all-reduce "
                                    "fails" + note,
                                    f"keep Ring or Tree for AllReduce, e.g. {s.name}=allreduce:ring,tree"
                                    if new else f"keep Ring or Tree, e.g. {s.name}=Ring,Tree"))
    else:
        empty = [f for f in FUNCS if not any(enable[f].values())]
        if empty:
            sev = Severity.ERROR if "AllReduce" in empty else Severity.WARNING
            verdicts.append(Verdict(sev, f"leaves no protocol for {', '.join(empty)}: the first such collective "
                                    "fails ('no algorithm/protocol available')" + note, "keep at least Simple"))
        if allreduce["LL128"] == 1:
            how = ("the '^' exclusion list also forces LL128 on" if "AllReduce" in parsed.caret
                   else "listing LL128 forces it on")
            verdicts.append(Verdict(Severity.WARNING, f"{how} for AllReduce and skips NCCL's LL128 checks; NCCL leaves "
                                    "LL128 off on PCIe-only nodes because it can corrupt data there (docs: NCCL_PROTO)",
                                    "on PCIe write the protocols to keep without LL128, e.g. LL,Simple"))
    if not verdicts or all(v.severity == Severity.OK for v in verdicts):
        shown_on = ", ".join(n + (" (auto)" if allreduce[n] == 2 else "") for n in on)
        return Verdict(Severity.OK, f"AllReduce may use {shown_on}, per {grammar}" + note)
    return merge(*verdicts)
