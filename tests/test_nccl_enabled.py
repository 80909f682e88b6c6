"""fastverify.nccl.model: the one public answer to "which all-reduce algorithms and protocols does
this environment enable for this NCCL version" (issue 11 §6).

The switch of tune/predict.py from its private ``_env_algos_protos`` to this function is safe only
if both give the same answer for every input: ``_reference`` below is that private function as it
stood at commit 99f660f (fastverify/tune/predict.py lines 179-218), kept here as the oracle, and
the live private one is compared too while it still exists.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import REPO_ROOT, subprocess_env
from hypothesis import given, settings, strategies as st

from fastverify.nccl import model as M
from fastverify.nccl.checks import Severity, validate_setting
from fastverify.nccl.model import EnabledAlgos, allreduce_enabled, enabled_algos_protos
from fastverify.nccl.version import NcclVersion

# --- the oracle: tune/predict.py at 99f660f, unchanged but for the names; its per-variable parse
# was moved as it stood into nccl.model.allreduce_enabled (pinned by the known-answer tests below)
_ref_allreduce_enabled = allreduce_enabled


def _reference(env, version, sm, notes):
    algos = frozenset({M.Algo.RING, M.Algo.TREE})
    protos = None
    if "NCCL_ALGO" in env and validate_setting("NCCL_ALGO", env["NCCL_ALGO"], version).severity is not Severity.ERROR:
        on = _ref_allreduce_enabled("NCCL_ALGO", env["NCCL_ALGO"], version)
        if on is not None:
            algos = frozenset(a for a in M.Algo if on.get(a.value))
            if not algos:
                algos = frozenset({M.Algo.RING, M.Algo.TREE})
    elif "NCCL_ALGO" in env:
        notes.append(f"NCCL rejects or ignores NCCL_ALGO={env['NCCL_ALGO']!r}: the baseline is predicted without it")
    if (
        "NCCL_PROTO" in env
        and validate_setting("NCCL_PROTO", env["NCCL_PROTO"], version).severity is not Severity.ERROR
    ):
        on = _ref_allreduce_enabled("NCCL_PROTO", env["NCCL_PROTO"], version)
        if on is not None:
            code = version.code if version else M.DEFAULT_NCCL_VERSION
            default = M.default_protos(M.LinkType.PCI, sm, code)
            protos = frozenset(p for p in M.Proto if on.get(p.value) == 1 or (on.get(p.value) == 2 and p in default))
            protos = protos or None
    elif "NCCL_PROTO" in env:
        notes.append(f"NCCL rejects NCCL_PROTO={env['NCCL_PROTO']!r}: the baseline is predicted without it")
    return algos, protos


_ALGO_VALUES = [
    "Ring",
    "Tree",
    "ring,tree",
    "^Ring",
    "^tree",
    "allreduce:ring",
    "allreduce:^tree",
    "NVLS",
    "PAT",
    "CollNet",
    "allreduce:ring;broadcast:tree",
    "bogus",
    "",
    "Ring,bogus",
    "^Ring,Tree",
    "allgather:ring",
    "allreduce:nvls,ring",
    ";allreduce:ring",
]
_PROTO_VALUES = [
    "LL",
    "LL128",
    "Simple",
    "^LL128",
    "^LL",
    "ll,simple",
    "allreduce:ll",
    "allreduce:^simple",
    "allreduce:ll128;broadcast:simple",
    "bogus",
    "",
    "^LL,LL128,Simple",
    "allgather:ll",
    "LL ,Simple",
]
_VERSIONS = [None, "2.18.3", "2.21.5", "2.23.4", "2.24.3", "2.25.1", "2.27.5", "2.30.7"]
_SMS = [70, 80, 86, 89, 90, 100, 120]


@settings(max_examples=400, deadline=None)
@given(
    algo=st.none() | st.sampled_from(_ALGO_VALUES),
    proto=st.none() | st.sampled_from(_PROTO_VALUES),
    version=st.sampled_from(_VERSIONS),
    sm=st.sampled_from(_SMS),
)
def test_same_answer_as_the_private_function_it_replaces(algo, proto, version, sm):
    env = {k: v for k, v in (("NCCL_ALGO", algo), ("NCCL_PROTO", proto), ("NCCL_P2P_LEVEL", "SYS")) if v is not None}
    nv = NcclVersion.parse(version) if version else None
    notes: list[str] = []
    ref_algos, ref_protos = _reference(env, nv, sm, notes)
    got = enabled_algos_protos(env, nv, sm)
    assert got.algos == ref_algos
    assert got.protos_or_none == ref_protos
    code = nv.code if nv else M.DEFAULT_NCCL_VERSION
    assert got.protos == (ref_protos if ref_protos is not None else M.default_protos(M.LinkType.PCI, sm, code))
    assert got.notes == tuple(notes)
    assert got.algos and got.protos


def test_known_answers():
    v224, v221 = NcclVersion.parse("2.24.3"), NcclVersion.parse("2.21.5")
    # nothing set: Ring+Tree, NCCL's PCI default LL+Simple (LL128 only on NVLink graphs, tuning.cc)
    assert enabled_algos_protos({}, v224, 89) == EnabledAlgos(
        frozenset({M.Algo.RING, M.Algo.TREE}), frozenset({M.Proto.LL, M.Proto.SIMPLE}), (), False
    )
    # the 2.24 per-function grammar: only AllReduce's entry matters
    e = enabled_algos_protos({"NCCL_ALGO": "allreduce:ring", "NCCL_PROTO": "allreduce:ll"}, v224, 89)
    assert (e.algos, e.protos, e.protos_set) == (frozenset({M.Algo.RING}), frozenset({M.Proto.LL}), True)
    # listing LL128 enables it anywhere (tuning.cc pEnable == 1), even on PCIe
    assert enabled_algos_protos({"NCCL_PROTO": "LL128"}, v221, 89).protos == frozenset({M.Proto.LL128})
    # NCCL <= 2.23 ignores an unknown token but keeps the known ones
    assert enabled_algos_protos({"NCCL_ALGO": "Tree,bogus"}, v221, 89).algos == frozenset({M.Algo.TREE})
    # NCCL >= 2.24 fails init on an unknown token: left out, and said so
    e = enabled_algos_protos({"NCCL_ALGO": "bogus"}, v224, 89)
    assert e.algos == frozenset({M.Algo.RING, M.Algo.TREE}) and "NCCL_ALGO='bogus'" in e.notes[0]
    # ^Ring,Tree turns both off; 2.21 then switches Ring and Tree back on
    assert enabled_algos_protos({"NCCL_ALGO": "^Ring,Tree"}, v221, 89).algos == frozenset({M.Algo.RING, M.Algo.TREE})


def test_topo_diagnose_no_longer_imports_tune():
    """The circle of issue 11 §6: topo/diagnose.py imported tune/predict.py's private helper."""
    code = (
        "import sys\n"
        "from fastverify.topo.diagnose import diagnose\n"
        "from fastverify.topo.matrix import parse_nvidia_smi_topo\n"
        "t = parse_nvidia_smi_topo('\\tGPU0\\tGPU1\\nGPU0\\t X \\tPIX\\nGPU1\\tPIX\\t X \\n', source='t')\n"
        "d = diagnose(t, None, {'NCCL_PROTO': 'LL'}, nccl_version='2.27.5')\n"
        "assert d.predictions, d.prediction_note\n"
        "print(sorted(m for m in sys.modules if m.startswith('fastverify.tune')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("name", ["NCCL_ALGO", "NCCL_PROTO"])
def test_allreduce_enabled_names_the_library_values(name):
    from fastverify.nccl.model import allreduce_enabled

    on = allreduce_enabled(
        name, "allreduce:^ring" if name == "NCCL_ALGO" else "allreduce:^ll", NcclVersion.parse("2.27.5")
    )
    if name == "NCCL_ALGO":
        assert on["Ring"] == 0 and on["Tree"] == 1 and on["PAT"] == 1
    else:
        assert on == {"LL": 0, "LL128": 1, "Simple": 1}
    with pytest.raises(ValueError):
        allreduce_enabled("NCCL_P2P_LEVEL", "SYS", None)
