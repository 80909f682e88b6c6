"""``fastverify launch --dry-run`` shows the plan and every check that would refuse the real launch,
each with its fix, and exits 2 when any does (0 when none), with a one-line summary on stderr;
the real launch still stops at the first one, one line, and starts nothing.

The scenario: a ``pcie_ipc`` record tuned on an 8 x RTX PRO 6000 Blackwell box (SM120) without a
P2P check, checked away from that box with ``--describe-box``. Expected values come from the
facts themselves: the record's box and the described one differ in GPU name and SM; ``pcie_ipc``
needs every ordered pair of the 8 TP GPUs proven, 8 x 7 = 56 directions.
"""

from __future__ import annotations

import json
import os

import pytest
from conftest import SGLANG_0523, cli, one_line_error

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

NAME = "NVIDIA RTX PRO 6000 Blackwell Server Edition"
GPUS = tuple(
    GpuId(index=i, pci_bus_id=f"00000000:{0x18 + 0x10 * i:02X}:00.0", uuid=f"GPU-{i:08x}-5555-6666-7777-888888888888")
    for i in range(8)
)
OTHER_GPUS = tuple(
    GpuId(index=i, pci_bus_id=f"00000000:{0x81 + i:02X}:00.0", uuid=f"GPU-{i:08x}-9999-aaaa-bbbb-cccccccccccc")
    for i in range(8)
)
CMD = ["python", "-m", "sglang.launch_server", "--model-path", "M", "--tp-size", "8"]
# An SGLang 0.5.23 with its PCIe IPC module: the record's backend is switched by SGLang itself.
SGL = SGLANG_0523


@pytest.fixture
def here(tmp_path, monkeypatch):
    """A folder holding ``box.env`` and its ``pcie_ipc`` record (RTX PRO 6000 x 8, TP 8, P2P not
    checked), the working directory; this machine's SGLang is the 0.5.23 described above."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("FASTVERIFY_DESCRIBE_BOX", raising=False)
    monkeypatch.setattr(L, "detect_sglang", lambda sglang_dir=None: SGL)
    env = tmp_path / "box.env"
    env.write_text("NCCL_P2P_LEVEL=SYS\n")
    rec = DeploymentRecord(
        backend=BackendName.pcie_ipc,
        shapes=VerifyShapes(max_batch=32, draft_tokens=4, hidden=7168),
        p2p=P2PFacts(ok=None, source="not_checked"),
        sglang_version="0.5.23",
        box=BoxFingerprint(gpu_name=NAME, sm=(12, 0), gpu_count=8, tp=8),
        nccl_settings={"NCCL_P2P_LEVEL": "SYS"},
    )
    record_path_for(env).write_bytes(encode_record(rec))
    return tmp_path


def described(name, sm, gpus):
    return json.dumps(
        {
            "gpu_name": name,
            "sm": list(sm),
            "gpu_count": len(gpus),
            "gpus": [{"index": g.index, "pci_bus_id": g.pci_bus_id, "uuid": g.uuid} for g in gpus],
        }
    )


L40S = described("NVIDIA L40S", (8, 9), OTHER_GPUS)
SAME = described(NAME, (12, 0), GPUS)


def check_file(folder, gpus=GPUS):
    """The JSON `fastverify p2p` prints when all 56 ordered pairs of ``gpus`` passed."""
    p = folder / "p2p.json"
    p.write_text(
        json.dumps(
            {
                "schema": "fastverify.p2p_check",
                "version": 2,
                "cuda_visible_devices": None,
                "cuda_device_order": None,
                "gpus": [
                    {"cuda": k, "index": g.index, "pci_bus_id": g.pci_bus_id, "uuid": g.uuid, "name": NAME}
                    for k, g in enumerate(gpus)
                ],
                "results": [
                    {"src": i, "dst": j, "ok": True, "reason": "read+write ok"}
                    for i in range(8)
                    for j in range(8)
                    if i != j
                ],
            }
        )
    )
    return p


def blocked_lines(out):
    lines = out.splitlines()
    assert "blocked by:" in lines, out
    return lines[lines.index("blocked by:") + 1 :]


BOX_MSG = (
    "box.deploy.json: deployment record is for another box (GPU, SM differ): made on 8 x "
    f"{NAME} (SM120), this box has 8 x NVIDIA L40S (SM89); re-run `fastverify tune --write-env` here"
)
BOX_BLOCKER = "  - box: " + BOX_MSG


def test_a_record_from_another_box_without_p2p_check_lists_both_blockers(here, capsys):
    rc, out, err = cli(["launch", "--env", "box.env", "--describe-box", L40S, "--dry-run", "--", *CMD], capsys)
    assert rc == 2
    lines = out.splitlines()
    assert lines[0] == "box: described by --describe-box (not read from this machine)"
    # the plan is printed whole: what would be set, SGLang's switch for pcie_ipc, the route, the command
    assert "  SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1" in lines and "  FASTVERIFY_BACKEND=pcie_ipc" in lines
    assert "  NCCL_P2P_LEVEL=SYS" in lines
    assert f"  FASTVERIFY_DEPLOYMENT={here.resolve() / 'box.deploy.json'}" in lines
    assert (
        "patch: loads in every rank through the plugin entry point (group sglang.srt.plugins, name fastverify)" in lines
    )
    assert "command: python -m sglang.launch_server --model-path M --tp-size 8" in lines
    assert blocked_lines(out) == [
        BOX_BLOCKER,
        "  - P2P: pcie_ipc: needs P2P between every GPU pair and it is not proven on this box (not checked); run "
        "`fastverify p2p` or use nccl (or give --p2p-check FILE with its JSON); fix: run `fastverify p2p --output "
        "p2p.json` on the serving box, then add `--p2p-check p2p.json`",
    ]
    assert err == ("fastverify: error: launch is blocked by 2 checks (listed above); first: " + BOX_MSG + "\n")


def test_a_p2p_check_of_the_records_gpus_on_another_box_is_its_own_blocker(here, capsys):
    """The check names the record's GPUs, the described box has others: it proves nothing here."""
    check_file(here)
    rc, out, err = cli(
        ["launch", "--env", "box.env", "--describe-box", L40S, "--p2p-check", "p2p.json", "--dry-run", "--", *CMD],
        capsys,
    )
    assert rc == 2
    box, p2p = blocked_lines(out)
    assert box == BOX_BLOCKER
    assert p2p.startswith(
        "  - P2P: p2p.json: the P2P check did not test GPU 0 (0000:81:00.0), TP rank 0's GPU on this box"
    )
    assert p2p.endswith(
        "; fix: run `fastverify p2p --output p2p.json` on the serving box, then add `--p2p-check p2p.json`"
    )
    assert "P2P: not proven (p2p_check: p2p.json: the P2P check did not test GPU 0" in out
    assert err.startswith("fastverify: error: launch is blocked by 2 checks (listed above); first: box.deploy.json")


