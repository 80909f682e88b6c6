"""The registry drives every stage: every :class:`fastverify.registry.BackendInfo` field is read
outside the registry, and a quantized all-reduce stand-in (int8 over gloo, a tolerance derived from
its scale) is added in at most 3 product files and reaches tune's worker, trace classification,
the patch's path names and doctor's JIT list, on CPU.

The stand-in is test-only: the fixture copies the package, makes the edits a backend author would
make (its registry entry, its module), checks that no other product file differs, and runs the
stages from that copy in a subprocess.
"""

from __future__ import annotations

import ast
import dataclasses
import filecmp
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import REPO_ROOT

from fastverify.registry import BackendInfo

PACKAGE = REPO_ROOT / "fastverify"


def _reads(tree: ast.AST) -> set[str]:
    """Attribute names read and plain names used (imported or called) in ``tree``."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            out.add(node.attr)
        elif isinstance(node, ast.Name):
            out.add(node.id)
        elif isinstance(node, ast.alias):
            out.add(node.name)
    return out


def test_every_backend_info_field_is_read_outside_the_registry():
    """Each field is read by a stage: as an attribute outside ``registry.py``, or inside one of the
    registry's functions that a stage calls (``names`` reads ``tunable``, ``unreachable_reason``
    the gates)."""
    registry = PACKAGE / "registry.py"
    outside: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        if path != registry:
            outside |= _reads(ast.parse(path.read_text(encoding="utf-8")))
    for node in ast.parse(registry.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.FunctionDef) and node.name in outside:
            outside |= {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}
    unread = [f.name for f in dataclasses.fields(BackendInfo) if f.name not in outside]
    assert not unread, f"BackendInfo fields no stage reads: {unread}"


# --- the quantized stand-in -------------------------------------------------------------------

ENUM_ANCHOR = '    gloo = "gloo"  # torch.distributed on a gloo group (CPU; tests and GPU-less sweeps)\n'
ENTRY_ANCHOR = ")\n\n_BY_NAME = "

ENUM_LINE = '    int8_gloo = "int8_gloo"  # test stand-in: int8-quantized all-reduce over gloo\n'
ENTRY = """    BackendInfo(
        BackendName.int8_gloo,
        "fastverify.backends.int8_gloo",
        "Int8GlooBackend",
        Role.all_reduce,
        Reach.patch_dispatch,
        device="cpu",
        title="int8 all-reduce over gloo (test stand-in)",
        # one fp32 scale per rank and call: max|x_r| / 127; each rank's value is off by at most
        # half a step, so the sum by world_size / 254 of the largest input (taken as max|sum|)
        tolerance=lambda dtype, world_size: LOSSLESS_TOLERANCE[dtype] + world_size / 254,
        wire_bytes=1.0,
        kernel_patterns=(KernelPattern(r"int8_quant_all_reduce", "allreduce", "int8_gloo", "test stand-in"),),
        sglang_methods=("int8_ar",),
        sglang_switch="SGLANG_ENABLE_INT8_ALLREDUCE",
        sglang_switch_module="sglang.srt.distributed.device_communicators.int8_ar",
        sglang_switch_label="int8 all-reduce",
        jit_modules=(JitModule("int8_comm", "flashinfer.jit.comm", "gen_int8_comm_module"),),
    ),
"""

MODULE = '''"""Test stand-in: an int8-quantized all-reduce over gloo (one fp32 scale per rank and call)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from fastverify.backends.base import OK, AllReduceBackend, BackendName, Capability, ProbeContext, Tensor, fail


class Int8GlooBackend(AllReduceBackend):
    name = BackendName.int8_gloo

    @classmethod
    def probe(cls, ctx: ProbeContext) -> Capability:
        return OK if ctx.device_type == "cpu" else fail("int8_gloo runs on CPU tensors only")

    def all_reduce(self, x: Tensor) -> Tensor:
        scale = x.float().abs().max().clamp_min(1e-30) / 127
        q = torch.round(x.float() / scale).to(torch.int8)
        world = dist.get_world_size(self.group)
        qs = [torch.empty_like(q) for _ in range(world)]
        scales = [torch.empty_like(scale) for _ in range(world)]
        dist.all_gather(qs, q, group=self.group)
        dist.all_gather(scales, scale, group=self.group)
        return sum(qi.float() * si for qi, si in zip(qs, scales)).to(x.dtype)
