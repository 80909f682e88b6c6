"""The registry is the one source of every backend's limits, and its pcie_ipc dtypes are SGLang's.

* pcie_ipc reaches SGLang only through SGLang's own switch, and SGLang 0.5.23 builds that
  workspace in bf16 and sends it bf16 only (``should_pcie_ipc_ar`` in
  ``sglang/srt/distributed/device_communicators/pcie_ipc_ar.py``): read here from the wheel's
  source with ``ast`` (``FASTVERIFY_SGLANG_WHEEL``), never from fastverify.
* No backend module keeps a limit table of its own beside the registry's, and each backend's
  probe refuses exactly the world sizes, dtypes and GPUs the registry's entry refuses.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from fastverify.backends import ProbeContext, probe
from fastverify.registry import BACKENDS, BackendName, backend_info, sm_text, unreachable_reason

PCIE_IPC_AR = "sglang/srt/distributed/device_communicators/pcie_ipc_ar.py"
LIMIT_NAMES = {"WORLD_SIZES", "DTYPES", "SM_MAJORS", "KERNEL_SM", "SGLANG_SM_MAJORS", "MAX_ROWS"}
GPU_BACKENDS = [b for b in BACKENDS if b.device == "cuda" and b.tunable]
LIBRARY = {BackendName.custom_ar: "sglang"}  # every other GPU backend imports flashinfer
ALL_DTYPES = ("bfloat16", "float16", "float32", "float64")
SMS = [(7, 5), (8, 0), (8, 9), (9, 0), (10, 0), (10, 3), (11, 0), (12, 0), (12, 1)]


# --- SGLang's own pcie_ipc dtype gate --------------------------------------------------------------


def _torch_dtype(node: ast.AST) -> str | None:
    """``"bfloat16"`` for the expression ``torch.bfloat16``, else None."""
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "torch":
        return node.attr
    return None


def _served(fn: ast.FunctionDef) -> set[str]:
    """The dtypes ``should_pcie_ipc_ar`` lets through: the ``inp.dtype is not torch.X`` (or
    ``not in (...)``) test whose branch returns False."""
    found = []
    for node in ast.walk(fn):
        if not (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)):
            continue
        t = node.test
        left = t.left
        if not (isinstance(left, ast.Attribute) and left.attr == "dtype" and getattr(left.value, "id", "") == "inp"):
            continue
        returns_false = any(
            isinstance(s, ast.Return) and isinstance(s.value, ast.Constant) and s.value.value is False
            for s in node.body
        )
        op, right = t.ops[0], t.comparators[0]
        if returns_false and isinstance(op, (ast.IsNot, ast.NotEq)) and _torch_dtype(right):
            found.append({_torch_dtype(right)})
        elif returns_false and isinstance(op, ast.NotIn) and isinstance(right, (ast.Tuple, ast.List, ast.Set)):
            found.append({_torch_dtype(e) for e in right.elts})
    assert len(found) == 1, f"should_pcie_ipc_ar's dtype test not found once ({found})"
    return found[0]


def _workspace_dtypes(tree: ast.Module) -> set[str]:
    """``dtype=torch.X`` of every call that builds the workspace (``self._workspace_cls(...)``)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and "workspace" in ast.unparse(node.func).lower():
            out |= {_torch_dtype(k.value) for k in node.keywords if k.arg == "dtype"}
    return out - {None}


@pytest.fixture(scope="module")
def sglang_pcie_ipc() -> ast.Module:
    whl = os.environ.get("FASTVERIFY_SGLANG_WHEEL")
    if not whl or not Path(whl).is_file():
        pytest.skip("FASTVERIFY_SGLANG_WHEEL is not set to an SGLang 0.5.23 wheel: no source to read its gate from")
    with zipfile.ZipFile(whl) as z:
        return ast.parse(z.read(PCIE_IPC_AR).decode(), filename=PCIE_IPC_AR)


def test_registry_pcie_ipc_dtypes_are_the_ones_sglang_serves(sglang_pcie_ipc):
    fn = next(n for n in ast.walk(sglang_pcie_ipc) if isinstance(n, ast.FunctionDef) and n.name == "should_pcie_ipc_ar")
    served = _served(fn)
    assert served == {"bfloat16"}  # SGLang 0.5.23, read from its source
    assert _workspace_dtypes(sglang_pcie_ipc) == served  # the workspace is built in the one dtype it serves
    info = backend_info(BackendName.pcie_ipc)
    assert set(info.dtypes) == served and len(info.dtypes) == len(served)
    assert "should_pcie_ipc_ar" in info.dtype_gate and "pcie_ipc_ar.py" in info.dtype_gate


