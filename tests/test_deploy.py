"""The deployment record's writing side and the facts it carries (issue 9, What-to-build §2, item 7):

* tune writes the env file and the record beside it, both validated first, never over an input
  (nor over an input named like the ``.bak`` either keeps);
* the env file holds NCCL settings only; the SGLang switch launch sets comes from the registry, and
  the IPC workspace bound from ``max_batch × draft tokens × hidden`` — checked against SGLang
  0.5.23's OWN sizing code (``PcieIpcCommunicator.prepare`` / ``_ensure_workspace`` in
  ``device_communicators/pcie_ipc_ar.py``), run in the real SGLang venv;
* backend names appear only in the registry.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
from pathlib import Path

import pytest

from fastverify.deploy import (
    BoxFingerprint,
    DeploymentRecord,
    Gain,
    P2PFacts,
    VerifyShapes,
    read_record,
    record_path_for,
    sglang_settings,
    write_deployment,
)
from fastverify.errors import UserError
from fastverify.registry import BackendName, names
from fastverify.topo.box import box_from_description, p2p_file_facts, p2p_from_topology, read_box, read_p2p_results

REPO = Path(__file__).resolve().parents[1]
BOX = BoxFingerprint(gpu_name="NVIDIA RTX PRO 6000 Blackwell Server Edition", sm=(12, 0), gpu_count=8, tp=8)
SHAPES = VerifyShapes(max_batch=32, draft_tokens=4, hidden=7168)


def record(backend=BackendName.pcie_ipc) -> DeploymentRecord:
    return DeploymentRecord(
        backend=backend,
        shapes=SHAPES,
        p2p=P2PFacts(ok=True, source="p2p_check", pairs=56),
        box=BOX,
        nccl_settings={"NCCL_P2P_LEVEL": "SYS"},
        sglang_version="0.5.23",
        gain=Gain(baseline_us=24600.0, best_us=1230.0, basis="measured", clock="cuda_events"),
    )


def test_sglang_settings_from_the_registry():
    # the switch only: SGLang 0.5.23 sizes the workspace from the server's own decode width, a size
    # line would be used verbatim and cap it at the record's shapes
    assert sglang_settings(BackendName.pcie_ipc) == {"SGLANG_ENABLE_PCIE_IPC_ALLREDUCE": "1"}
    for other in (BackendName.fused, BackendName.b12x, BackendName.nccl, BackendName.custom_ar):
        assert sglang_settings(other) == {}  # reached by the patch / native: the record carries them


def test_write_deployment_writes_both_and_round_trips(tmp_path):
    env = tmp_path / "box.env"
    env_p, rec_p = write_deployment(env, {"NCCL_P2P_LEVEL": "SYS"}, record(), header_lines=["MEASURED"])
    assert rec_p == tmp_path / "box.deploy.json" == record_path_for(env)
    assert read_record(rec_p) == record() and read_record(rec_p).backend is BackendName.pcie_ipc
    text = env_p.read_text()
    assert "# deployment record: box.deploy.json" in text
    assert "SGLANG_" not in text.replace("# ", "")  # the backend is the record's; no switch line
    assert [ln for ln in text.splitlines() if not ln.startswith("#")] == ["NCCL_P2P_LEVEL=SYS"]


def test_write_deployment_refuses_an_sglang_switch_and_writes_neither(tmp_path):
    env = tmp_path / "box.env"
    with pytest.raises(UserError, match="SGLANG_ENABLE_PCIE_IPC_ALLREDUCE: env files hold NCCL settings only"):
        write_deployment(env, {"NCCL_P2P_LEVEL": "SYS", **sglang_settings(BackendName.pcie_ipc)}, record())
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("bak", ["box.env.bak", "box.deploy.json.bak"])
def test_write_deployment_never_writes_a_backup_over_an_input(tmp_path, bak):
    env = tmp_path / "box.env"
    write_deployment(env, {"NCCL_P2P_LEVEL": "SYS"}, record())
    (tmp_path / bak).write_text("an input\n")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(UserError, match=f"{bak}: is one of this command's inputs"):
        write_deployment(env, {"NCCL_P2P_LEVEL": "PHB"}, record(), inputs=(tmp_path / bak,))
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_write_deployment_validates_before_writing_and_never_over_an_input(tmp_path):
    env = tmp_path / "box.env"
    with pytest.raises(UserError, match="LD_PRELOAD is not allowed"):
        write_deployment(env, {"LD_PRELOAD": "/x.so"}, record())
    assert list(tmp_path.iterdir()) == []  # neither file
    prof = tmp_path / "p.deploy.json"
    prof.write_text("{}")
    with pytest.raises(UserError, match="is one of this command's inputs"):
        write_deployment(tmp_path / "p.env", {}, record(), inputs=(prof,))
    assert prof.read_text() == "{}" and not (tmp_path / "p.env").exists()


def test_box_description_and_p2p_file(tmp_path):
    b = box_from_description('{"gpu_name": "NVIDIA L40S", "sm": [8, 9], "gpu_count": 8}', tp=8)
    assert b == BoxFingerprint(gpu_name="NVIDIA L40S", sm=(8, 9), gpu_count=8, tp=8)
    f = tmp_path / "b.json"
    f.write_text('{"gpu_name": "X", "sm": [9, 0], "gpu_count": 2, "tp": 2}')
    assert box_from_description(str(f)).sm == (9, 0)
    with pytest.raises(UserError, match="invalid box description"):
        box_from_description('{"gpu_name": "X", "sm": "sm90", "gpu_count": 2}')
    rows = [
        {"src": 0, "dst": 1, "ok": True, "reason": "ok"},
        {"src": 1, "dst": 0, "ok": False, "reason": "read back zeros"},
    ]
    f.write_text(json.dumps(rows))
    facts = p2p_file_facts(f, read_p2p_results(f))
    assert facts.ok is False and facts.pairs == 2 and not facts.proven and "GPU 0 -> memory of GPU 1" in facts.note
    f.write_text(json.dumps({"schema_version": 1, "results": [dict(r, ok=True) for r in rows]}))  # the cache file
    assert p2p_file_facts(f, read_p2p_results(f)).proven
    f.write_text("[]")
    with pytest.raises(UserError, match="no P2P results"):
        read_p2p_results(f)


def test_nvml_p2p_status_never_proves():
    class T:
        source = "NVML (driver 575)"
        p2p_read = {(0, 1): True, (1, 0): True}
        p2p_write = {(0, 1): True, (1, 0): True}

    facts = p2p_from_topology(T())
    assert facts.ok is True and facts.source == "nvml" and not facts.proven


class _FakeNvml:
    """NVML stand-in with pynvml's function names and return shapes (nvidia-ml-py)."""

    class NVMLError(Exception):
        pass

    def __init__(self, names_, caps):
        self._names, self._caps = names_, caps

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        pass

    def nvmlDeviceGetCount(self):
        return len(self._names)

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetName(self, h):
        return self._names[h]

    def nvmlDeviceGetCudaComputeCapability(self, h):
        return self._caps[h]

    def nvmlSystemGetDriverVersion(self):
        return b"575.57.08"