def test_the_matching_box_with_a_valid_p2p_check_is_not_blocked(here, capsys):
    check_file(here)
    rc, out, err = cli(
        ["launch", "--env", "box.env", "--describe-box", SAME, "--p2p-check", "p2p.json", "--dry-run", "--", *CMD],
        capsys,
    )
    assert rc == 0 and err == ""
    lines = out.splitlines()
    assert lines[0] == "box: described by --describe-box (not read from this machine)"
    assert f"box: 8 x {NAME} (SM120), driver unknown" in lines
    assert "P2P: proven (p2p_check: all 56 directions of the TP group's GPUs passed (p2p.json))" in lines
    assert "  SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1" in lines
    assert lines[-1] == "blocked by: nothing"


def test_a_box_described_in_the_environment_is_named_so(here, capsys, monkeypatch):
    check_file(here)
    monkeypatch.setenv("FASTVERIFY_DESCRIBE_BOX", SAME)
    rc, out, err = cli(["launch", "--env", "box.env", "--p2p-check", "p2p.json", "--dry-run", "--", *CMD], capsys)
    assert rc == 0, err
    assert out.splitlines()[0] == "box: described by FASTVERIFY_DESCRIBE_BOX (not read from this machine)"


def test_the_real_launch_stops_at_the_first_blocker_and_starts_nothing(here, capsys, monkeypatch):
    started = []

    def execvpe(*args):
        started.append(args)
        raise OSError("exec was called")

    monkeypatch.setattr(os, "execvpe", execvpe)
    rc, out, err = cli(["launch", "--env", "box.env", "--describe-box", L40S, "--", *CMD], capsys)
    line = one_line_error(rc, out, err, "deployment record is for another box (GPU, SM differ)")
    assert line == "fastverify: error: " + BOX_MSG
    assert out == "" and started == []
    # the box fixed, the P2P blocker is next: still one line, still nothing started
    rc, out, err = cli(["launch", "--env", "box.env", "--describe-box", SAME, "--", *CMD], capsys)
    one_line_error(rc, out, err, "pcie_ipc: needs P2P between every GPU pair and it is not proven", "--p2p-check")
    assert out == "" and started == []


@pytest.mark.parametrize(
    "args, words",
    [
        (["--env", "missing.env"], ["missing.env"]),
        (["--deployment", "bad.deploy.json"], ["bad.deploy.json", "not valid JSON"]),
        (["--describe-box", "{bad"], ["--describe-box", "not valid JSON"]),
    ],
)
def test_a_bad_input_file_is_still_one_line_at_once(here, capsys, args, words):
    (here / "bad.deploy.json").write_text("{not json")
    rc, out, err = cli(["launch", *args, "--dry-run", "--", *CMD], capsys)
    one_line_error(rc, out, err, *words)
    assert out == ""  # no plan: an input it cannot read is not a blocker


