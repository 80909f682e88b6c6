"""`fastverify launch` refuses, exit 2 and one line, a backend SGLang cannot reach on the box it
runs on, and a deployment record that is not for this box (issue 9: item 5, item 4's launch side,
What-to-build §2). Boxes are *described* (``plan_launch(box=...)``, the ``--describe-box``
flag, ``FASTVERIFY_DESCRIBE_BOX``): no GPU is needed.

Facts the expected values come from (independent of fastverify's code):

* SGLang 0.5.23 calls ``RMSNorm.forward_with_allreduce_fusion`` only when
  ``flashinfer_ar_fusion_applies`` holds: SM90 or SM100 (``layers/layer_boundary/residual/add_norm.py``,
  ``utils/common.py``); L40S is SM89, RTX PRO 6000 Blackwell is SM120, H100 SM90, B200 SM100.
* FlashInfer 0.7.4's PCIe IPC workspace opens every peer handle, then ``dist.barrier()``
  (``flashinfer/comm/cuda_ipc.py``): with P2P broken for one pair the others wait forever.
* Kimi-K2: hidden 7168; 32 requests x 4 draft tokens x 7168 = 917,504 elements.
"""

from __future__ import annotations

import json
import os

import pytest
from conftest import SGLANG_0523, assert_user_error

from fastverify.deploy import (
    BoxFingerprint,
    DeploymentRecord,
    GpuId,
    P2PFacts,
    VerifyShapes,
    encode_record,
    record_path_for,
)
from fastverify.errors import UserError
from fastverify.patch import launch as L
from fastverify.registry import BackendName

CMD = ["python", "-m", "sglang.launch_server", "--model-path", "M", "--tp-size", "8"]
SGL = SGLANG_0523
# The described boxes' GPUs as NVML names them (index, PCI bus id, UUID): a P2P check proves
# something only for the GPUs it names.
GPUS = tuple(
    GpuId(index=i, pci_bus_id=f"00000000:{0x18 + 0x10 * i:02X}:00.0", uuid=f"GPU-{i:08x}-1111-2222-3333-444444444444")
    for i in range(8)
)
BOXES = {
    "SM89": BoxFingerprint(gpu_name="NVIDIA L40S", sm=(8, 9), gpu_count=8, tp=8, gpus=GPUS),
    "SM120": BoxFingerprint(
        gpu_name="NVIDIA RTX PRO 6000 Blackwell Server Edition", sm=(12, 0), gpu_count=8, tp=8, gpus=GPUS
    ),
    "SM90": BoxFingerprint(gpu_name="NVIDIA H100 PCIe", sm=(9, 0), gpu_count=8, tp=8, gpus=GPUS),
    "SM100": BoxFingerprint(gpu_name="NVIDIA B200", sm=(10, 0), gpu_count=8, tp=8, gpus=GPUS),
}
PROVEN = P2PFacts(ok=True, source="p2p_check", note="all 56 directions passed", pairs=56, gpus=GPUS)
SHAPES = VerifyShapes(max_batch=32, draft_tokens=4, hidden=7168)


def check_doc(rows, gpus=GPUS):
    """What `fastverify p2p` prints: the GPUs it tested, by CUDA ordinal, and the rows."""
    return {
        "schema": "fastverify.p2p_check",
        "version": 2,
        "cuda_visible_devices": None,
        "cuda_device_order": None,
        "gpus": [
            {"cuda": k, "index": g.index, "pci_bus_id": g.pci_bus_id, "uuid": g.uuid, "name": "G"}
            for k, g in enumerate(gpus)
        ],
        "results": rows,
    }


def p2p_json(tmp_path, failing=()):
    rows = [
        {"src": i, "dst": j, "ok": (i, j) not in failing, "reason": "read back zeros" if (i, j) in failing else "ok"}
        for i in range(8)
        for j in range(8)
        if i != j
    ]
    p = tmp_path / "p2p.json"
    p.write_text(json.dumps(check_doc(rows)))
    return p