def test_the_registry_refuses_pcie_ipc_on_float16_in_one_line():
    info = backend_info(BackendName.pcie_ipc)
    facts = dict(sm=(12, 0), world_size=8, p2p_ok=True, p2p_source="test", nvlink_full=False)
    why = unreachable_reason(info, dtype="float16", **facts)
    assert why == f"pcie_ipc: dtype float16 unsupported (takes bfloat16: {info.dtype_gate})"
    assert "\n" not in why
    assert unreachable_reason(info, dtype="bfloat16", **facts) is None
    assert unreachable_reason(info, **facts) is None  # dtype unknown: not checked
    # A backend whose kernel takes fp16 is not refused for it.
    assert unreachable_reason(backend_info(BackendName.b12x), dtype="float16", **facts) is None
    assert unreachable_reason(backend_info(BackendName.b12x), dtype="float64", **facts) == (
        "b12x: dtype float64 unsupported (takes bfloat16, float16, float32)"
    )


# --- no limit table beside the registry's ----------------------------------------------------------


def _backend_modules() -> list:
    pkg = Path(importlib.import_module("fastverify.backends").__file__).parent
    return [
        importlib.import_module(f"fastverify.backends.{p.stem}")
        for p in sorted(pkg.glob("*.py"))
        if p.stem != "__init__"
    ]


def _reads_registry(value: ast.AST) -> bool:
    return any(isinstance(n, ast.Name) and n.id in {"INFO", "backend_info"} for n in ast.walk(value))


def test_no_backend_module_keeps_its_own_limits():
    """A module-level world-size / dtype / SM / row table must be a view of the registry entry,
    never a literal of its own (the tables that drifted apart: pcie_ipc took fp16, the registry not)."""
    mods = _backend_modules()
    assert {m.__name__ for m in mods} >= {b.module for b in BACKENDS}
    own = []
    for mod in mods:
        for node in ast.parse(inspect.getsource(mod)).body:
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, ast.AnnAssign)
                else []
            )
            for t in targets:
                if isinstance(t, ast.Name) and t.id in LIMIT_NAMES and not _reads_registry(node.value):
                    own.append(f"{mod.__name__}.{t.id} = {ast.unparse(node.value)}")
    assert own == []


def test_the_views_that_remain_equal_the_registry():
    from fastverify.backends import flashinfer_b12x

    info = backend_info(BackendName.b12x)
    assert flashinfer_b12x.MAX_ROWS == info.max_rows == 36
    assert flashinfer_b12x.DTYPES == tuple(getattr(torch, d) for d in info.dtypes)


# --- each probe refuses what the registry refuses ----------------------------------------------------


def _good_sm(info) -> tuple[int, int]:
    return next(
        sm
        for sm in [(9, 0), (10, 0), (12, 0)]
        if info.kernel_runs_on(sm) and (info.sglang_sm_majors is None or sm[0] in info.sglang_sm_majors)
    )


def _ctx(info, **over) -> ProbeContext:
    facts = dict(
        world_size=(info.world_sizes_without_nvlink or info.world_sizes)[0],
        device_type="cuda",
        dtype=getattr(torch, info.dtypes[0]),
        group_backend="nccl",
        sm=_good_sm(info),
        p2p_ok=True,
        p2p_note="ok",
        nvlink_full=True,
        single_node=True,
    )
    return ProbeContext(**{**facts, **over})