'''

STAGES = """
import json, sys
from pathlib import Path
from fastverify.backends import result_tolerance
from fastverify.doctor import jit
from fastverify.events import EventClass
from fastverify.patch.paths import backend_of
from fastverify.patch.sglang_info import SGLangInfo, detect_sglang, format_report
from fastverify.registry import backend_info, names
from fastverify.trace.classify import classify_name
from fastverify.tune.backend_model import wire_size
from fastverify.tune.sweep import run_sweep
from fastverify.tune.trial import TrialSpec
import torch

info = backend_info("int8_gloo")
c = classify_name("void int8_quant_all_reduce<float>(float*, int)")
spec = TrialSpec(backend="int8_gloo", env={}, world_size=2, device="cpu", dtype="float32", hidden=64,
                 sizes=((64, 2), (512, 4)), warmup=1, iters=2)
sg = Path(sys.argv[1]) / "sglang"
(sg / "srt" / "distributed" / "device_communicators").mkdir(parents=True)
(sg / "srt" / "distributed" / "device_communicators" / "int8_ar.py").write_text("")
found = detect_sglang(sg)
[r] = run_sweep([spec], journal_path=Path(sys.argv[1]) / "j.jsonl", timeout_s=60, progress=False)
print(json.dumps({
    "names": [n.value for n in names(role=info.role, device="cpu")],
    "classified": [c.cls.value, c.family],
    "path": backend_of("sglang.int8_ar"),
    "jit": [m[0] for m in jit.MODULES if m[3] == info.name],
    "report": format_report(SGLangInfo(found=True), [], "r"),
    "report_with_switch": format_report(found, [], "r"),
    "switch_found": found.has_switch(info),
    "tolerance": result_tolerance("int8_gloo", torch.float32, 2),
    "wire": wire_size(info, 4096, 2),
    "trial": [r.status.value, r.reason, max(s.max_rel_err for s in r.sizes)],
}))
"""


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("stand_in")
    copy = root / "fastverify"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    reg = copy / "registry.py"
    text = reg.read_text(encoding="utf-8")
    assert text.count(ENUM_ANCHOR) == 1 and text.count(ENTRY_ANCHOR) == 1
    text = text.replace(ENUM_ANCHOR, ENUM_ANCHOR + ENUM_LINE).replace(ENTRY_ANCHOR, ENTRY + ENTRY_ANCHOR)
    reg.write_text(text, encoding="utf-8")
    (copy / "backends" / "int8_gloo.py").write_text(MODULE, encoding="utf-8")
    return root


def _differing(a: Path, b: Path) -> list[str]:
    out = []
    for path in sorted(b.rglob("*.py")):
        rel = path.relative_to(b)
        if "__pycache__" not in rel.parts and (not (a / rel).exists() or not filecmp.cmp(a / rel, path, shallow=False)):
            out.append(str(rel))
    return out


def test_a_quantized_backend_takes_at_most_three_product_files(stand_in):
    changed = _differing(PACKAGE, stand_in / "fastverify")
    assert changed == ["backends/int8_gloo.py", "registry.py"], changed
    assert len(changed) <= 3


def test_the_stand_in_reaches_every_stage(stand_in, tmp_path):
    import json

    env = {**os.environ, "PYTHONPATH": str(stand_in)}
    env.pop("PYTHONSTARTUP", None)
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(STAGES), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "int8_gloo" in got["names"]
    assert got["classified"] == ["allreduce", "int8_gloo"]
    assert got["path"] == "int8_gloo"
    assert got["jit"] == ["int8_comm"]
    assert "int8 all-reduce switch (SGLANG_ENABLE_INT8_ALLREDUCE): absent" in got["report"]
    # SGLang's own module is found by the registry's switch module, with no special case
    assert got["switch_found"] is True
    assert "int8 all-reduce switch (SGLANG_ENABLE_INT8_ALLREDUCE): present" in got["report_with_switch"]
    assert got["wire"] == 2048  # 2048 elements of 2 bytes, 1 byte each on the wire
    # the tune worker checked the result against the derived tolerance, not fp32's lossless 1e-5
    status, reason, err = got["trial"]
    assert status == "ok", reason
    assert 1e-5 < err <= got["tolerance"]


def _code_words(tree: ast.AST) -> set[str]:
    """Every identifier and non-docstring string constant of ``tree``: names, attributes,
    arguments, keywords, definitions."""
    docs = {
        id(n.body[0].value)
        for n in ast.walk(tree)
        if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        and n.body
        and isinstance(n.body[0], ast.Expr)
        and isinstance(n.body[0].value, ast.Constant)
    }
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            out.add(node.id)
        elif isinstance(node, ast.Attribute):
            out.add(node.attr)
        elif isinstance(node, (ast.arg, ast.keyword)) and node.arg:
            out.add(node.arg)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            out.add(node.value)
    return out


def test_sglang_own_switches_are_found_through_the_registry_only():
    """Which of SGLang's own all-reduce switches an install has is read from the registry's
    ``sglang_switch_module`` names: the code of the SGLang detector and of the in-rank install
    names no backend that has one (no ``has_pcie_ipc``-style field or argument)."""
    from fastverify.registry import BACKENDS

    switched = [b.name.value for b in BACKENDS if b.sglang_switch_module]
    assert switched  # pcie_ipc in SGLang 0.5.23
    for rel in ("patch/sglang_info.py", "patch/install.py"):
        words = _code_words(ast.parse((PACKAGE / rel).read_text(encoding="utf-8")))
        hits = sorted(w for w in words for name in switched if name in w)
        assert not hits, f"{rel} names a switched backend itself: {hits}"