def write_record(tmp_path, backend, box, p2p=PROVEN, name="box"):
    env = tmp_path / f"{name}.env"
    env.write_text("NCCL_P2P_LEVEL=SYS\n")
    rec = DeploymentRecord(backend=backend, shapes=SHAPES, p2p=p2p, box=box, sglang_version="0.5.23")
    record_path_for(env).write_bytes(encode_record(rec))
    return env


@pytest.mark.parametrize("sm", ["SM89", "SM120"])
def test_fused_refused_where_sglang_never_calls_it(tmp_path, sm):
    with pytest.raises(UserError) as e:
        L.plan_launch(None, "fused", None, CMD, environ={}, sglang=SGL, box=BOXES[sm], p2p_file=p2p_json(tmp_path))
    msg = str(e.value)
    assert msg == f"fused: SGLang 0.5.23 calls it only on SM90/SM100; this box is {sm}"


@pytest.mark.parametrize("sm", ["SM90", "SM100"])
def test_fused_accepted_on_sm90_and_sm100(tmp_path, sm):
    plan = L.plan_launch(None, "fused", None, CMD, environ={}, sglang=SGL, box=BOXES[sm], p2p_file=p2p_json(tmp_path))
    assert plan.patch and plan.env["FASTVERIFY_BACKEND"] == "fused" and plan.env["FASTVERIFY_PATCH"] == "1"


def test_fused_record_refused_on_sm120_through_auto(tmp_path):
    env = write_record(tmp_path, BackendName.fused, BOXES["SM120"])
    with pytest.raises(UserError, match="^fused: SGLang 0.5.23 calls it only on SM90/SM100; this box is SM120$"):
        L.plan_launch(str(env), "auto", None, CMD, environ={}, sglang=SGL, box=BOXES["SM120"])


@pytest.mark.parametrize("how", ["no facts", "nvml only", "failed pair", "too few pairs"])
def test_pcie_ipc_refused_without_proven_p2p(tmp_path, how):
    kw: dict = {}
    if how == "nvml only":
        env = write_record(
            tmp_path,
            BackendName.pcie_ipc,
            BOXES["SM120"],
            p2p=P2PFacts(ok=True, source="nvml", note="NVML says OK", pairs=56),
        )
        kw["env_file"] = str(env)
    else:
        kw["env_file"] = None
    if how == "failed pair":
        kw["p2p_file"] = p2p_json(tmp_path, failing={(3, 5)})
    if how == "too few pairs":
        p = tmp_path / "two.json"
        p.write_text(
            json.dumps(
                check_doc(
                    [{"src": 0, "dst": 1, "ok": True, "reason": "ok"}, {"src": 1, "dst": 0, "ok": True, "reason": "ok"}]
                )
            )
        )
        kw["p2p_file"] = p
    env_file = kw.pop("env_file")
    with pytest.raises(UserError) as e:
        L.plan_launch(env_file, "pcie_ipc", None, CMD, environ={}, sglang=SGL, box=BOXES["SM120"], **kw)
    msg = str(e.value)
    assert "\n" not in msg
    if how == "too few pairs":  # two passing directions prove nothing about the other 54: the file is named
        assert msg.startswith(f"{kw['p2p_file']}: the P2P check misses direction (0, 2)") and "all 56 ordered" in msg
        return
    assert msg.startswith("pcie_ipc: needs P2P between every GPU pair and it ")
    assert ("fails" in msg) == (how == "failed pair")


