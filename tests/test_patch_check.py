"""`fastverify patch --check` on an unpacked SGLang 0.5.23 wheel (from FASTVERIFY_SGLANG_WHEEL, which
.ci/run downloads) and on deliberately changed copies of it: read with ast, never imported."""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

import pytest
from conftest import run_fastverify

NEEDED = ("sglang/srt/", "sglang/version.py", "sglang/_version.py")


@pytest.fixture(scope="module")
def sglang_tree(tmp_path_factory) -> Path:
    whl = os.environ.get("FASTVERIFY_SGLANG_WHEEL")
    if not whl or not Path(whl).is_file():
        pytest.skip("FASTVERIFY_SGLANG_WHEEL not set: no SGLang 0.5.23 source to check against")
    root = tmp_path_factory.mktemp("sgl")
    with zipfile.ZipFile(whl) as z:
        z.extractall(root, [n for n in z.namelist() if n.startswith(NEEDED) and n.endswith(".py")])
    return root


def _copy(tree: Path, dest: Path) -> Path:
    import shutil

    shutil.copytree(tree / "sglang", dest / "sglang")
    return dest


def test_real_source_every_target_resolves(sglang_tree, tmp_path):
    proc = run_fastverify(["patch", "--check", "--sglang-source", str(sglang_tree)], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SGLang 0.5.23 at" in proc.stdout
    assert "11 of 11 targets resolve"  # 6 backend + 5 counting targets in proc.stdout
    assert "switch (SGLANG_ENABLE_PCIE_IPC_ALLREDUCE): present" in proc.stdout
    assert "route: " in proc.stdout
    # the b12x hook point: the layer boundary's add-norm candidates, module-level functions
    assert (
        "found     add_norm_ffn  sglang.srt.layers.layer_boundary.fusions.allreduce.fused_ffn_input: "
        "allreduce.py:" in proc.stdout
    ), proc.stdout
    assert (
        "found     add_norm_attn sglang.srt.layers.layer_boundary.fusions.allreduce.fused_attn_input: "
        "allreduce.py:" in proc.stdout
    ), proc.stdout


def test_changed_copy_is_reported_and_skipped(sglang_tree, tmp_path):
    tree = _copy(sglang_tree, tmp_path / "changed")
    norm = tree / "sglang" / "srt" / "layers" / "layernorm.py"
    text = norm.read_text()
    assert "def forward_with_allreduce_fusion(" in text
    norm.write_text(text.replace("def forward_with_allreduce_fusion(", "def forward_with_allreduce_fusion_v2(", 1))
    worker = tree / "sglang" / "srt" / "managers" / "tp_worker.py"
    w = worker.read_text()
    worker.write_text(w.replace("is_verify", "is_target_verify"))
    fus = tree / "sglang" / "srt" / "layers" / "layer_boundary" / "fusions" / "allreduce.py"
    f = fus.read_text()
    assert "    keep_bf16: bool,\n) -> Optional" in f
    fus.write_text(f.replace("    keep_bf16: bool,\n) -> Optional", "    keep_fp16: bool,\n) -> Optional", 1))
    proc = run_fastverify(["patch", "--check", "--sglang-source", str(tree)], cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "different add_norm_attn" in proc.stdout and "has no parameter 'keep_bf16'" in proc.stdout
    assert "found     add_norm_ffn" in proc.stdout
    assert "missing   fused_norm" in proc.stdout and "RMSNorm has no forward_with_allreduce_fusion" in proc.stdout
    assert "different verify_timer" in proc.stdout and "has no parameter 'is_verify'" in proc.stdout
    assert "found     all_reduce" in proc.stdout
    assert (
        "10 of 13 targets resolve" in proc.stdout
    )  # all_reduce, pre_capture, add_norm_ffn, the 7 counting ones untouched


def test_not_a_source_tree(tmp_path):
    proc = run_fastverify(["patch", "--check", "--sglang-source", str(tmp_path)], cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "no SGLang source" in proc.stderr
