"""The in-rank patch against the REAL imported SGLang 0.5.23 (not the fake in test_patch_install.py).

SGLang pins a torch that clashes with fastverify's own environment, so it lives in a separate venv
made by ``.ci/sglang-venv.sh``; its python is given in ``FASTVERIFY_SGLANG_PYTHON``. The probe
``tests/sglang_patch_probe.py`` runs there (CPU is enough: two gloo ranks on 127.0.0.1 build SGLang's
real process groups and run the real ``RMSNorm``) and prints one JSON object; these tests assert on
it. Without the variable (or the venv) every test here skips and says why.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from conftest import sglang_python_or_skip

PROBE = Path(__file__).with_name("sglang_patch_probe.py")
REPO = PROBE.parent.parent
TIMEOUT_S = 300


@pytest.fixture(scope="module")
def probe() -> dict:
    py = sglang_python_or_skip()
    env = {k: v for k, v in os.environ.items() if not k.startswith("FASTVERIFY_") and k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(REPO)  # this checkout's fastverify, whatever the venv has installed
    env.setdefault("CUDA_VISIBLE_DEVICES", "")  # CPU: the probe is about the real Python objects
    try:
        cp = subprocess.run([py, str(PROBE)], capture_output=True, text=True, timeout=TIMEOUT_S, env=env, cwd=str(REPO))
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"probe timed out after {TIMEOUT_S} s; stderr tail:\n{(e.stderr or '')[-3000:]}")
    lines = [ln for ln in cp.stdout.splitlines() if ln.startswith("{")]
    if cp.returncode != 0 or not lines:
        pytest.fail(
            f"probe failed (rc={cp.returncode}); stderr tail:\n{cp.stderr[-3000:]}\nstdout tail:\n{cp.stdout[-2000:]}"
        )
    out = json.loads(lines[-1])
    if os.environ.get("FASTVERIFY_PROBE_JSON"):  # keep it for the record
        Path(os.environ["FASTVERIFY_PROBE_JSON"]).write_text(json.dumps(out, indent=1))
    return out


def test_real_sglang_imports(probe):
    assert probe["versions"]["sglang"] == "0.5.23"
    bad = {m: r["error"] for m, r in probe["imports"].items() if not r["ok"]}
    assert not bad, bad


def test_targets_found_with_expected_signatures(probe):
    st = probe.get("static")
    assert st, probe.get("static_error")
    found = st["targets_found"]
    assert all(t["ok"] for t in found.values()), found


COUNTED = [
    "all_reduce",
    "count_capture",
    "count_flashinfer",
    "count_in_place",
    "count_mode",
    "count_out_place",
    "count_pynccl",
    "count_replay",
]
# what uninstall restores for them: one wrap per target, but capture/replay on each of SGLang 0.5.23's
# three graph backends (Full, Breakable, TcPiecewise: runner_backend/*_cuda_graph_backend.py)
N_COUNT_WRAPS = len(COUNTED) - 2 + 2 * 3
# the targets whose own class dict changes: capture/replay are abstract on the base, wrapped on its subclasses
CHANGED = [k for k in COUNTED if k not in ("count_capture", "count_replay")]
"""The counting targets the patch wraps in every active rank (fastverify/patch/counting.py): the
all-reduce, its out-of-place and in-place halves, the forward mode, graph capture and replay."""


def test_fused_backend_applies_and_uninstall_restores(probe):
    st = probe["static"]
    f = st["fused"]
    assert f["active"] and f["applied"] == ["fused_norm", "pre_capture"], f
    assert sorted(f["changed_in_class_dict"]) == sorted(["fused_norm", "pre_capture", *CHANGED]), f
    assert f["restored_identity"], f
    fp = st["fused_profile"]
    assert sorted(fp["applied"]) == ["fused_norm", "pre_capture", "verify_timer"] and fp["restored_identity"], fp
    assert st["install_twice_noop"] and st["install_twice_restored"]


def test_other_backends(probe):
    st = probe["static"]
    assert not st["off"]["active"] and st["off"]["applied"] == [] and st["off"]["changed_in_class_dict"] == []
    # nccl: only the rank-line hook (ModelRunner.init_cuda_graphs); SGLang's collectives untouched
    assert st["nccl"]["applied"] == ["pre_capture"]
    assert sorted(st["nccl"]["changed_in_class_dict"]) == sorted(["pre_capture", *CHANGED])  # counted, not routed
    # SGLang 0.5.23 ships its own PCIe IPC all-reduce: the dispatch is left alone...
    assert st["pcie_ipc_ar_module"] is True
    assert st["pcie_ipc"]["applied"] == ["pre_capture"] and "all_reduce" in st["pcie_ipc"]["skipped"]
    assert "SGLang's own pcie_ipc all-reduce is used" in st["pcie_ipc"]["skipped"]["all_reduce"]
    # ...and the real GroupCoordinator.all_reduce is wrappable where it would not be
    w = st["pcie_ipc_without_sglang_ipc"]
    assert w["applied"] == ["all_reduce", "pre_capture"] and w["restored_identity"], w


def test_verify_timer_wraps_real_signature(probe):
    v = probe["static"]["verify_timer"]
    assert v["applied"] == ["pre_capture", "verify_timer"] and v["wrapped"] and v["signature_preserved"], v
    assert "is_verify" in v["real_signature"]
    c = v["calls"]
    assert c["is_verify_positional_true"]["timed"] and c["is_verify_keyword_true"]["timed"], c
    assert not c["is_verify_keyword_false"]["timed"] and not c["is_verify_default"]["timed"], c
    assert v["restored_identity"]


def test_pre_capture_wraps_real_init_cuda_graphs(probe):
    """Resolved, wrapped and restored by identity on the real ModelRunner. No GPU in the probe:
    backend.prepare is not exercised there (the fake-SGLang tests cover it); a failing creation is
    logged, leaves the slot to the lazy path, and the real body still runs."""
    p = probe["static"]["pre_capture"]
    assert "capture_decode_cuda_graph" in p["real_signature"], p
    assert p["applied"] == ["fused_norm", "pre_capture"] and p["wrapped"] and p["signature_preserved"], p
    assert p["prepare_exercised"] is False
    assert p["real_body_error"] is not None, p  # the real SGLang body was reached (and fails on the stand-in)
    assert p["slot_after_failure"] == {"backend": False, "disabled": None, "prepared": False}, p
    assert p["uninstalled"] == 2 + N_COUNT_WRAPS and p["restored_identity"], p


def test_plugin_group_is_what_sglang_loads(probe):
    p = probe["static"]["plugin"]
    assert p["sglang_general_group"] == p["fastverify_group"] == "sglang.srt.plugins"
    assert p["loader_reads_general_group"]
    assert p["fastverify_entry_point"] == "fastverify.patch:plugin", p
    assert p.get("sglang_loader_callable") == "fastverify.patch.plugin", p


def _ranks(probe):
    rk = probe.get("ranks")
    assert rk, probe.get("ranks_error")
    for r in rk["ranks"]:
        assert "error" not in r, (r.get("error"), r.get("steps"), r.get("log_tail"))
    return rk["ranks"]


def test_real_groups_on_gloo(probe):
    for r in _ranks(probe):
        assert r["world_backend"] == "gloo"
        assert r["groups"]["tp"][1] == 2 and r["groups"]["attn_tp"][1] == 2, r["groups"]
        assert r["install"]["applied"] == ["fused_norm", "pre_capture"], r["install"]
        assert r["patched_in_place"] and r["restored_identity"] and r["uninstalled"] == 2 + N_COUNT_WRAPS


def test_patched_fused_norm_without_a_backend_is_sglangs_own(probe):
    """Installed but with no backend for the group (none is built on a CPU tensor), the patched
    forward_with_allreduce_fusion is SGLang's own method: every case (residual, residual + post,
    the MoE group's call, no residual; fp32 and bf16) ends exactly as the unpatched one does -- the
    same error from SGLang's fused custom op, or the same result and the same collectives."""
    for r in _ranks(probe):
        by = {(c["impl"], c["case"], c["dtype"]): c for c in r["cases"]}
        rows = [c for c in r["cases"] if c["impl"] == "fastverify"]
        assert len(rows) == 8, rows  # 4 cases x (fp32, bf16)
        for f in rows:
            s = by[("sglang", f["case"], f["dtype"])]
            if "error" in s:
                assert f.get("error", "").split(":")[0] == s["error"].split(":")[0], (s, f)
            else:
                assert "error" not in f, (s, f)
                assert (f["dist_all_reduces"], f["out_ok"]) == (s["dist_all_reduces"], s["out_ok"]), (s, f)