def test_env_file_switch_is_refused_and_an_environment_switch_needs_p2p_too(tmp_path):
    """An old env file that turns SGLang's PCIe IPC all-reduce on is refused when read (sourced without
    launch it would start the path unchecked); the same switch in the shell hangs the same way, so
    it needs the proof as the chosen backend does, and `--backend off` turns it off for the command."""
    env = tmp_path / "old.env"
    env.write_text("NCCL_P2P_LEVEL=SYS\nSGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1\n")
    for backend in ("auto", "off"):
        with pytest.raises(UserError) as e:
            L.plan_launch(str(env), backend, None, CMD, environ={}, sglang=SGL, box=BOXES["SM120"])
        msg = str(e.value)
        assert msg.startswith(f"{env}: line 2: SGLANG_ENABLE_PCIE_IPC_ALLREDUCE: env files hold NCCL settings only")
        assert "rerun `fastverify tune --write-env`" in msg and "deployment record" in msg and "\n" not in msg
    shell = {"SGLANG_ENABLE_PCIE_IPC_ALLREDUCE": "1"}
    with pytest.raises(UserError, match="^pcie_ipc: needs P2P"):
        L.plan_launch(None, "auto", None, CMD, environ=shell, sglang=SGL, box=BOXES["SM120"])
    plan = L.plan_launch(None, "off", None, CMD, environ=shell, sglang=SGL)
    assert plan.child_env(shell)["SGLANG_ENABLE_PCIE_IPC_ALLREDUCE"] == "0"
    assert any("environment's SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1 is set to 0" in n for n in plan.notes)
    plan = L.plan_launch(
        None, "auto", None, CMD, environ=shell, sglang=SGL, box=BOXES["SM120"], p2p_file=p2p_json(tmp_path)
    )
    assert plan.p2p.proven


EAGLE3_48x6 = [
    "--speculative-algorithm",
    "EAGLE3",
    "--speculative-num-steps",
    "5",
    "--speculative-eagle-topk",
    "1",
    "--speculative-num-draft-tokens",
    "6",
    "--cuda-graph-max-bs-decode",
    "48",
]


def test_pcie_ipc_accepted_with_proven_p2p_sets_switch_and_leaves_sizing_to_sglang(tmp_path):
    env = write_record(tmp_path, BackendName.pcie_ipc, BOXES["SM120"])  # record: 32 x 4 x 7168
    plan = L.plan_launch(str(env), "auto", None, CMD + EAGLE3_48x6, environ={}, sglang=SGL, box=BOXES["SM120"])
    assert plan.env["SGLANG_ENABLE_PCIE_IPC_ALLREDUCE"] == "1"
    # never capped below the server's 48 x 6 x 7168: no size at all, SGLang derives its own from the
    # decode width (pcie_ipc_ar.py _decode_width = max_bs x draft tokens)
    assert "SGLANG_PCIE_IPC_MAX_NUMEL" not in plan.env
    assert plan.env["FASTVERIFY_BACKEND"] == "pcie_ipc"
    assert plan.env["FASTVERIFY_DEPLOYMENT"] == str(record_path_for(env).resolve())
    assert os.path.isabs(plan.env["FASTVERIFY_DEPLOYMENT"])
    assert plan.patch and plan.env["FASTVERIFY_PATCH"] == "1"  # SGLang runs it; the patch counts its paths
    assert (plan.server.max_batch, plan.server.draft_tokens, plan.server.max_rows) == (48, 6, 288)
    text = L.describe(plan)
    assert "server: verify steps up to 48 requests x 6 tokens (288 rows)" in text, text
    assert any(
        n.startswith("pcie_ipc: SGLANG_PCIE_IPC_MAX_NUMEL not set") and "48 requests x 6 tokens" in n
        for n in plan.notes
    ), plan.notes
    # the record was measured for 32 x 4 = 128 rows: said, with the flags that would cover the server
    assert any(
        "up to 128 rows" in n and "up to 288" in n and "--max-batch 48 --draft-tokens 6" in n for n in plan.notes
    ), plan.notes


def test_a_size_in_the_environment_that_caps_the_workspace_says_which_steps_go_to_nccl(tmp_path):
    env = write_record(tmp_path, BackendName.pcie_ipc, BOXES["SM120"])
    shell = {"SGLANG_PCIE_IPC_MAX_NUMEL": "28672"}  # 1 x 4 x 7168, set in the user's shell
    plan = L.plan_launch(str(env), "auto", None, CMD + EAGLE3_48x6, environ=shell, sglang=SGL, box=BOXES["SM120"])
    assert "SGLANG_PCIE_IPC_MAX_NUMEL" not in plan.env  # launch never sets a size; the inherited one is explained
    cap = [n for n in plan.notes if "caps the workspace" in n]
    assert len(cap) == 1 and "at 4 rows x hidden 7168" in cap[0] and "above 4 rows go to NCCL" in cap[0], plan.notes
    assert "48 requests x 6 tokens (288 rows)" in cap[0]