def test_read_box_from_nvml():
    nv = _FakeNvml([b"NVIDIA RTX PRO 6000 Blackwell Server Edition"] * 8, [(12, 0)] * 8)
    b = read_box(8, nvml=nv, torch_fallback=False, nccl_version="2.27.7")
    assert b == BoxFingerprint(
        gpu_name="NVIDIA RTX PRO 6000 Blackwell Server Edition",
        sm=(12, 0),
        gpu_count=8,
        tp=8,
        driver="575.57.08",
        nccl_version="2.27.7",
    )

    class Broken(_FakeNvml):
        def nvmlInit(self):
            raise self.NVMLError("Driver Not Loaded")

    none = read_box(8, nvml=Broken([], []), torch_fallback=False)
    assert none.gpu_count == 0 and none.sm is None and none.gpu_name is None


# --- SGLang's own workspace sizing, run from the real SGLang 0.5.23 --------------------------------

_SIZING_PROBE = r"""
import json, os, sys
import torch
from sglang.srt.distributed.device_communicators import pcie_ipc_ar as m

def size(hidden, max_rows, override):
    if override is None:
        os.environ.pop("SGLANG_PCIE_IPC_MAX_NUMEL", None)
    else:
        os.environ["SGLANG_PCIE_IPC_MAX_NUMEL"] = str(override)
    seen = {}
    class Workspace:  # stands in for flashinfer.comm.PcieIpcAllReduceWorkspace: records what SGLang asks for
        def __init__(self, *, group, max_numel, dtype, tune_batches, tune_cache):
            seen.update(max_numel=max_numel, tune_batches=list(tune_batches))
    c = object.__new__(m.PcieIpcCommunicator)  # the GPU-only constructor is skipped; prepare() is real
    c.disabled, c._workspace, c._build_failed, c._max_rows = False, None, False, None
    c._group, c._device, c._world_size, c._workspace_cls = None, torch.device("cpu"), 8, Workspace
    c._tune = lambda hidden: None  # FlashInfer's autotune needs GPUs; not the rule under test
    c.prepare(hidden=hidden, max_rows=max_rows)
    return {"max_numel": c.max_numel, **seen}

args = json.loads(sys.argv[1])
print(json.dumps([size(*a) for a in args]))
"""


