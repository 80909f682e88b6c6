import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import SGLANG_0523

from fastverify.deploy import BoxFingerprint, GpuId
from fastverify.errors import UserError
from fastverify.patch import launch as L
from fastverify.patch.handoff import ROUTE_HOOK
from fastverify.registry import BackendName, backend_info

CMD = ["python", "-m", "sglang.launch_server", "--model-path", "M", "--tp", "8", "--speculative-algorithm", "EAGLE3"]
NEW = SGLANG_0523
OLD = L.SGLangInfo(found=True, location="/x/sglang", version="0.5.6", has_plugins=False)
# A described SM90 box: fused is reachable there (SGLang 0.5.23 gates it to SM90/SM100). Its GPUs
# as NVML names them: the P2P check file must name the same ones to prove anything here.
GPUS = tuple(
    GpuId(index=i, pci_bus_id=f"00000000:{0x18 + 0x10 * i:02X}:00.0", uuid=f"GPU-{i:08x}-aaaa-bbbb-cccc-dddddddddddd")
    for i in range(8)
)
H100 = BoxFingerprint(gpu_name="NVIDIA H100 PCIe", sm=(9, 0), gpu_count=8, tp=8, gpus=GPUS)


def env_file(tmp_path, text):
    p = tmp_path / "box.env"
    p.write_text(text)
    return str(p)


def test_empty_command_refused():
    with pytest.raises(UserError, match="nothing to launch: give the sglang command after --"):
        L.plan_launch(None, "auto", None, [], environ={}, sglang=NEW)


def test_bad_backend_refused():
    with pytest.raises(UserError, match="--backend 'mscclpp'"):
        L.plan_launch(None, "mscclpp", None, CMD, environ={}, sglang=NEW)
    # one spelling (the registry's): the old hyphenated name is refused, with the right one named
    with pytest.raises(UserError, match=r"--backend 'pcie-ipc'.*the one spelling is pcie_ipc"):
        L.plan_launch(None, "pcie-ipc", None, CMD, environ={}, sglang=NEW)


def test_backend_choices_come_from_the_registry():
    from fastverify.registry import names

    assert L.BACKENDS == ("auto", "off", *[n.value for n in names(deployable=True)])
    assert "pcie_ipc" in L.BACKENDS and "pcie-ipc" not in L.BACKENDS and "gloo" not in L.BACKENDS


@pytest.mark.parametrize(
    "line,msg",
    [
        ("LD_PRELOAD=/evil.so", "LD_PRELOAD is not allowed"),
        ("FOO_BAR=1", "FOO_BAR is not allowed"),
        ("this is not a line", "expected KEY=VALUE"),
        ("CUDA_DEVICE_MAX_CONNECTIONS=99", "1..32"),
    ],
)
def test_bad_env_files_refused(tmp_path, line, msg):
    with pytest.raises(UserError, match=msg):
        L.plan_launch(env_file(tmp_path, line + "\n"), "auto", None, CMD, environ={}, sglang=NEW)