def test_the_removed_cuda_graph_max_bs_flag_is_refused_as_sglangs_parser_refuses_it(tmp_path):
    env = write_record(tmp_path, BackendName.pcie_ipc, BOXES["SM120"])
    with pytest.raises(UserError, match="ambiguous option: --cuda-graph-max-bs could match"):
        L.plan_launch(
            str(env), "auto", None, CMD + ["--cuda-graph-max-bs", "64"], environ={}, sglang=SGL, box=BOXES["SM120"]
        )


@pytest.mark.parametrize(
    "other, words",
    [
        (BoxFingerprint(gpu_name="NVIDIA L40S", sm=(8, 9), gpu_count=8, tp=8), ["GPU, SM differ"]),
        (
            BoxFingerprint(gpu_name="NVIDIA RTX PRO 6000 Blackwell Server Edition", sm=(12, 0), gpu_count=4, tp=8),
            ["GPU count differ", "4 x NVIDIA RTX PRO 6000"],
        ),
        (BoxFingerprint(gpu_name=None, sm=None, gpu_count=0, tp=8), ["no GPU"]),
    ],
)
def test_record_from_another_box_refused(tmp_path, other, words):
    env = write_record(tmp_path, BackendName.nccl, BOXES["SM120"])
    with pytest.raises(UserError) as e:
        L.plan_launch(str(env), "auto", None, CMD, environ={}, sglang=SGL, box=other)
    msg = str(e.value)
    assert msg.startswith(f"{record_path_for(env)}: deployment record is for another box") and "\n" not in msg
    for w in words:
        assert w in msg


def test_record_for_another_tp_refused(tmp_path):
    env = write_record(tmp_path, BackendName.nccl, BOXES["SM120"])
    with pytest.raises(UserError, match="record is for TP 8; the command runs TP 4"):
        L.plan_launch(str(env), "auto", None, CMD[:-1] + ["4"], environ={}, sglang=SGL, box=BOXES["SM120"])


# --- the command line: exit 2, one line, nothing started ----------------------------------------


def _launch(tmp_path, *args, env_extra=None):
    import subprocess
    import sys

    from conftest import subprocess_env

    env = subprocess_env()
    env.pop("FASTVERIFY_DESCRIBE_BOX", None)
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, "-m", "fastverify", "launch", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _box_json(sm):
    b = BOXES[sm]
    return json.dumps(
        {
            "gpu_name": b.gpu_name,
            "sm": list(b.sm),
            "gpu_count": b.gpu_count,
            "gpus": [{"index": g.index, "pci_bus_id": g.pci_bus_id, "uuid": g.uuid} for g in b.gpus],
        }
    )


@pytest.mark.parametrize("sm", ["SM89", "SM120"])
def test_cli_refuses_fused_on_described_box(tmp_path, sm):
    p2p = p2p_json(tmp_path)
    proc = _launch(
        tmp_path,
        "--backend",
        "fused",
        "--p2p-check",
        str(p2p),
        "--describe-box",
        _box_json(sm),
        "--dry-run",
        "--",
        *CMD,
    )
    assert_user_error(proc, "fused", f"this box is {sm}", "SM90/SM100")
    # the same box described through the environment
    proc = _launch(
        tmp_path,
        "--backend",
        "fused",
        "--p2p-check",
        str(p2p),
        "--dry-run",
        "--",
        *CMD,
        env_extra={"FASTVERIFY_DESCRIBE_BOX": _box_json(sm)},
    )
    assert_user_error(proc, "fused", f"this box is {sm}")


