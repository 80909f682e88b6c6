"""The NCCL settings that matter for small all-reduces on one node, and a validator for them.

:func:`validate_setting` says what NCCL does with one ``name=value``: it replays how NCCL parses
the value (``strtoll`` with base 0, case-sensitive ``strcmp``, the two ``NCCL_ALGO``/``NCCL_PROTO``
grammars) with the setting's check from :mod:`fastverify.nccl.settings`. :func:`validate_settings`
checks a whole set of settings against each other (a minimum channel count above a maximum, an
alias overridden …), and :func:`validate_env` runs both. :func:`explain` and :func:`suggest` serve
the command line. What each severity means: :class:`~fastverify.nccl.findings.Severity`.

Facts: NVIDIA/nccl's own source at tags v2.18.3 … v2.30.7 (``git show <tag>:<path>``); each
setting names its source file.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping

from fastverify.errors import UserError
from fastverify.nccl.findings import CHANNELS_64, V, Ctx, Finding, Scope, Setting, Severity, show
from fastverify.nccl.intparse import param_int, strtoll
from fastverify.nccl.settings import ALL_NAMES, CATALOGUE_BY_NAME, CHECKS, FOREIGN_NAMES, OTHER_NAMES
from fastverify.nccl.version import NcclVersion


def get_setting(name: str) -> Setting | None:
    """The catalogue entry for ``name``, or ``None``."""
    return CATALOGUE_BY_NAME.get(name)


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
        return Finding(name, value, Severity.ERROR, f"environment names are case-sensitive: NCCL never reads "
                       f"{show(name)}", f"rename it {name.upper()}")
    guess = suggest(name)
    what = "unknown NCCL setting" if name.startswith("NCCL_") else "not an NCCL setting (NCCL reads NCCL_* names)"
    return Finding(name, value, Severity.ERROR, f"{what} {show(name)}: NCCL ignores it",
                   f"did you mean {guess}?" if guess else "see the NCCL environment variable docs")


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
        return Finding(name, value, Severity.WARNING, f"NCCL {version} does not read {name} (added in {setting.since})",
                       f"upgrade NCCL to >= {setting.since} or remove it")
    verdict = CHECKS[name](value, ctx, setting)
    return Finding(name, value, verdict.severity, verdict.reason.replace("\n", " "), verdict.fix)


def validate_env(env: Mapping[str, str], version: NcclVersion | None = None) -> list[Finding]:
    """Findings for every NCCL_* variable of ``env`` (also mis-cased ``nccl_*`` ones), in name order
    (:func:`validate_setting`), then those of the settings taken together (:func:`validate_settings`:
    an alias overridden, P2P_LEVEL under P2P_DISABLE, a minimum channel count above a maximum …)."""
    names = sorted(k for k in env if isinstance(k, str) and k.upper().startswith("NCCL_"))
    findings = [validate_setting(k, env[k], version) for k in names]
    return findings + validate_settings({k: str(env[k]) for k in names}, version)


def validate_settings(pairs: Mapping[str, str] | Iterable[tuple[str, str]],
                      version: NcclVersion | None = None) -> list[Finding]:
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
    for name, value in (pairs.items() if isinstance(pairs, Mapping) else pairs):
        present[str(name)] = str(value)
    ctx = Ctx.of(version)
    findings: list[Finding] = []
    for old, new in (("NCCL_MIN_NRINGS", "NCCL_MIN_NCHANNELS"), ("NCCL_MAX_NRINGS", "NCCL_MAX_NCHANNELS")):
        if old in present and new in present:
            findings.append(Finding(old, present[old], Severity.WARNING, f"ignored: {new} is also set and wins",
                                    f"remove {old}"))
    if "NCCL_P2P_LEVEL" in present and strtoll(present.get("NCCL_P2P_DISABLE", "")).value == 1:
        findings.append(Finding("NCCL_P2P_LEVEL", present["NCCL_P2P_LEVEL"], Severity.WARNING,
                                "ignored: NCCL_P2P_DISABLE=1 sets the level to LOC", "remove one of the two"))
    if strtoll(present.get("NCCL_P2P_DISABLE", "")).value == 1 and present.get("NCCL_SHM_DISABLE", "").strip() == "1":
        findings.append(Finding("NCCL_SHM_DISABLE", present["NCCL_SHM_DISABLE"], Severity.WARNING,
                                "with P2P and SHM both disabled, GPUs of one node talk through the network (sockets)",
                                "keep SHM enabled"))
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
    mins = [m for m in (_channel_read(present, ("NCCL_MIN_NCHANNELS", "NCCL_MIN_NRINGS"), ctx),
                        _channel_read(present, ("NCCL_MIN_CTAS",), ctx)) if m]
    maxs = [m for m in (_channel_read(present, ("NCCL_MAX_NCHANNELS", "NCCL_MAX_NRINGS"), ctx),
                        _channel_read(present, ("NCCL_MAX_CTAS",), ctx)) if m]
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
                out.append(Finding(lo_name, present[lo_name], Severity.ERROR,
                                   f"{pair} contradict: the minimum ({lo}) is above the maximum ({hi}), and "
                                   f"{ctx.nccl} lowers minCTAs to {hi} (src/init.cc: 'minCTAs is larger than maxCTAs, "
                                   f"set both to {hi}'), so {lo_name} is not honoured",
                                   f"set {lo_name} <= {hi_name}, or drop one of them"))
                continue
            out.append(Finding(hi_name, present[hi_name], Severity.ERROR,
                               f"{pair} contradict: the minimum ({lo}) is above the maximum ({hi}); {ctx.nccl} "
                               f"caps the communicator at {hi} channel(s), then copies them up to {lo} "
                               f"(src/graph/connect.cc, 'max, then min'), so it runs {lo} channels and {hi_name} "
                               f"is not honoured", f"set {lo_name} <= {hi_name}, or drop one of them"))
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
    scope = ("read once per process: set it before the process starts" if s.scope is Scope.PROCESS else
             "re-read at each communicator init")
    lines = [f"{s.name}: {s.meaning}", f"  values:  {s.values}", f"  default: {s.default}", f"  scope:   {scope}",
             f"  since:   NCCL {s.since}"]
    lines += [f"  change:  {c}" for c in s.changes]
    if s.alias_of:
        lines.append(f"  alias of {s.alias_of}")
    lines.append(f"  source:  {s.source}")
    return "\n".join(lines)
