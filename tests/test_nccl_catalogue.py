"""fastverify.nccl.checks: the settings catalogue and the validator.

Every expected severity below is what NCCL does with the value, read off NCCL's source (NVIDIA/nccl
tags v2.21.5, v2.23.4, v2.24.3, v2.27.5, v2.30.7; file named per block) or
shared/research/nccl.md §1 — never computed by the code under test.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from fastverify.errors import UserError
from fastverify.nccl.checks import (
    CATALOGUE,
    CATALOGUE_BY_NAME,
    Finding,
    Scope,
    Setting,
    Severity,
    explain,
    suggest,
    validate_env,
    validate_setting,
)
from fastverify.nccl.version import NcclVersion

OK, WARN, ERR = Severity.OK, Severity.WARNING, Severity.ERROR
v221, v223, v224, v227 = (NcclVersion.parse(t) for t in ("2.21.5", "2.23.4", "2.24.3", "2.27.5"))
ALL = (v221, v223, v224, v227, None)
OLD, NEW = (v221, v223), (v224, v227, None)  # NCCL_ALGO/PROTO grammar before / since 2.24

# The settings issue 3 and the brief ask for.
REQUIRED = """NCCL_ALGO NCCL_PROTO NCCL_MIN_NCHANNELS NCCL_MAX_NCHANNELS NCCL_MIN_NRINGS NCCL_MAX_NRINGS
NCCL_MIN_CTAS NCCL_MAX_CTAS NCCL_NTHREADS NCCL_LL128_NTHREADS NCCL_BUFFSIZE NCCL_LL_BUFFSIZE NCCL_LL128_BUFFSIZE
NCCL_P2P_LEVEL NCCL_P2P_DISABLE NCCL_SHM_DISABLE NCCL_P2P_USE_CUDA_MEMCPY NCCL_CUMEM_ENABLE NCCL_NVLS_ENABLE
NCCL_GRAPH_REGISTER NCCL_LAUNCH_MODE NCCL_TUNER_PLUGIN NCCL_TUNER_CONFIG_FILE NCCL_CTA_POLICY
NCCL_IGNORE_CPU_AFFINITY NCCL_NET_DISABLE_INTRA NCCL_IGNORE_DISABLED_P2P NCCL_GRAPH_FILE NCCL_TOPO_FILE NCCL_DEBUG
NCCL_DEBUG_SUBSYS NCCL_NO_CACHE NCCL_THREAD_THRESHOLDS""".split()

# Scope per research notes §1.1 (P = NCCL_PARAM cache or static, C = re-read at communicator init).
COMMUNICATOR_SCOPED = {
    "NCCL_ALGO",
    "NCCL_PROTO",
    "NCCL_THREAD_THRESHOLDS",
    "NCCL_GRAPH_FILE",
    "NCCL_TOPO_FILE",
    "NCCL_TUNER_CONFIG_FILE",
    "NCCL_LAUNCH_MODE",
}


def test_catalogue_has_every_required_setting_once():
    names = [s.name for s in CATALOGUE]
    assert len(names) == len(set(names))
    assert set(REQUIRED) <= set(names)


@pytest.mark.parametrize("s", CATALOGUE, ids=lambda s: s.name)
def test_every_entry_has_source_scope_version_and_meaning(s: Setting):
    assert s.name.startswith("NCCL_") and s.name.upper() == s.name
    assert isinstance(s.scope, Scope)
    assert s.scope is (Scope.COMMUNICATOR if s.name in COMMUNICATOR_SCOPED else Scope.PROCESS)
    assert any(root in s.source for root in ("src/", "plugins/")), s.source
    assert isinstance(s.since, NcclVersion) and s.since.major == 2
    assert s.meaning and s.values and s.default and "\n" not in s.meaning
    if s.alias_of:
        assert CATALOGUE_BY_NAME.get(s.alias_of) is not None


def test_versions_where_settings_appeared():
    # First NCCL tag whose source reads the variable (git grep over tags), or env.rst "(since …)".
    assert str(CATALOGUE_BY_NAME.get("NCCL_MIN_CTAS").since) == "2.17.0"
    assert str(CATALOGUE_BY_NAME.get("NCCL_CUMEM_ENABLE").since) == "2.18.0"
    assert str(CATALOGUE_BY_NAME.get("NCCL_TUNER_PLUGIN").since) == "2.19.0"
    assert str(CATALOGUE_BY_NAME.get("NCCL_CTA_POLICY").since) == "2.27.0"  # NCCL_PARAM CtaPolicy in v2.27.3
    assert str(CATALOGUE_BY_NAME.get("NCCL_NO_CACHE").since) == "2.29.7"


def _rows(name, value, versions, severity, words):
    return [pytest.param(name, value, v, severity, words, id=f"{name}={value!r}@{v}") for v in versions]


CASES = [
    # --- NCCL_P2P_LEVEL: src/graph/paths.cc ncclGetLevel: strcmp against topoPathTypeStr up to SYS,
    #     then legacy ints via levelsOldToNew = {LOC, PIX, PXB, PHB, SYS, SYS}, clamped to index 5.
    *_rows("NCCL_P2P_LEVEL", "sys", ALL, ERR, ["ignored", "use SYS"]),
    *_rows("NCCL_P2P_LEVEL", "Phb", ALL, ERR, ["ignored", "use PHB"]),
    *_rows("NCCL_P2P_LEVEL", "SYS", ALL, OK, ["SYS"]),
    *_rows("NCCL_P2P_LEVEL", "PHB", ALL, OK, ["PHB"]),
    *_rows("NCCL_P2P_LEVEL", "PXN", ALL, OK, ["PXN"]),  # PXN accepted since 2.12
    *_rows("NCCL_P2P_LEVEL", "NODE", ALL, ERR, ["not a P2P level"]),  # nvidia-smi's name, not NCCL's
    *_rows("NCCL_P2P_LEVEL", "NET", ALL, ERR, ["not a P2P level"]),  # names past SYS are not levels
    *_rows("NCCL_P2P_LEVEL", "SYS ", ALL, ERR, ["use SYS"]),
    *_rows("NCCL_P2P_LEVEL", "0", ALL, OK, ["LOC"]),
    *_rows("NCCL_P2P_LEVEL", "1", ALL, OK, ["PIX"]),
    *_rows("NCCL_P2P_LEVEL", "2", ALL, OK, ["PXB"]),
    *_rows("NCCL_P2P_LEVEL", "3", ALL, OK, ["PHB"]),
    *_rows("NCCL_P2P_LEVEL", "4", ALL, OK, ["SYS"]),
    *_rows("NCCL_P2P_LEVEL", "5", ALL, OK, ["SYS"]),
    *_rows("NCCL_P2P_LEVEL", "7", ALL, ERR, ["SYS"]),
    *_rows("NCCL_P2P_LEVEL", "C2C", (v221, v223, v224), ERR, ["2.26"]),  # C2C in topoPathTypeStr since v2.26
    *_rows("NCCL_P2P_LEVEL", "C2C", (v227, None), OK, ["C2C"]),
    *_rows("NCCL_P2P_LEVEL", "P2C", (v221, v224), ERR, ["2.27"]),  # P2C since v2.27
    *_rows("NCCL_P2P_LEVEL", "P2C", (v227, None), OK, ["P2C"]),
    *_rows("NCCL_P2P_LEVEL", "", ALL, WARN, ["PXB"]),
    # --- NCCL_P2P_DISABLE: strtol(str, NULL, 0) == 1 disables, anything else is ignored.
    *_rows("NCCL_P2P_DISABLE", "1", ALL, OK, ["disabled"]),
    *_rows("NCCL_P2P_DISABLE", "0", ALL, OK, ["enabled"]),
    *_rows("NCCL_P2P_DISABLE", "true", ALL, ERR, ["only 1"]),
    *_rows("NCCL_P2P_DISABLE", "yes", ALL, ERR, ["only 1"]),
    *_rows("NCCL_P2P_DISABLE", "2", ALL, ERR, ["only 1"]),
    *_rows("NCCL_P2P_DISABLE", "0x1", ALL, WARN, ["1"]),
    # --- NCCL_ALGO: src/graph/tuning.cc parseList. <= 2.23: unknown tokens ignored; >= 2.24: fail.
    *_rows("NCCL_ALGO", "Ring", ALL, OK, ["Ring"]),
    *_rows("NCCL_ALGO", "ring,tree", ALL, OK, ["Ring", "Tree"]),  # strcasecmp
    *_rows("NCCL_ALGO", "Ring,Foo", OLD, WARN, ["ignores", "Foo"]),
    *_rows("NCCL_ALGO", "Ring,Foo", NEW, ERR, ["Foo", "fails"]),
    *_rows("NCCL_ALGO", "Ring, Tree", OLD, WARN, ["spaces"]),  # strtok on ',' only: " Tree" is unknown
    *_rows("NCCL_ALGO", "Ring, Tree", NEW, ERR, ["spaces", "fails"]),
    *_rows("NCCL_ALGO", "^Ring", ALL, OK, ["Tree"]),
    *_rows("NCCL_ALGO", "allreduce:ring", OLD, ERR, ["2.24"]),  # the whole token is unknown to <= 2.23
    *_rows("NCCL_ALGO", "allreduce:ring", NEW, OK, ["Ring"]),
    *_rows("NCCL_ALGO", "ring;allreduce:tree,ring", NEW, OK, ["Ring", "Tree"]),
    *_rows("NCCL_ALGO", "allreduce:^tree", NEW, OK, ["Ring"]),
    *_rows("NCCL_ALGO", "ring;tree", NEW, ERR, ["prefix"]),  # "All entries except the first must have a prefix"
    *_rows("NCCL_ALGO", ";ring", NEW, ERR, ["prefix"]),
    *_rows("NCCL_ALGO", "allreduc:ring", NEW, ERR, ["function", "fails"]),  # "Unrecognized prefix token"
    *_rows("NCCL_ALGO", "PAT", (v221,), ERR, ["2.23"]),  # PAT added to ncclAlgoStr in v2.23
    *_rows("NCCL_ALGO", "PAT", (v223,), OK, ["Ring", "Tree"]),  # <= 2.23 falls back to Ring and Tree
    *_rows("NCCL_ALGO", "PAT", NEW, WARN, ["Ring or Tree", "fails"]),
    *_rows("NCCL_ALGO", "NVLS", NEW, WARN, ["NVSwitch"]),
    *_rows("NCCL_ALGO", "CollNet", NEW, ERR, ["2.14"]),  # renamed CollNetDirect/CollNetChain in v2.14
    *_rows("NCCL_ALGO", "", NEW, WARN, ["empty"]),
    *_rows("NCCL_ALGO", "", OLD, WARN, ["Ring and Tree"]),
    # --- NCCL_PROTO: same parser; LL128 = 2 (auto) unless the list sets it (tuning.cc pEnable == 2).
    *_rows("NCCL_PROTO", "LL,Simple", ALL, OK, ["LL", "Simple"]),
    *_rows("NCCL_PROTO", "^LL128", ALL, OK, ["LL", "Simple"]),
    *_rows("NCCL_PROTO", "LL128", ALL, WARN, ["LL128", "corrupt"]),
    *_rows("NCCL_PROTO", "LL,LL128,Simple", ALL, WARN, ["LL128", "corrupt"]),
    *_rows("NCCL_PROTO", "^LL", ALL, WARN, ["^", "LL128"]),  # a ^ list sets every other protocol to 1
    *_rows("NCCL_PROTO", "LL,Foo", OLD, WARN, ["Foo"]),
    *_rows("NCCL_PROTO", "LL,Foo", NEW, ERR, ["Foo", "fails"]),
    *_rows("NCCL_PROTO", "Fast", OLD, ERR, ["no algorithm/protocol available"]),  # all disabled
    *_rows("NCCL_PROTO", "^LL,LL128,Simple", ALL, ERR, ["no protocol", "AllReduce"]),
    *_rows("NCCL_PROTO", "allreduce:LL", OLD, ERR, ["2.24"]),
    *_rows("NCCL_PROTO", "allreduce:LL", NEW, OK, ["LL"]),
    *_rows("NCCL_PROTO", "simple;allreduce:ll,simple", NEW, OK, ["LL", "Simple"]),
    *_rows("NCCL_PROTO", "", OLD, ERR, ["no protocol"]),  # parseList("") disables everything in <= 2.23
    # --- NCCL_NTHREADS / NCCL_LL128_NTHREADS: tuning.cc getNthreads (multiple of 32, [64, 512] / [160, 640]).
    *_rows("NCCL_NTHREADS", "256", ALL, OK, ["256"]),
    *_rows("NCCL_NTHREADS", "96", ALL, OK, ["96"]),
    *_rows("NCCL_NTHREADS", "100", ALL, ERR, ["multiple of 32", "512"]),
    *_rows("NCCL_NTHREADS", "1024", ALL, ERR, ["512"]),
    *_rows("NCCL_NTHREADS", "32", ALL, ERR, ["64"]),
    *_rows("NCCL_NTHREADS", "0", ALL, ERR, ["default"]),
    *_rows("NCCL_NTHREADS", "abc", ALL, ERR, ["not an integer"]),
    *_rows("NCCL_NTHREADS", "256k", ALL, ERR, ["256"]),
    *_rows("NCCL_LL128_NTHREADS", "640", ALL, OK, ["640"]),
    *_rows("NCCL_LL128_NTHREADS", "128", ALL, ERR, ["160"]),
    *_rows("NCCL_LL128_NTHREADS", "704", ALL, ERR, ["640"]),
    *_rows("NCCL_LL128_NTHREADS", "650", ALL, ERR, ["multiple of 32"]),
    # --- channels: connect.cc (min -> [0, MAXCHANNELS], max -> [1, MAXCHANNELS]); MAXCHANNELS 32 -> 64 in 2.25.
    *_rows("NCCL_MAX_NCHANNELS", "16", ALL, OK, ["16"]),
    *_rows("NCCL_MAX_NCHANNELS", "48", (v221, v223, v224), ERR, ["32"]),
    *_rows("NCCL_MAX_NCHANNELS", "48", (v227, None), OK, ["48"]),
    *_rows("NCCL_MAX_NCHANNELS", "65", (v227, None), ERR, ["64"]),
    *_rows("NCCL_MAX_NCHANNELS", "0", ALL, ERR, ["1"]),
    *_rows("NCCL_MIN_NCHANNELS", "0", ALL, OK, ["0"]),
    *_rows("NCCL_MIN_NCHANNELS", "-1", ALL, ERR, ["0"]),
    *_rows("NCCL_MIN_NCHANNELS", "40", (v221, v224), ERR, ["32"]),
    *_rows("NCCL_MIN_NCHANNELS", "four", ALL, ERR, ["not an integer"]),
    *_rows("NCCL_MAX_NRINGS", "8", ALL, OK, ["8"]),
    *_rows("NCCL_MIN_NRINGS", "99", ALL, ERR, ["caps"]),
    # --- CTAs: init.cc envConfigOverride (<= 0 ignored, capped at MAXCHANNELS).
    *_rows("NCCL_MIN_CTAS", "8", ALL, OK, ["8"]),
    *_rows("NCCL_MIN_CTAS", "0", ALL, ERR, ["ignores"]),
    *_rows("NCCL_MAX_CTAS", "100", (v221,), ERR, ["32"]),
    *_rows("NCCL_MAX_CTAS", "100", (v227,), ERR, ["64"]),
    # --- buffer sizes: init.cc computeBuffSizes (used as is unless -2); strtoll base 0 in param.cc.
    *_rows("NCCL_BUFFSIZE", "4194304", ALL, OK, ["4194304"]),
    *_rows("NCCL_BUFFSIZE", "0x400000", ALL, OK, ["4194304"]),
    *_rows("NCCL_BUFFSIZE", "4MB", ALL, ERR, ["leading 4"]),
    *_rows("NCCL_BUFFSIZE", "1e6", ALL, ERR, ["leading 1"]),
    *_rows("NCCL_BUFFSIZE", "0", ALL, ERR, ["positive"]),
    *_rows("NCCL_BUFFSIZE", "-1", ALL, ERR, ["positive"]),
    *_rows("NCCL_BUFFSIZE", "3000000", ALL, WARN, ["power of 2"]),
    *_rows("NCCL_BUFFSIZE", "020000000", ALL, WARN, ["octal", "4194304"]),
    # --- the smallest buffer NCCL can run: the chunk (one step = size/8, LL half of it, LL128 15/16) must
    # hold one grain since 2.22 (512 / 16 / 1920 B, ncclProtoGrainSize) or NCCL divides by 0 (enqueue.cc).
    *_rows("NCCL_BUFFSIZE", "1", ALL, ERR, ["0 B", "SIGFPE", "calcCollChunking"]),
    *_rows("NCCL_BUFFSIZE", "010", (v223, v224, v227, None), ERR, ["octal", "8", "grain", "SIGFPE"]),
    *_rows("NCCL_BUFFSIZE", "010", (v221,), WARN, ["octal", "grain", "2.22"]),
    *_rows("NCCL_BUFFSIZE", "2048", (v223, v224, v227, None), ERR, ["256 B", "512-B grain", "4096"]),
    *_rows("NCCL_BUFFSIZE", "4096", ALL, OK, ["4096"]),
    *_rows("NCCL_LL_BUFFSIZE", "255", (v223, v227, None), ERR, ["15 B", "16-B grain", "256"]),
    *_rows("NCCL_LL_BUFFSIZE", "256", ALL, OK, ["256"]),
    *_rows("NCCL_LL128_BUFFSIZE", "16383", (v223, v227, None), ERR, ["1905 B", "1920-B grain", "16384"]),
    *_rows("NCCL_LL128_BUFFSIZE", "127", (v221,), ERR, ["0 B", "SIGFPE"]),
    *_rows("NCCL_LL128_BUFFSIZE", "16384", ALL, OK, ["16384"]),
    *_rows("NCCL_BUFFSIZE", "", ALL, WARN, ["empty"]),
    *_rows("NCCL_BUFFSIZE", "99999999999999999999", ALL, ERR, ["range"]),
    *_rows("NCCL_LL_BUFFSIZE", "524288", ALL, OK, ["524288"]),
    *_rows("NCCL_LL128_BUFFSIZE", "4915200", ALL, OK, ["4915200"]),  # the default itself, not a power of 2
    # --- flags: SHM_DISABLE and NET_DISABLE_INTRA test == 1; the others any non-zero.
    *_rows("NCCL_SHM_DISABLE", "1", ALL, OK, ["on"]),
    *_rows("NCCL_SHM_DISABLE", "2", ALL, ERR, ["== 1"]),
    *_rows("NCCL_SHM_DISABLE", "true", ALL, ERR, ["not an integer"]),
    *_rows("NCCL_NET_DISABLE_INTRA", "1", ALL, OK, ["on"]),
    *_rows("NCCL_P2P_USE_CUDA_MEMCPY", "1", ALL, OK, ["on"]),
    *_rows("NCCL_P2P_USE_CUDA_MEMCPY", "2", ALL, WARN, ["as 1"]),
    *_rows("NCCL_GRAPH_REGISTER", "0", ALL, OK, ["off"]),
    *_rows("NCCL_IGNORE_CPU_AFFINITY", "1", ALL, OK, ["on"]),
    *_rows("NCCL_IGNORE_DISABLED_P2P", "2", ALL, OK, ["NVML"]),
    *_rows("NCCL_IGNORE_DISABLED_P2P", "3", ALL, WARN, ["as 1"]),
    *_rows("NCCL_CUMEM_ENABLE", "-2", ALL, OK, ["auto"]),
    *_rows("NCCL_CUMEM_ENABLE", "0", ALL, OK, ["off"]),
    *_rows("NCCL_NVLS_ENABLE", "2", ALL, OK, ["NVSwitch"]),
    *_rows("NCCL_NVLS_ENABLE", "5", ALL, WARN, ["as 1"]),
    # --- choices: strcasecmp "GROUP" (init.cc), NCCL_DEBUG levels (debug.cc).
    *_rows("NCCL_LAUNCH_MODE", "GROUP", ALL, OK, ["deprecated"]),
    *_rows("NCCL_LAUNCH_MODE", "parallel", ALL, OK, ["PARALLEL"]),
    *_rows("NCCL_LAUNCH_MODE", "SERIAL", ALL, ERR, ["PARALLEL"]),
    *_rows("NCCL_DEBUG", "INFO", ALL, OK, ["INFO"]),
    *_rows("NCCL_DEBUG", "info", ALL, OK, ["INFO"]),
    *_rows("NCCL_DEBUG", "DEBUG", ALL, ERR, ["nothing"]),
    *_rows("NCCL_DEBUG_SUBSYS", "INIT,GRAPH,TUNING", ALL, OK, ["GRAPH"]),
    *_rows("NCCL_DEBUG_SUBSYS", "ALL", ALL, OK, ["ALL"]),
    *_rows("NCCL_DEBUG_SUBSYS", "^PROXY", ALL, OK, ["PROXY"]),
    *_rows("NCCL_DEBUG_SUBSYS", "GRAPH,TUNING", ALL, WARN, ["INIT"]),  # replaces INIT,BOOTSTRAP,ENV
    *_rows("NCCL_DEBUG_SUBSYS", "INIT,FOO", ALL, WARN, ["FOO"]),
    *_rows("NCCL_DEBUG_SUBSYS", "FOO", ALL, ERR, ["no INFO line"]),
    # --- NCCL_CTA_POLICY: NCCL_PARAM 0..1 in 2.27, 0..2 in 2.28, names with | since 2.29 (init.cc).
    *_rows("NCCL_CTA_POLICY", "1", (v221, v223, v224), WARN, ["2.27"]),
    *_rows("NCCL_CTA_POLICY", "1", (v227,), OK, ["1"]),
    *_rows("NCCL_CTA_POLICY", "2", (v227,), ERR, ["0..1"]),
    *_rows("NCCL_CTA_POLICY", "EFFICIENCY", (v227,), ERR, ["2.29"]),
    *_rows("NCCL_CTA_POLICY", "efficiency|zero", (None,), OK, ["EFFICIENCY|ZERO"]),
    *_rows("NCCL_CTA_POLICY", "0", (None,), OK, ["DEFAULT"]),
    *_rows("NCCL_CTA_POLICY", "FAST", (None,), ERR, ["FAST"]),
    # --- plugins and files.
    *_rows("NCCL_TUNER_PLUGIN", "none", ALL, OK, ["none"]),
    *_rows("NCCL_TUNER_PLUGIN", "/opt/libnccl-tuner-example.so", ALL, OK, ["plugin"]),
    *_rows("NCCL_TUNER_CONFIG_FILE", "nccl_tuner.conf", (v227, None), OK, ["config"]),
    *_rows("NCCL_GRAPH_FILE", "/tmp/graph.xml", ALL, OK, ["graph"]),
    *_rows("NCCL_TOPO_FILE", "", ALL, WARN, ["empty"]),
    # --- NCCL_NO_CACHE (2.29.7+): exact NCCL_ names or ALL; only NCCL_PARAM caches are affected.
    *_rows("NCCL_NO_CACHE", "NCCL_NTHREADS", (v227,), WARN, ["2.29.7"]),
    *_rows("NCCL_NO_CACHE", "NCCL_NTHREADS,NCCL_BUFFSIZE", (None,), OK, ["NCCL_NTHREADS"]),
    *_rows("NCCL_NO_CACHE", "ALL", (None,), OK, ["ALL"]),
    *_rows("NCCL_NO_CACHE", "all", (None,), WARN, ["'all'"]),
    *_rows("NCCL_NO_CACHE", "NCCL_P2P_LEVEL", (None,), WARN, ["NCCL_P2P_LEVEL", "no effect"]),
    # --- NCCL_THREAD_THRESHOLDS: sscanf("%ld %ld %ld %ld %ld %ld") in tuning.cc.
    *_rows("NCCL_THREAD_THRESHOLDS", "8 8 64 8 8 64", ALL, OK, ["8, 8, 64"]),
    *_rows("NCCL_THREAD_THRESHOLDS", "8,8", ALL, WARN, ["stops"]),
    *_rows("NCCL_THREAD_THRESHOLDS", "x", ALL, ERR, ["no number"]),
]


@pytest.mark.parametrize("name,value,version,severity,words", CASES)
def test_validate_setting(name, value, version, severity, words):
    f = validate_setting(name, value, version)
    assert isinstance(f, Finding) and f.name == name and f.value == value
    text = f.reason + " | " + (f.fix or "")
    assert f.severity is severity, text
    for word in words:
        assert word in text, (word, text)
    assert "\n" not in f.reason and "\n" not in (f.fix or "")
    if severity is not Severity.OK:
        assert f.fix, "a warning or an error says what to do"


@pytest.mark.parametrize(
    "name,value", [("NCCL_ALGO", "Ring,Foo"), ("NCCL_P2P_LEVEL", "NODE"), ("NCCL_MAX_NCHANNELS", "65")]
)
def test_unknown_version_is_said_when_it_matters(name, value):
    assert "version unknown" in validate_setting(name, value, None).reason
    assert "version unknown" not in validate_setting(name, value, v227).reason


def test_setting_newer_than_the_version():
    f = validate_setting("NCCL_NO_CACHE", "ALL", v224)
    assert f.severity is WARN and "2.24.3" in f.reason and "2.29.7" in f.reason


@pytest.mark.parametrize(
    "typo,meant",
    [
        ("NCCL_PROTOCOL", "NCCL_PROTO"),
        ("NCCL_ALGORITHM", "NCCL_ALGO"),
        ("NCCL_P2P_LEVL", "NCCL_P2P_LEVEL"),
        ("NCCL_NTHREAD", "NCCL_NTHREADS"),
        ("NCCL_MAX_CHANNELS", "NCCL_MAX_NCHANNELS"),
        ("NCCL_BUFFER_SIZE", "NCCL_BUFFSIZE"),
        ("NCCL_SHM_DISABLED", "NCCL_SHM_DISABLE"),
        ("NCCL_CUMEM", "NCCL_CUMEM_ENABLE"),
        ("NCCL_IB_DISABLED", "NCCL_IB_DISABLE"),  # outside the catalogue but a real NCCL variable
    ],
)
def test_unknown_names_get_a_suggestion(typo, meant):
    f = validate_setting(typo, "1", v227)
    assert f.severity is ERR and "unknown" in f.reason and typo in f.reason
    assert f.fix == f"did you mean {meant}?"
    assert suggest(typo) == meant


def test_unknown_name_without_a_close_match():
    f = validate_setting("NCCL_FOO", "1", None)
    assert f.severity is ERR and f.fix and "did you mean" not in f.fix


@pytest.mark.parametrize(
    "name,severity,words",
    [
        ("nccl_p2p_level", ERR, ["case-sensitive", "NCCL_P2P_LEVEL"]),
        ("NCCL_SOCKET_IFNAME", OK, ["outside"]),  # read by NCCL (src/misc/socket.cc), not catalogued
        ("NCCL_LIBRARY", OK, ["fastverify"]),
        ("NCCL_ASYNC_ERROR_HANDLING", OK, ["PyTorch"]),
        ("CUDA_VISIBLE_DEVICES", ERR, ["not an NCCL setting"]),
    ],
)
def test_names_outside_the_catalogue(name, severity, words):
    f = validate_setting(name, "x", None)
    assert f.severity is severity
    text = f.reason + " | " + (f.fix or "")
    assert all(w in text for w in words), text


def test_validate_env_reads_only_nccl_names_and_cross_checks():
    env = {
        "PATH": "/usr/bin",
        "CUDA_VISIBLE_DEVICES": "0,1",
        "TORCH_NCCL_BLOCKING_WAIT": "1",
        "NCCL_P2P_LEVEL": "sys",
        "NCCL_P2P_DISABLE": "1",
        "NCCL_SHM_DISABLE": "1",
        "NCCL_MAX_NRINGS": "4",
        "NCCL_MAX_NCHANNELS": "8",
        "NCCL_PROTOCOL": "LL",
        "nccl_algo": "ring",
    }
    findings = validate_env(env, v227)
    names = [f.name for f in findings]
    assert "PATH" not in names and "CUDA_VISIBLE_DEVICES" not in names and "TORCH_NCCL_BLOCKING_WAIT" not in names
    by = {}
    for f in findings:
        by.setdefault(f.name, []).append(f)
    assert by["NCCL_P2P_LEVEL"][0].severity is ERR  # "sys" ignored
    assert any("NCCL_P2P_DISABLE=1" in f.reason for f in by["NCCL_P2P_LEVEL"])  # and overridden anyway
    assert any("NCCL_MAX_NCHANNELS" in f.reason and f.severity is WARN for f in by["NCCL_MAX_NRINGS"])
    assert any("network" in f.reason for f in by["NCCL_SHM_DISABLE"])
    assert by["NCCL_PROTOCOL"][0].fix == "did you mean NCCL_PROTO?"
    assert by["nccl_algo"][0].severity is ERR


def test_validate_env_clean_environment():
    findings = validate_env({"NCCL_P2P_LEVEL": "SYS", "NCCL_PROTO": "LL,Simple", "NCCL_ALGO": "Ring"}, v227)
    assert [f.severity for f in findings] == [OK, OK, OK]
    assert validate_env({}, None) == []


def test_explain():
    text = explain("NCCL_P2P_LEVEL")
    assert text.startswith("NCCL_P2P_LEVEL:")
    assert "once per process" in text and "src/graph/paths.cc" in text and "PXB" in text
    assert "re-read at each communicator init" in explain("NCCL_ALGO")
    assert "2.24" in explain("NCCL_PROTO")
    with pytest.raises(UserError, match="NCCL_PROTO"):
        explain("NCCL_PROTOCOL")


# --- never raise ------------------------------------------------------------------------------

VERSIONS = st.sampled_from(ALL)
NAMES = st.one_of(st.text(), st.sampled_from([s.name for s in CATALOGUE]), st.text().map(lambda t: "NCCL_" + t))
LIST_VALUES = st.text(alphabet="RingTreLL128SimpleAlreduceBoastPATNVLS^,;: \t", max_size=40)
NUMBER_VALUES = st.text(alphabet="0123456789xX+- abcdef.eMk", max_size=30)


def _well_formed(f: Finding) -> None:
    assert isinstance(f, Finding) and isinstance(f.severity, Severity)
    assert isinstance(f.reason, str) and f.reason and "\n" not in f.reason
    assert f.fix is None or (isinstance(f.fix, str) and "\n" not in f.fix)


@settings(max_examples=400, deadline=None)
@given(name=NAMES, value=st.one_of(st.text(), LIST_VALUES, NUMBER_VALUES), version=VERSIONS)
def test_validate_setting_never_raises(name, value, version):
    _well_formed(validate_setting(name, value, version))


@settings(max_examples=300, deadline=None)
@given(
    name=st.sampled_from([s.name for s in CATALOGUE]),
    value=st.one_of(st.text(), LIST_VALUES, NUMBER_VALUES),
    version=VERSIONS,
)
def test_every_catalogued_setting_survives_any_value(name, value, version):
    _well_formed(validate_setting(name, value, version))


@settings(max_examples=200, deadline=None)
@given(env=st.dictionaries(NAMES, st.one_of(st.text(), LIST_VALUES, NUMBER_VALUES), max_size=8), version=VERSIONS)
def test_validate_env_never_raises(env, version):
    findings = validate_env(env, version)
    assert isinstance(findings, list)
    for f in findings:
        _well_formed(f)
        assert f.name.upper().startswith("NCCL_")