def test_fused_slot_sums_over_the_group_each_call_is_owed_to(probe):
    """Item 4 on SGLang's real groups (4 gloo ranks, TP 4, moe_dp 2): the fused slot builds one
    backend per group -- the attention-TP group (all 4 ranks) and post_experts_reduction_group()
    (the MoE-TP pair) -- and the MoE output's call sums over its pair only, the attention output's
    over all four. Rank r holds r + 1, so the sum names the ranks."""
    fg = probe.get("fused_groups")
    assert fg, probe.get("fused_groups_error")
    for r in fg["ranks"]:
        assert "error" not in r, (r.get("error"), r.get("trace"), r.get("steps"), r.get("log_tail"))
        g = r["groups"]
        assert g["attn"] == [0, 1, 2, 3] and g["moe"] == ([0, 1] if r["rank"] < 2 else [2, 3]), g
        assert not g["moe_is_tp"] and g["resolve_moe_is_post_experts"], g
        assert "fused_norm" in r["applied"], (r["applied"], r["skipped"])
        assert sorted(b["ranks"] for b in r["backends"]) == sorted([g["attn"], g["moe"]]), r["backends"]
        assert all(b["built"] for b in r["backends"]), r["backends"]
        assert r["sums"]["attn"] == [float(sum(k + 1 for k in g["attn"]))], r["sums"]  # 10
        assert r["sums"]["moe"] == [float(sum(k + 1 for k in g["moe"]))], r["sums"]  # 3 or 7
        assert r["paths"]["other"]["fastverify.gloo"] == 2, r["paths"]  # both calls by the slot's backends