def test_settings_and_cuda_max_connections(tmp_path):
    f = env_file(tmp_path, "# tuned\nNCCL_CUMEM_ENABLE=1\nCUDA_DEVICE_MAX_CONNECTIONS=1\n")
    plan = L.plan_launch(f, "auto", None, CMD, environ={"NCCL_CUMEM_ENABLE": "0"}, sglang=NEW)
    assert plan.env["NCCL_CUMEM_ENABLE"] == "1"  # set explicitly: SGLang sets it only when unset
    assert plan.replaced["NCCL_CUMEM_ENABLE"] == ("0", "1")
    assert plan.env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    # SGLang overwrites it with 8 in its launcher: restored at interpreter start in every rank by
    # the hook folder's sitecustomize (no patch needed for that)
    assert plan.in_rank == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    assert plan.env["FASTVERIFY_CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    assert plan.env["PYTHONPATH"].split(os.pathsep)[0] == str(L.HOOK_DIR)
    assert not plan.patch and "FASTVERIFY_PATCH" not in plan.env
    assert plan.argv == tuple(CMD)
    text = L.describe(plan)
    assert "NCCL_CUMEM_ENABLE=1   (was 0)" in text
    assert "re-applied in each rank: CUDA_DEVICE_MAX_CONNECTIONS=1 at interpreter start" in text
    assert "NCCL_NVLS_ENABLE unset: SGLang will set it to 0" in text
    assert "command: python -m sglang.launch_server" in text


def test_settings_only_needs_no_patch(tmp_path):
    plan = L.plan_launch(env_file(tmp_path, "NCCL_NVLS_ENABLE=0\n"), "auto", None, CMD, environ={}, sglang=NEW)
    assert not plan.patch and plan.route == "" and "FASTVERIFY_PATCH" not in plan.env
    assert "patch: not needed" in L.describe(plan)


def test_symm_mem_flag_noted(tmp_path):
    plan = L.plan_launch(
        env_file(tmp_path, "NCCL_CUMEM_ENABLE=0\n"), "auto", None, CMD + ["--enable-symm-mem"], environ={}, sglang=NEW
    )
    assert any("force NCCL_CUMEM_ENABLE=1" in n for n in plan.notes)


def test_pcie_ipc_uses_sglang_switch(tmp_path):
    from fastverify.deploy import P2PFacts

    proven = _proven(tmp_path)
    plan = L.plan_launch(None, "pcie_ipc", None, CMD, environ={}, sglang=NEW, box=H100, p2p_file=proven)
    # SGLang 0.5.23 runs it itself; the patch loads only to count which path each all-reduce took
    assert plan.env["SGLANG_ENABLE_PCIE_IPC_ALLREDUCE"] == "1" and plan.patch
    assert plan.env["FASTVERIFY_BACKEND"] == "pcie_ipc"
    assert plan.p2p == P2PFacts(
        ok=True,
        source="p2p_check",
        pairs=56,
        gpus=GPUS,
        note=f"all 56 directions of the TP group's GPUs passed ({proven})",
    )
    with pytest.raises(
        UserError, match="the environment's SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=0 contradicts --backend pcie_ipc"
    ):
        L.plan_launch(
            None,
            "pcie_ipc",
            None,
            CMD,
            environ={"SGLANG_ENABLE_PCIE_IPC_ALLREDUCE": "0"},
            sglang=NEW,
            box=H100,
            p2p_file=proven,
        )
    # an env file never holds the switch (sourced without launch it would skip the P2P proof)
    with pytest.raises(UserError, match="SGLANG_ENABLE_PCIE_IPC_ALLREDUCE: env files hold NCCL settings only"):
        L.plan_launch(
            env_file(tmp_path, "SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=0\n"),
            "pcie_ipc",
            None,
            CMD,
            environ={},
            sglang=NEW,
            box=H100,
            p2p_file=proven,
        )
    old = L.plan_launch(None, "pcie_ipc", None, CMD, environ={}, sglang=OLD, box=H100, p2p_file=proven)
    assert old.patch and "SGLANG_ENABLE_PCIE_IPC_ALLREDUCE" not in old.env and old.route == ROUTE_HOOK


def test_import_hook_route_and_pythonpath(tmp_path):
    plan = L.plan_launch(
        None,
        "fused",
        str(tmp_path / "prof"),
        CMD,
        environ={"PYTHONPATH": "/a"},
        sglang=OLD,
        box=H100,
        p2p_file=_proven(tmp_path),
    )
    assert plan.route == ROUTE_HOOK
    assert plan.env["PYTHONPATH"] == os.pathsep.join([str(L.HOOK_DIR), "/a"])
    assert plan.env["FASTVERIFY_BACKEND"] == "fused"
    assert plan.env["FASTVERIFY_PROFILE_VERIFY"] == str((tmp_path / "prof").resolve())
    assert (L.HOOK_DIR / "sitecustomize.py").is_file()
    assert "import hook" in L.describe(plan)


def _proven(tmp_path):
    """The JSON `fastverify p2p` prints when every pair of H100's 8 GPUs passed."""
    import json

    p = tmp_path / "p2p-proven.json"
    p.write_text(
        json.dumps(
            {
                "schema": "fastverify.p2p_check",
                "version": 2,
                "cuda_visible_devices": None,
                "cuda_device_order": None,
                "gpus": [
                    {
                        "cuda": k,
                        "index": g.index,
                        "pci_bus_id": g.pci_bus_id,
                        "uuid": g.uuid,
                        "name": "NVIDIA H100 PCIe",
                    }
                    for k, g in enumerate(GPUS)
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


def test_plugins_without_entry_point_fall_back(tmp_path):
    info = L.SGLangInfo(found=True, has_plugins=True, entry_point_installed=False)
    plan = L.plan_launch(None, "fused", None, CMD, environ={}, sglang=info, box=H100, p2p_file=_proven(tmp_path))
    assert plan.route == ROUTE_HOOK and any("entry point is not installed" in n for n in plan.notes)


def test_sglang_plugins_filter_extended(tmp_path):
    proven = _proven(tmp_path)
    plan = L.plan_launch(
        None, "fused", None, CMD, environ={"SGLANG_PLUGINS": "other"}, sglang=NEW, box=H100, p2p_file=proven
    )
    assert plan.env["SGLANG_PLUGINS"] == "other,fastverify"
    plan = L.plan_launch(None, "fused", None, CMD, environ={}, sglang=NEW, box=H100, p2p_file=proven)
    assert "SGLANG_PLUGINS" not in plan.env  # unset: every plugin loads


def test_profile_dir_that_is_a_file(tmp_path):
    f = tmp_path / "f"
    f.write_text("")
    with pytest.raises(UserError, match="not a folder"):
        L.plan_launch(None, "off", str(f), CMD, environ={}, sglang=NEW)


def test_detect_sglang_on_source_tree(tmp_path):
    root = tmp_path / "sglang"
    (root / "srt" / "plugins").mkdir(parents=True)
    (root / "srt" / "plugins" / "__init__.py").write_text('GENERAL_PLUGINS_GROUP = "sglang.srt.plugins"\n')
    (root / "version.py").write_text('__version__ = "0.5.23"\n')
    info = L.detect_sglang(root)
    assert (
        info.found
        and info.has_plugins
        and not info.has_switch(backend_info(BackendName.pcie_ipc))
        and info.version == "0.5.23"
    )
    assert not L.detect_sglang(tmp_path / "nothing").found


def test_detect_real_wheel_if_given(tmp_path):
    whl = os.environ.get("FASTVERIFY_SGLANG_WHEEL")
    if not whl or not Path(whl).is_file():
        pytest.skip("FASTVERIFY_SGLANG_WHEEL not set")
    import zipfile

    with zipfile.ZipFile(whl) as z:
        for n in z.namelist():
            if n.startswith(
                (
                    "sglang/srt/plugins/",
                    "sglang/version.py",
                    "sglang/srt/distributed/device_communicators/pcie_ipc_ar.py",
                )
            ):
                z.extract(n, tmp_path)
    info = L.detect_sglang(tmp_path / "sglang")
    assert info.has_plugins and info.has_switch(backend_info(BackendName.pcie_ipc))


def test_exec_plan_env_reaches_grandchild(tmp_path):
    """exec with the plan's env; a child spawns a grandchild that reports its env and whether the
    import hook ran the patch (flag on, no SGLang: the hook loads and does nothing harmful)."""
    out = tmp_path / "out.txt"
    child = tmp_path / "child.py"
    child.write_text(
        textwrap.dedent(f"""
        import multiprocessing as mp, os, sys
        def grand(path):
            with open(path, "w") as f:
                hooked = any(type(x).__name__ == "_AfterImport" for x in sys.meta_path)
                f.write(os.environ.get("NCCL_NVLS_ENABLE", "-") + " " + os.environ.get("FASTVERIFY_PATCH", "-")
                        + " " + str(hooked))
        if __name__ == "__main__":
            mp.set_start_method("spawn")
            p = mp.Process(target=grand, args=({str(out)!r},)); p.start(); p.join()
    """)
    )
    plan = L.plan_launch(
        env_file(tmp_path, "NCCL_NVLS_ENABLE=0\n"),
        "fused",
        None,
        [sys.executable, str(child)],
        environ=os.environ,
        sglang=OLD,
        box=H100,
        p2p_file=_proven(tmp_path),
    )
    runner = (
        f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r});"
        "from fastverify.patch import launch as L;"
        f"L.exec_plan(L.LaunchPlan(env={plan.env!r}, route={plan.route!r}, patch=True, "
        f"argv={plan.argv!r}, backend='fused'))"
    )
    subprocess.run([sys.executable, "-c", runner], check=True, timeout=60)
    assert out.read_text() == "0 1 True"


def test_exec_plan_missing_program():
    plan = L.LaunchPlan(env={}, route="", patch=False, argv=("/no/such/prog",), backend="off")
    with pytest.raises(UserError, match="cannot run"):
        L.exec_plan(plan)


def test_cuda_max_connections_survives_sglangs_overwrite_in_spawned_ranks(tmp_path):
    """Issue 9 item 11. SGLang's launcher writes CUDA_DEVICE_MAX_CONNECTIONS=8
    (entrypoints/engine.py::_set_envs_and_config) and then spawns the ranks, which reach cuInit
    (torch.cuda.is_available) while importing SGLang, before any plugin runs. The tuned value must
    already be in a spawned rank's environment when its interpreter starts, with the plugin route too."""
    out = tmp_path / "out.txt"
    child = tmp_path / "child.py"
    child.write_text(
        textwrap.dedent(f"""
        import multiprocessing as mp, os, sys
        def rank(path):
            with open(path, "w") as f:
                f.write(os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "-") + " "
                        + str("torch" in sys.modules))
        if __name__ == "__main__":
            os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "8"  # what SGLang's launcher does
            mp.set_start_method("spawn")
            p = mp.Process(target=rank, args=({str(out)!r},)); p.start(); p.join()
    """)
    )
    f = env_file(tmp_path, "CUDA_DEVICE_MAX_CONNECTIONS=1\n")
    plan = L.plan_launch(f, "auto", None, [sys.executable, str(child)], environ=os.environ, sglang=NEW)
    runner = (
        f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r});"
        "from fastverify.patch import launch as L;"
        f"L.exec_plan(L.LaunchPlan(env={plan.env!r}, route={plan.route!r}, patch={plan.patch!r}, "
        f"argv={plan.argv!r}, backend='auto'))"
    )
    subprocess.run([sys.executable, "-c", runner], check=True, timeout=60)
    assert out.read_text() == "1 False"  # restored at start-up, before anything imported torch