def test_cli_refuses_pcie_ipc_without_p2p_and_accepts_with_it(tmp_path):
    proc = _launch(tmp_path, "--backend", "pcie_ipc", "--describe-box", _box_json("SM120"), "--dry-run", "--", *CMD)
    # the dry run prints the plan and what blocks it, then one summary line naming the first blocker
    line = assert_user_error(proc, "pcie_ipc", "P2P", "is not proven", "--p2p-check")
    assert line.startswith("fastverify: error: launch is blocked by 1 check (listed above); first: pcie_ipc: ")
    assert proc.stdout.splitlines()[0] == "box: described by --describe-box (not read from this machine)"
    assert proc.stdout.splitlines()[-2:] == [
        "blocked by:",
        "  - P2P: "
        + line.split("; first: ", 1)[1]
        + "; fix: run `fastverify p2p --output p2p.json` on the serving box, "
        "then add `--p2p-check p2p.json`",
    ]
    proc = _launch(
        tmp_path,
        "--backend",
        "pcie_ipc",
        "--p2p-check",
        str(p2p_json(tmp_path)),
        "--describe-box",
        _box_json("SM120"),
        "--dry-run",
        "--",
        *CMD,
    )
    assert proc.returncode == 0, proc.stderr
    assert "FASTVERIFY_BACKEND=pcie_ipc" in proc.stdout and "P2P: proven (p2p_check" in proc.stdout


@pytest.mark.parametrize(
    "content, words",
    [
        (b"{not json", ["the deployment record is not valid JSON"]),
        (b'{"schema": "something.else", "version": 1}', ["not a fastverify deployment record"]),
        (b'{"schema": "fastverify.deployment", "version": 99}', ["version 99"]),
        (b'{"schema": "fastverify.deployment", "version": 1, "backend": "pcie-ipc"}', ["invalid deployment record"]),
    ],
)
def test_cli_bad_records(tmp_path, content, words):
    rec = tmp_path / "bad.deploy.json"
    rec.write_bytes(content)
    proc = _launch(tmp_path, "--deployment", str(rec), "--describe-box", _box_json("SM120"), "--dry-run", "--", *CMD)
    assert_user_error(proc, str(rec), *words)


@pytest.mark.parametrize(
    "args, words",
    [
        (["--backend", "pcie-ipc"], ["pcie-ipc", "the one spelling is pcie_ipc"]),
        (["--backend", "mscclpp"], ["mscclpp", "expected one of auto, off, pcie_ipc"]),
        (["--describe-box", "{bad"], ["--describe-box", "not valid JSON"]),
        (["--p2p-check", "missing.json", "--backend", "pcie_ipc"], ["missing.json"]),
    ],
)
def test_cli_bad_input_one_line(tmp_path, args, words):
    proc = (
        _launch(tmp_path, *args, "--describe-box", _box_json("SM120"), "--dry-run", "--", *CMD)
        if "--describe-box" not in args
        else _launch(tmp_path, *args, "--dry-run", "--", *CMD)
    )
    assert_user_error(proc, *words)


def test_cli_record_from_another_box(tmp_path):
    env = write_record(tmp_path, BackendName.nccl, BOXES["SM120"])
    proc = _launch(tmp_path, "--env", str(env), "--describe-box", _box_json("SM89"), "--dry-run", "--", *CMD)
    line = assert_user_error(proc, "deployment record is for another box", "NVIDIA L40S")
    assert line.startswith("fastverify: error: launch is blocked by 1 check (listed above); first: ")
    assert proc.stdout.splitlines()[-2:] == ["blocked by:", "  - box: " + line.split("; first: ", 1)[1]]
    # the real launch refuses with that blocker itself, and starts nothing
    proc = _launch(tmp_path, "--env", str(env), "--describe-box", _box_json("SM89"), "--", *CMD)
    assert assert_user_error(proc) == "fastverify: error: " + line.split("; first: ", 1)[1] and proc.stdout == ""


def test_predicted_record_without_gpu_name_checked_on_sm_and_count(tmp_path):
    """``tune --predict`` from nvidia-smi text knows SM (--sm) and count, not the GPU name."""
    unnamed = BoxFingerprint(gpu_name=None, sm=(12, 0), gpu_count=8, tp=8)
    env = write_record(tmp_path, BackendName.nccl, unnamed)
    plan = L.plan_launch(str(env), "auto", None, CMD, environ={}, sglang=SGL, box=BOXES["SM120"])
    assert plan.env["FASTVERIFY_BACKEND"] == "nccl" and plan.env["NCCL_P2P_LEVEL"] == "SYS"
    with pytest.raises(UserError, match="SM differ"):
        L.plan_launch(str(env), "auto", None, CMD, environ={}, sglang=SGL, box=BOXES["SM90"])