def test_unpatched_sglang_on_cpu(probe):
    """The real (unpatched) SGLang path, for the record: with a residual it goes to the
    ``sglang::flashinfer_allreduce_residual_rmsnorm`` custom op, which has no CPU kernel (so it cannot
    be the reference here); without one it only norms (no all-reduce)."""
    for r in _ranks(probe):
        for c in (c for c in r["cases"] if c["impl"] == "sglang"):
            if c["case"] == "no_residual":
                assert c["dist_all_reduces"] == 0 and c["out_err_if_not_reduced"] <= c["tol"], c
            elif "error" in c:
                assert (
                    c["error"].startswith("NotImplementedError")
                    and "flashinfer_allreduce_residual_rmsnorm" in c["error"]
                ), c
            else:  # a CPU kernel appeared: then it must agree with the reference too
                assert c["dist_all_reduces"] == 1 and c["out_ok"] and c["res_ok"], c


def test_no_residual_matches_sglang(probe):
    """SGLang's own forward_with_allreduce_fusion does NOT all-reduce when residual is None (it only
    norms); the patched one should not differ from it."""
    for r in _ranks(probe):
        by = {(c["impl"], c["dtype"]): c for c in r["cases"] if c["case"] == "no_residual"}
        for dt in ("float32", "bfloat16"):
            s, f = by[("sglang", dt)], by[("fastverify", dt)]
            assert "error" not in s and "error" not in f, (s, f)
            assert f["dist_all_reduces"] == s["dist_all_reduces"], (s, f)


# --- issue 9: facts from the real GroupCoordinator, SGLang's own rules ------------------------------


def test_rank_step_builds_from_the_real_group_coordinator_and_prints_its_line(probe):
    """Done-when of issue 9: on SGLang's real 2-rank gloo TP group (initialize_model_parallel), the
    rank step (the real ModelRunner.init_cuda_graphs, wrapped) builds the backend from the REAL
    GroupCoordinator -- gloo on CPU, on its device group, world size from it, single node from
    SGLang's in_the_same_node_as on its CPU group, P2P from the deployment record, the workspace
    from the record's 8 x 4 x hidden -- and each rank prints its one line to its own stderr."""
    for r in _ranks(probe):
        d = r["dispatch"]
        assert d["applied"] == ["all_reduce", "pre_capture"] and d["disabled"] is None, d
        assert d["context"] == {
            "world_size": 2,
            "device_type": "cpu",
            "group_backend": "gloo",
            "single_node": True,
            "p2p_ok": True,
            "p2p_note": "P2P proven by p2p_check (deployment record: all 2 ordered pairs passed)",
        }, d
        assert d["backend"] == {"name": "gloo", "max_numel": 8 * 4 * 64, "hidden": 64, "on_tp_device_group": True}
        assert d["all_reduce_ok"] and d["via_backend"] == 1, d  # GroupCoordinator.all_reduce went through it
        assert d["real_body_error"] is not None  # the real init_cuda_graphs ran after the step
        lines = r["lines"]
        want = (
            f"fastverify patch [TP {r['rank']}]: backend=pcie_ipc applied=all_reduce,pre_capture built=all_reduce=gloo"
        )
        assert sum(ln.startswith(want) for ln in lines) == 1, lines
        assert "single node" in lines[-1] and "P2P proven by p2p_check" in lines[-1]