def test_workspace_bound_matches_sglangs_own_sizing():
    py = os.environ.get("FASTVERIFY_SGLANG_PYTHON")
    if not py or not Path(py).is_file():
        pytest.skip("FASTVERIFY_SGLANG_PYTHON not set (make the SGLang venv with .ci/sglang-venv.sh)")
    cases = [SHAPES, VerifyShapes(max_batch=9, draft_tokens=4, hidden=7168), VerifyShapes(1, 3, 6144)]
    # SGLang's derivation: max_rows = max(capture_bs) x tokens_per_req (base_runner._widest_decode_rows),
    # workspace = max_rows x hidden; and with SGLANG_PCIE_IPC_MAX_NUMEL set, exactly that value.
    calls = [[s.hidden, s.max_batch * s.draft_tokens, None] for s in cases]
    calls += [[s.hidden, None, s.max_numel] for s in cases]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    cp = subprocess.run(
        [py, "-c", _SIZING_PROBE, json.dumps(calls)], capture_output=True, text=True, timeout=300, env=env
    )
    assert cp.returncode == 0, cp.stderr[-3000:]
    got = json.loads(cp.stdout.strip().splitlines()[-1])
    n = len(cases)
    for s, derived, overridden in zip(cases, got[:n], got[n:]):
        assert derived["max_numel"] == s.max_numel == s.max_batch * s.draft_tokens * s.hidden
        assert overridden["max_numel"] == s.max_numel  # a size line is used verbatim (why tune writes none)
        assert derived["tune_batches"][-1] == s.max_rows  # SGLang tunes up to the same row count
    assert got[0]["max_numel"] == 917504


# --- backend names only in the registry ----------------------------------------------------------------

_NAMES = {n.value for n in BackendName if n.value not in ("nccl", "gloo")} | {"pcie-ipc"}
# (file, literal): string constants equal to a backend name that are NOT backend names.
_NOT_BACKEND_NAMES = {
    ("fastverify/backends/flashinfer_fused.py", "fused"): "path_counts label (fused kernel vs fallback)",
    ("fastverify/backends/flashinfer_b12x.py", "fused"): "prepared-plan kind and path_counts label",
    ("fastverify/trace/classify.py", "custom_ar"): "trace kernel family name (like 'nccl', 'rccl')",
    ("fastverify/patch/paths.py", "pcie_ipc"): "SGLang 0.5.23's own out-of-place method name (a dict key)",
    ("fastverify/tune/trial.py", "fused"): "path_counts label the fused backends count, read back by tune",
}
# Files of other helpers still holding backend literals when this test was written; the lead must
# clear these (use BackendName.x / the registry) and then empty this set.
_PENDING = set()


def _docstring_nodes(tree):
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def test_backend_names_only_in_the_registry():
    offenders = []
    for path in sorted((REPO / "fastverify").rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        if rel == "fastverify/registry.py" or rel in _PENDING:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docs = _docstring_nodes(tree)
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and node.value in _NAMES
                and id(node) not in docs
                and (rel, node.value) not in _NOT_BACKEND_NAMES
            ):
                offenders.append(f"{rel}:{node.lineno}: {node.value!r}")
    assert not offenders, "backend names outside the registry:\n" + "\n".join(offenders)
    assert set(names(tunable=True)) >= {BackendName.pcie_ipc, BackendName.fused}


def test_hand_written_box_and_record_errors_name_the_field_the_type_and_an_example(tmp_path):
    """One line: where, what the document is, the field path, the expected type in words, what
    was there, and an example value of that field."""
    with pytest.raises(UserError) as err:
        box_from_description('{"gpu_name": "X", "sm": [9, 0], "gpu_count": "8"}', where="--describe-box")
    assert str(err.value) == (
        '--describe-box: invalid box description: field "gpu_count": expected an integer, '
        'got a string (e.g. "gpu_count": 8)'
    )
    from fastverify.deploy import decode_record, encode_record

    doc = json.loads(encode_record(record()))
    doc["shapes"]["hidden"] = "7168"
    with pytest.raises(UserError) as err:
        decode_record(json.dumps(doc).encode(), source="x.deploy.json")
    assert str(err.value) == (
        'x.deploy.json: invalid deployment record: field "shapes.hidden": expected an integer, '
        'got a string (e.g. "hidden": 7168)'
    )
    doc = json.loads(encode_record(record()))
    doc["box"]["gpus"] = [{"index": "0", "uuid": "GPU-1"}]
    with pytest.raises(UserError) as err:
        decode_record(json.dumps(doc).encode(), source="x.deploy.json")
    assert str(err.value) == (
        'x.deploy.json: invalid deployment record: field "box.gpus[0].index": expected an '
        'integer or null, got a string (e.g. "index": 0)'
    )