def test_pcie_ipc_refused_for_a_float16_server(tmp_path):
    # SGLang 0.5.23 serves PCIe IPC in bf16 only (pcie_ipc_ar.py should_pcie_ipc_ar): switching it on
    # for an fp16 model would be a no-op that the counts would show as NCCL on every step
    env = write_record(tmp_path, BackendName.pcie_ipc, BOXES["SM120"])
    with pytest.raises(UserError, match="pcie_ipc: dtype float16 unsupported .takes bfloat16"):
        L.plan_launch(str(env), "auto", None, CMD + ["--dtype", "half"], environ={}, sglang=SGL, box=BOXES["SM120"])
    L.plan_launch(str(env), "auto", None, CMD + ["--dtype", "bfloat16"], environ={}, sglang=SGL, box=BOXES["SM120"])


def test_a_p2p_check_file_is_read_even_where_no_backend_needs_it(tmp_path):
    bad = tmp_path / "p2p.json"
    bad.write_text("not json")
    with pytest.raises(UserError, match="p2p.json"):
        L.plan_launch(None, "nccl", None, CMD, environ={}, sglang=SGL, box=BOXES["SM120"], p2p_file=str(bad))


# --- the IPC workspace: never an implausible size, and checked against the GPU's memory ---------------
# FlashInfer 0.7.4's PCIe IPC slab per rank (pcie_ipc_all_reduce.cuh::compute_workspace_layout): two
# scratch regions of 2 x world x payload, plus the copy-engine ring (< 2 x payload): at least
# (4 x world + 2) x payload, 34 x at TP 8. payload = elements x 2 B (SGLang builds it in bf16).


def test_an_env_file_size_of_10_to_the_18_is_refused_and_never_exported(tmp_path):
    env = write_record(tmp_path, BackendName.pcie_ipc, BOXES["SM120"])
    env.write_text("NCCL_P2P_LEVEL=SYS\nSGLANG_PCIE_IPC_MAX_NUMEL=" + "1" + "0" * 18 + "\n")
    before = env.read_bytes()
    with pytest.raises(UserError) as e:
        L.plan_launch(str(env), "auto", None, CMD + EAGLE3_48x6, environ={}, sglang=SGL, box=BOXES["SM120"])
    assert str(e.value).startswith(f"{env}: line 2: SGLANG_PCIE_IPC_MAX_NUMEL: env files hold NCCL settings only")
    assert env.read_bytes() == before


@pytest.mark.parametrize("value", ["1" + "0" * 18, "17179869185", "0", "12abc"])
def test_an_inherited_size_past_the_bounds_is_refused_before_sglang_reads_it(tmp_path, value):
    env = write_record(tmp_path, BackendName.pcie_ipc, BOXES["SM120"])
    with pytest.raises(UserError) as e:
        L.plan_launch(
            str(env),
            "auto",
            None,
            CMD + EAGLE3_48x6,
            environ={"SGLANG_PCIE_IPC_MAX_NUMEL": value},
            sglang=SGL,
            box=BOXES["SM120"],
        )
    msg = str(e.value)
    assert msg.startswith(f"the environment: SGLANG_PCIE_IPC_MAX_NUMEL={value}") and "\n" not in msg
    assert "at most 17179869184 elements" in msg
    # where nothing switches SGLang's IPC path on, the variable is inert and not in the way
    L.plan_launch(
        str(env), "nccl", None, CMD, environ={"SGLANG_PCIE_IPC_MAX_NUMEL": value}, sglang=SGL, box=BOXES["SM120"]
    )


def _mem_box(mem):
    import msgspec

    return msgspec.structs.replace(BOXES["SM120"], gpu_memory_bytes=mem)