def test_plan_launch_collects_what_it_raises_one_by_one(here):
    """The same checks, two modes: collected, the blockers are the ones raised in turn as each
    is fixed."""
    box = BoxFingerprint(gpu_name="NVIDIA L40S", sm=(8, 9), gpu_count=8, tp=8, gpus=OTHER_GPUS)
    plan = L.plan_launch("box.env", "auto", None, CMD, environ={}, sglang=SGL, box=box, collect_blockers=True)
    assert [b.check for b in plan.blockers] == ["box", "P2P"]
    with pytest.raises(UserError) as e:
        L.plan_launch("box.env", "auto", None, CMD, environ={}, sglang=SGL, box=box)
    assert str(e.value) == plan.blockers[0].message
    with pytest.raises(UserError) as e:
        L.exec_plan(plan)  # a blocked plan is never run
    assert str(e.value) == plan.blockers[0].message


def test_help_documents_describe_box(capsys):
    with pytest.raises(SystemExit) as e:
        cli(["launch", "--help"], capsys)
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--describe-box JSON|FILE describe the serving box when checking a record away from it" in out
    assert '"sm": [12, 0], "gpu_count": 8}' in out and "the same as FASTVERIFY_DESCRIBE_BOX" in out


def test_every_kind_of_blocker_is_collected_with_its_fix(here):
    """Environment, command and IPC workspace blockers, with P2P proven on the record's box.
    The workspace: SGLang sizes it from the decode width, 48 requests x 6 tokens x hidden 7168 =
    2,064,384 elements, x 2 B x (4 x 8 + 2) = 140,378,112 B, 13.1 % of a 1 GiB GPU (> 10 %)."""
    import msgspec

    p2p = check_file(here)
    box = BoxFingerprint(gpu_name=NAME, sm=(12, 0), gpu_count=8, tp=8, gpus=GPUS)
    shell = {"SGLANG_ENABLE_PCIE_IPC_ALLREDUCE": "0", "SGLANG_PCIE_IPC_MAX_NUMEL": "0"}
    plan = L.plan_launch(
        "box.env",
        "auto",
        None,
        CMD + ["--cuda-graph-max-bs", "64"],
        environ=shell,
        sglang=SGL,
        box=box,
        p2p_file=p2p,
        collect_blockers=True,
    )
    assert [b.line() for b in plan.blockers] == [
        "command: the SGLang command: ambiguous option: --cuda-graph-max-bs could match --cuda-graph-max-bs-decode, "
        "--cuda-graph-max-bs-prefill",
        "environment: the environment's SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=0 contradicts --backend pcie_ipc (unset it "
        "or drop one of them)",
        "environment: the environment: SGLANG_PCIE_IPC_MAX_NUMEL=0: must be a positive decimal integer of at most "
        "17179869184 elements (4096 requests x 64 tokens x hidden 65536); fix: unset SGLANG_PCIE_IPC_MAX_NUMEL "
        "(SGLang sizes the workspace itself)",
    ]
    assert plan.p2p.proven and plan.env["SGLANG_ENABLE_PCIE_IPC_ALLREDUCE"] == "1"  # what would be set
    eagle = [
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
    plan = L.plan_launch(
        "box.env",
        "auto",
        None,
        CMD + eagle,
        environ={},
        sglang=SGL,
        p2p_file=p2p,
        box=msgspec.structs.replace(box, gpu_memory_bytes=1 << 30),
        collect_blockers=True,
    )
    (b,) = plan.blockers
    assert b.check == "IPC workspace" and b.message.startswith(
        "pcie_ipc: its IPC workspace would take 134 MiB per GPU (2,064,384 elements x 2 B x 34 (FlashInfer's layout "
        "at TP 8)), 13.1 % of the GPU's 1.0 GiB, more than the 10 %"
    )
    plan = L.plan_launch(
        None,
        "custom_ar",
        None,
        CMD + ["--disable-custom-all-reduce"],
        environ={},
        sglang=SGL,
        box=msgspec.structs.replace(box, nvlink_full=True),
        p2p_file=p2p,
        collect_blockers=True,
    )
    assert [b.line() for b in plan.blockers] == [
        "command: --backend custom_ar contradicts the command's --disable-custom-all-reduce (drop one)"
    ]


def test_a_command_without_tp_size_runs_sglangs_tp_1_and_is_blocked(here, capsys):
    # SGLang 0.5.23's tp_size defaults to 1: a TP-8 record does not fit a command that leaves it out
    check_file(here)
    rc, out, err = cli(
        ["launch", "--env", "box.env", "--describe-box", SAME, "--p2p-check", "p2p.json", "--dry-run", "--", *CMD[:-2]],
        capsys,
    )
    assert rc == 2, (out, err)
    assert any("deployment record is for TP 8; the command runs TP 1" in ln for ln in blocked_lines(out)), out