def test_fused_norm_skipped_where_sglangs_gate_is_false(probe):
    """Item 4 in the ranks: on this CPU box SGLang's real flashinfer_ar_fusion_applies is False, so the
    rank step moves fused_norm to skipped with that reason, builds nothing, and says so in its line."""
    for r in _ranks(probe):
        f = r["fused_rank_step"]
        assert f["install_applied"] == ["fused_norm", "pre_capture"] and f["applied"] == ["pre_capture"], f
        assert "flashinfer_ar_fusion_applies(1) is False" in f["skipped"]["fused_norm"] and f["built"] == {}, f
        assert any(
            ln.startswith(
                f"fastverify patch [TP {r['rank']}]: backend=fused applied=pre_capture skipped="
                "fused_norm (SGLang never calls"
            )
            for ln in r["lines"]
        ), r["lines"]


def test_sglang_fusion_gate_per_sm_agrees_with_registry_and_patch(probe):
    """SGLang's real flashinfer_ar_fusion_applies, its module re-executed under override_platform for
    each described GPU: SM89 and SM120 are never reached, SM90 and SM100 are (up to 2048 rows); the
    patch's reach and the registry's sglang_sm_majors say the same."""
    rows = probe.get("gate", {}).get("rows")
    assert rows, (probe.get("gate_error"), probe.get("gate_trace"))
    want = {(8, 9): False, (9, 0): True, (10, 0): True, (12, 0): False}
    assert {tuple(g["sm"]): g["sglang_applies_32"] for g in rows} == want, rows
    for g in rows:
        assert g["fastverify_reach"] == g["registry_reachable"] == g["sglang_applies_32"], g
        assert g["sglang_applies_4096"] is False  # above FUSE_ALLREDUCE_MAX_BATCH_SIZE: never fused
        if not g["sglang_applies_32"]:
            assert f"SM{g['sm'][0]}{g['sm'][1]}" in g["fastverify_why"], g


def test_workspace_sizing_matches_sglangs_own(probe):
    """Item 7: SGLang's PcieIpcCommunicator._ensure_workspace (max_rows = widest decode, hidden from
    the first tensor) and fastverify's record-based size agree: max_batch x draft_tokens x hidden."""
    rows = probe["static"]["sizing"]["rows"]
    assert len(rows) == 4
    for g in rows:
        assert g["built"] and g["sglang_max_numel"] == g["sglang_kw_max_numel"] == g["fastverify_max_numel"], g
        assert g["fastverify_max_numel"] == g["max_batch"] * g["draft"] * g["hidden"], g
        assert g["sglang_tune_batches"][-1] == g["max_batch"] * g["draft"], g


# --- issue 9, What to build 4: b12x at the layer boundary's add-norm (SGLang has no switch for it) ---


def test_b12x_hooks_the_real_layer_boundary_and_uninstall_restores(probe):
    """The add-norm targets resolve in the real 0.5.23 modules (module-level functions of
    layer_boundary/fusions/allreduce.py), are replaced there and restored by identity. Before this,
    FASTVERIFY_BACKEND=b12x applied nothing but the rank line (skipped=add_norm)."""
    st = probe["static"]
    for key in ("add_norm_ffn", "add_norm_attn"):
        assert st["targets_found"][key]["ok"], st["targets_found"][key]
    b = st["b12x"]
    assert b["applied"] == ["add_norm_ffn", "add_norm_attn", "pre_capture"] and b["skipped"] == {}, b
    assert sorted(b["changed_in_class_dict"]) == sorted(["add_norm_attn", "add_norm_ffn", "pre_capture", *CHANGED]), b
    assert b["uninstalled"] == 3 + N_COUNT_WRAPS and b["restored_identity"], b


def _b12x_rows(probe):
    rows = [r["b12x"] for r in _ranks(probe)]
    assert all(rows), [r.get("steps") for r in _ranks(probe)]
    return rows