def test_the_workspace_is_checked_against_the_gpus_memory_exactly_at_the_bound(tmp_path):
    env = write_record(tmp_path, BackendName.pcie_ipc, BOXES["SM120"])
    elements = 48 * 6 * 7168  # the command's decode width x the record's hidden (SGLang's own sizing)
    slab = elements * 2 * (4 * 8 + 2)
    assert slab == 140_378_112
    at_bound = slab * 10  # the workspace is exactly 10 % of this GPU
    plan = L.plan_launch(str(env), "auto", None, CMD + EAGLE3_48x6, environ={}, sglang=SGL, box=_mem_box(at_bound))
    note = next(n for n in plan.notes if n.startswith("pcie_ipc:"))
    assert "workspace about 134 MiB per GPU (2,064,384 elements x 2 B x 34 (FlashInfer's layout at TP 8))" in note
    assert note.endswith("10.0 % of its 1.3 GiB")
    with pytest.raises(UserError) as e:
        L.plan_launch(str(env), "auto", None, CMD + EAGLE3_48x6, environ={}, sglang=SGL, box=_mem_box(at_bound - 1))
    msg = str(e.value)
    assert msg.startswith("pcie_ipc: its IPC workspace would take 134 MiB per GPU") and "more than the 10 %" in msg
    assert "\n" not in msg


def test_a_size_at_the_bounds_on_a_24_gb_gpu_is_refused(tmp_path):
    env = write_record(tmp_path, BackendName.pcie_ipc, BOXES["SM120"])
    with pytest.raises(UserError, match=r"^pcie_ipc: its IPC workspace would take 1,088.0 GiB per GPU"):
        L.plan_launch(
            str(env),
            "auto",
            None,
            CMD + EAGLE3_48x6,
            environ={"SGLANG_PCIE_IPC_MAX_NUMEL": str(2**34)},
            sglang=SGL,
            box=_mem_box(24 << 30),
        )


def test_unknown_gpu_memory_is_said(tmp_path):
    env = write_record(tmp_path, BackendName.pcie_ipc, BOXES["SM120"])
    plan = L.plan_launch(str(env), "auto", None, CMD + EAGLE3_48x6, environ={}, sglang=SGL, box=BOXES["SM120"])
    note = next(n for n in plan.notes if n.startswith("pcie_ipc:"))
    assert note.endswith("GPU memory unknown (NVML gave none): not checked against it")
    plan = L.plan_launch(
        None, "pcie_ipc", None, CMD, environ={}, sglang=SGL, box=_mem_box(24 << 30), p2p_file=p2p_json(tmp_path)
    )
    note = next(n for n in plan.notes if n.startswith("pcie_ipc:"))
    assert "no deployment record gives the hidden size" in note


def test_an_env_file_whose_named_record_is_missing_is_refused(tmp_path):
    """An env file ``tune`` wrote names its record in the header; launched without it, the backend and
    the box checks would silently be skipped, so launch refuses in one line. An env file written by
    hand (no such header) still launches on NCCL settings alone."""
    from fastverify.deploy import write_deployment

    rec = DeploymentRecord(
        backend=BackendName.nccl, shapes=SHAPES, p2p=PROVEN, box=BOXES["SM120"], sglang_version="0.5.23"
    )
    env, rec_p = write_deployment(tmp_path / "box.env", {"NCCL_P2P_LEVEL": "SYS"}, rec, header_lines=["t"])
    rec_p.rename(tmp_path / "elsewhere.json")
    proc = _launch(tmp_path, "--env", str(env), "--describe-box", _box_json("SM120"), "--dry-run", "--", *CMD)
    assert_user_error(proc, str(env), "names the deployment record box.deploy.json", "--deployment FILE")
    proc = _launch(
        tmp_path,
        "--env",
        str(env),
        "--deployment",
        str(tmp_path / "elsewhere.json"),
        "--describe-box",
        _box_json("SM120"),
        "--dry-run",
        "--",
        *CMD,
    )
    assert proc.returncode == 0, proc.stderr
    hand = tmp_path / "hand.env"
    hand.write_text("# my settings\nNCCL_P2P_LEVEL=SYS\n")
    proc = _launch(tmp_path, "--env", str(hand), "--describe-box", _box_json("SM120"), "--dry-run", "--", *CMD)
    assert proc.returncode == 0, proc.stderr