@pytest.fixture
def gpu_without_libraries(monkeypatch):
    """torch says CUDA is there; FlashInfer and SGLang do not import, so a probe that got past
    every limit ends at its library check."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for mod in ("flashinfer", "sglang"):
        monkeypatch.setitem(sys.modules, mod, None)


def _past_the_limits(info, cap) -> bool:
    return not cap.ok and cap.reason.startswith(f"{LIBRARY.get(info.name, 'flashinfer')} not importable")


@pytest.mark.parametrize("info", GPU_BACKENDS, ids=lambda b: b.name.value)
def test_probe_world_sizes_are_the_registrys(info, gpu_without_libraries):
    assert _past_the_limits(info, probe(info.name, _ctx(info)))
    for w in range(1, 18):
        cap = probe(info.name, _ctx(info, world_size=w))
        registry = unreachable_reason(info, sm=_good_sm(info), world_size=w, p2p_ok=True, nvlink_full=True)
        if w in info.world_sizes:
            assert _past_the_limits(info, cap) and registry is None, (w, cap)
        else:
            assert cap.reason == f"world size {w} unsupported, needs one of {sorted(info.world_sizes)}; use nccl"
            assert registry is not None and "world size" in registry


@pytest.mark.parametrize("info", GPU_BACKENDS, ids=lambda b: b.name.value)
def test_probe_dtypes_are_the_registrys(info, gpu_without_libraries):
    for name in ALL_DTYPES:
        cap = probe(info.name, _ctx(info, dtype=getattr(torch, name)))
        registry = unreachable_reason(
            info, sm=_good_sm(info), world_size=_ctx(info).world_size, p2p_ok=True, nvlink_full=True, dtype=name
        )
        if name in info.dtypes:
            assert _past_the_limits(info, cap) and registry is None, (name, cap)
        else:
            assert not cap.ok and cap.reason.startswith(
                f"dtype {name} unsupported, needs one of {', '.join(info.dtypes)}"
            ), (name, cap)
            assert registry is not None and f"dtype {name} unsupported" in registry
            if info.dtype_gate:
                assert info.dtype_gate in cap.reason  # the probe names SGLang's gate too


@pytest.mark.parametrize("info", GPU_BACKENDS, ids=lambda b: b.name.value)
def test_probe_gpus_are_the_registrys_kernel_gpus(info, gpu_without_libraries):
    for sm in SMS:
        cap = probe(info.name, _ctx(info, sm=sm))
        if info.kernel_runs_on(sm):
            assert _past_the_limits(info, cap), (sm, cap)
        else:
            assert not cap.ok and cap.reason.startswith(f"GPU is {sm_text(sm)}, needs "), (sm, cap)


def test_the_gpu_sweep_covers_both_answers():
    """The SM list above reaches both sides of every kernel gate, so the loop can fail."""
    for info in GPU_BACKENDS:
        if info.kernel_sm is not None or info.kernel_sm_majors is not None:
            assert {info.kernel_runs_on(sm) for sm in SMS} == {True, False}, info.name


# --- custom_ar on more than 2 PCIe-only GPUs: SGLang refuses it, so fastverify never offers it ---------
# SGLang 0.5.23 custom_all_reduce_utils.py::can_use_custom_all_reduce_with_nvlink: `if world_size > 2
# and not full_nvlink:` logs "not supported on more than two PCIe-only GPUs" and returns None (the
# constructor stays disabled); custom_all_reduce_v2.py::can_use_custom_all_reduce_v2 admits the JIT
# class only when that function returns True. So neither class runs on >2 PCIe GPUs.

CAR_UTILS = "sglang/srt/distributed/device_communicators/custom_all_reduce_utils.py"
CAR_V2 = "sglang/srt/distributed/device_communicators/custom_all_reduce_v2.py"


def _sglang_source(rel: str) -> str:
    """``rel`` from an unpacked SGLang (``FASTVERIFY_SGLANG_SOURCE``: the folder holding ``sglang/``)
    or the 0.5.23 wheel (``FASTVERIFY_SGLANG_WHEEL``)."""
    src = os.environ.get("FASTVERIFY_SGLANG_SOURCE")
    if src and (Path(src) / rel).is_file():
        return (Path(src) / rel).read_text()
    whl = os.environ.get("FASTVERIFY_SGLANG_WHEEL")
    if whl and Path(whl).is_file():
        with zipfile.ZipFile(whl) as z:
            return z.read(rel).decode()
    pytest.skip("neither FASTVERIFY_SGLANG_SOURCE nor FASTVERIFY_SGLANG_WHEEL gives SGLang 0.5.23's source")


def test_sglang_disables_custom_ar_on_more_than_two_pcie_gpus_in_both_classes():
    utils = ast.parse(_sglang_source(CAR_UTILS))
    fn = next(
        n
        for n in ast.walk(utils)
        if isinstance(n, ast.FunctionDef) and n.name == "can_use_custom_all_reduce_with_nvlink"
    )
    gates = [
        n
        for n in ast.walk(fn)
        if isinstance(n, ast.If) and ast.unparse(n.test) == "world_size > 2 and (not full_nvlink)"
    ]
    assert len(gates) == 1
    ret = [s for s in gates[0].body if isinstance(s, ast.Return)]
    assert len(ret) == 1 and ret[0].value is None  # None: "fail", the class stays disabled
    assert "more than two PCIe-only GPUs" in ast.unparse(gates[0])
    v2 = ast.parse(_sglang_source(CAR_V2))
    fn2 = next(n for n in ast.walk(v2) if isinstance(n, ast.FunctionDef) and n.name == "can_use_custom_all_reduce_v2")
    assert "can_use_custom_all_reduce_with_nvlink" in ast.unparse(fn2)
    assert ast.unparse(fn2.body[-1]) == "return full_nvlink is True"


@pytest.mark.parametrize("world", [4, 6, 8])
@pytest.mark.parametrize("nvlink", [False, None])
def test_the_registry_gates_custom_ar_off_on_more_than_two_pcie_gpus(world, nvlink):
    info = backend_info(BackendName.custom_ar)
    why = unreachable_reason(
        info,
        sm=(8, 9),
        world_size=world,
        p2p_ok=True,
        p2p_source="p2p_check",
        sglang_version="0.5.23",
        nvlink_full=nvlink,
    )
    state = "this box has none" if nvlink is False else "this box's NVLink status is unknown"
    assert why == (
        f"custom_ar: world size {world} needs full NVLink between every GPU pair and {state}; {info.nvlink_gate}"
    )
    assert "custom_all_reduce_utils.py" in why and "world_size > 2 and not full_nvlink" in why
    assert unreachable_reason(info, sm=(8, 9), world_size=world, p2p_ok=True, nvlink_full=True) is None
    assert unreachable_reason(info, sm=(8, 9), world_size=2, p2p_ok=True, nvlink_full=nvlink) is None


def test_tune_never_measures_or_recommends_custom_ar_on_four_pcie_gpus(tmp_path):
    from types import SimpleNamespace as NS

    from fastverify.deploy import BoxFingerprint, P2PFacts
    from fastverify.tune.measure import backend_trials, choose_winner

    pcie4 = BoxFingerprint(gpu_name="NVIDIA GeForce RTX 4090", sm=(8, 9), gpu_count=4, tp=4, nvlink_full=False)
    common = dict(
        world_size=4,
        device="cuda",
        dtype="bfloat16",
        hidden=7168,
        sizes=((28672, 123),),
        warmup=1,
        iters=2,
        op="all_reduce_residual_rmsnorm",
    )
    proven = P2PFacts(ok=True, source="p2p_check", pairs=12)
    trials, skipped = backend_trials(
        common, box=pcie4, p2p=proven, fused_ok=True, max_numel=917504, sglang_version="0.5.23"
    )
    assert "custom_ar" not in {t.backend for t in trials}
    assert any(s.startswith("custom_ar: world size 4 needs full NVLink") for s in skipped)
    car, base = NS(spec=NS(backend="custom_ar"), step_us=100.0), NS(spec=NS(backend="nccl"), step_us=900.0)
    won, passed = choose_winner(
        NS(candidates=(car, base), baseline=base), box=pcie4, p2p=proven, world_size=4, sglang_version="0.5.23"
    )
    assert won is base and passed[0].startswith("custom_ar: world size 4 needs full NVLink")


def test_predict_lists_custom_ar_as_not_a_candidate_on_four_pcie_gpus(tmp_path):
    import json
    import subprocess

    from conftest import subprocess_env

    topo = "\t GPU0\tGPU1\tGPU2\tGPU3\n" + "".join(
        f"GPU{i}\t" + "\t".join("X" if i == j else "PHB" for j in range(4)) + "\n" for i in range(4)
    )
    (tmp_path / "t4.txt").write_text(topo)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "fastverify",
            "tune",
            "--predict",
            "--topology",
            "t4.txt",
            "--model",
            "tiny",
            "--tp",
            "4",
            "--sm",
            "89",
            "--json",
        ],
        cwd=tmp_path,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert "custom_ar" not in {c.get("backend") for c in doc["candidates"]}
    assert any(s.startswith("custom_ar: world size 4 needs full NVLink") for s in doc["not_candidates"]), doc