def test_b12x_on_sm120_builds_from_the_real_coordinator_and_matches_sglangs_own_path(probe):
    """On the real 2-rank gloo TP group, with SGLang's override_platform saying SM120: the rank step
    builds the slot from the real TP GroupCoordinator (gloo standing in for b12x, on its device
    group, first result checked and voted), and SGLang's real _reduce_update_read (FFN input) and
    _run_entry (attention input) -- with the candidates a model built after the patch binds -- do
    exactly one all-reduce per call and give SGLang's own (unpatched) result: through the slot up to
    36 rows, through SGLang's own all-reduce + norm above (37, 64)."""
    for rank, b in enumerate(_b12x_rows(probe)):
        for row in (r for r in b["sms"] if r["sm"] == [12, 0]):
            assert row["applied"] == ["add_norm_ffn", "add_norm_attn", "pre_capture"] and row["skipped"] == {}, row
            assert row["built"]["add_norm"].startswith("gloo (world 2, gloo, single node"), row
            assert row["backend"] == "gloo" and row["on_tp_device_group"] and row["checked"], row
            assert row["disabled"] is None and row["ranks"] == [0, 1] and row["attn_is_tp"], row
            seen = {(c["rows"], c["path"]) for c in row["cases"]}
            assert seen == {(n, p) for n in (1, 4, 36, 37, 64) for p in ("ffn", "attn")}, seen
            for c in row["cases"]:
                assert c["ref_all_reduces"] == 1 and c["all_reduces"] == 1, c
                assert (c["via_backend"] > 0) == (c["rows"] <= 36), c  # above 36 rows: SGLang's path
                assert c["res_equal"] and c["input_residual_untouched"] and c["residual_fresh"], c
                if row["dtype"] == "float32" or c["rows"] > 36:
                    assert c["out_equal"], c  # the same arithmetic, bit for bit
                else:  # bf16: fastverify norms the rounded residual (as the fused kernel reads it)
                    assert c["out_err"] <= 2**-5, c  # at most one bf16 step (|out| < 8)
                # and SGLang's own path is the independent torch sum + add + RMSNorm
                assert c["ref_res_err"] == 0.0 and c["ref_out_err"] <= (0.0 if row["dtype"] == "float32" else 2**-5), c
        line = (
            f"fastverify patch [TP {rank}]: backend=b12x applied=add_norm_ffn,add_norm_attn,pre_capture "
            "built=add_norm=gloo"
        )
        assert sum(ln.startswith(line) for ln in _ranks(probe)[rank]["lines"]) == 2  # fp32 and bf16 runs


def test_b12x_slot_stays_out_of_the_way_off_sm120(probe):
    """SM90/SM100 (SGLang's own FlashInfer fusion owns the boundary there) and SM89 (b12x does not
    run): the rank step builds nothing and says why; the boundary is SGLang's own, bit for bit, with
    one all-reduce per call."""
    for b in _b12x_rows(probe):
        for row in (r for r in b["sms"] if r["sm"] != [12, 0]):
            assert row["install_applied"] == ["add_norm_ffn", "add_norm_attn", "pre_capture"], row
            assert row["applied"] == ["pre_capture"] and row["built"] == {} and row["backend"] is None, row
            why = row["skipped"]["add_norm"]
            if row["sm"] == [8, 9]:
                assert why == "b12x runs only on SM120/SM121 (FlashInfer b12x is_supported); this GPU is SM89", row
            else:
                assert why.startswith("SGLang's own FlashInfer all-reduce fusion owns the layer boundary here"), row
                assert f"this GPU is SM{row['sm'][0]}{row['sm'][1]}" in why and "b12x stays out of the way" in why
            for c in row["cases"]:
                assert c["all_reduces"] == c["ref_all_reduces"] == 1 and c["via_backend"] == 0, c
                assert c["out_equal"] and c["res_equal"] and c["input_residual_untouched"], c


def test_b12x_gate_under_sglangs_own_platform_override(probe):
    """In one process, add_norm reloaded under SGLang's override_platform for each described GPU and
    a FlashInfer fusion backend published: the patch reads the SM from SGLang's own platform facts;
    SM120 is reached; on SM90/SM100 SGLang's gate holds and the wrapped fused_ffn_input still calls
    SGLang's own fusion (norm.forward_with_allreduce_fusion, recorded); on SM89 neither runs."""
    rows = {tuple(g["sm"]): g for g in probe["gate"]["rows"]}
    for sm, g in rows.items():
        b = g["b12x"]
        assert tuple(b["platform_sm"]) == sm, b
        assert b["reach"] is (sm == (12, 0)), b
    assert rows[(12, 0)]["b12x"]["why"].startswith("this GPU is SM120: SGLang's FlashInfer fusion does not apply")
    for sm in ((9, 0), (10, 0)):
        b = rows[sm]["b12x"]
        assert "flashinfer_ar_fusion_applies(1) holds" in b["skipped"]["add_norm"], b
        assert b["hook_installed"] and b["sglang_own_fusion_called"] and b["applied"] == ["pre_capture"], b
    b = rows[(8, 9)]["b12x"]
    assert b["hook_installed"] and not b["sglang_own_fusion_called"] and b["returned_none"], b
    assert "this GPU is SM89" in b["skipped"]["add_norm"], b
