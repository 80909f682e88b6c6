"""``fastverify collect``'s P2P part against the real output of the P2P check: the version-2
document ``python -m fastverify.topo.p2p check`` prints (its real ``main``, with stand-in pair
children: this box has no GPU), counted as passed, failed and timed out; and the per-pair time
collect gives, never under what a side process needs to import torch."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from fastverify.bounds import MIN_P2P_SIDE_S
from fastverify.collect import parts
from fastverify.collect.core import Child, Context, Shapes
from fastverify.topo import p2p

KEY = {
    "gpus": [["NVIDIA GeForce RTX 4090", f"00000000:{k}8:00.0"] for k in range(4)],
    "driver": "x",
    "cuda_visible_devices": None,
    "cuda_device_order": None,
}

# Stand-in pair child: direction (J, I) fails when I == 0, and the pair (2, 3) hangs.
CHILD = """
import json, sys, time
I, J, OUT = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
if (I, J) == (2, 3):
    time.sleep(600)
rows = [{"src": I, "dst": J, "ok": True, "reason": "fine"},
        {"src": J, "dst": I, "ok": I != 0, "reason": "fine" if I else "read back zeros"}]
json.dump({"results": rows}, open(OUT, "w"))
"""


def _real_check_output(tmp_path: Path, monkeypatch, capsys) -> bytes:
    """What `python -m fastverify.topo.p2p check` prints on a 4-GPU box where the children are CHILD."""
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(CHILD))
    monkeypatch.setattr(p2p, "gpu_count_or_fail", lambda: 4)
    monkeypatch.setattr(
        p2p,
        "gpu_identities",
        lambda: [
            {"cuda": k, "index": k, "pci_bus_id": f"00000000:{k}8:00.0", "uuid": f"GPU-{k}", "name": "x"}
            for k in range(4)
        ],
    )
    monkeypatch.setattr(p2p, "box_key", lambda: KEY)
    monkeypatch.setattr(
        p2p,
        "default_child_argv",
        lambda timeout_s: lambda i, j, out: [sys.executable, str(script), str(i), str(j), str(out)],
    )
    monkeypatch.setattr(p2p, "MIN_TIMEOUT_S", 1.0)  # the stand-in children need no torch import
    rc = p2p.main(["check", "--timeout", "3", "--cache-dir", str(tmp_path / "cache")])
    out, err = capsys.readouterr()
    assert rc == 1 and "2 timed out" in err, err
    return out.encode()


def test_collect_counts_the_failures_and_timeouts_of_the_real_check_output(tmp_path, monkeypatch, capsys):
    printed = _real_check_output(tmp_path, monkeypatch, capsys)
    doc = json.loads(printed)
    assert doc["schema"] == "fastverify.p2p_check" and doc["version"] == 2  # the dict, not a bare list
    # Worked out from CHILD: 6 pairs, 12 directions; (1,0), (2,0), (3,0) fail; (2,3), (3,2) time out.
    seen = []

    def fake_run_child(argv, **kw):
        seen.append(argv)
        return Child(1, printed, b"", 1.0)

    monkeypatch.setattr(parts, "run_child", fake_run_child)
    ctx = Context(workdir=tmp_path, shapes=Shapes(4, 4, 7168, (1,), {}), gpus=4, quiet=True)
    out = parts.p2p_check(ctx, 600.0)
    assert out.status == "ok", out.reason
    assert (out.meta["passed_directions"], out.meta["failed_directions"], out.meta["timed_out_directions"]) == (7, 3, 2)
    assert seen[0][1:4] == ["-m", "fastverify.topo.p2p", "check"]


@pytest.mark.parametrize("gpus, limit_s", [(8, 30.0), (8, 120.0), (2, 10.0), (4, 600.0), (8, 3600.0)])
def test_collect_never_gives_a_side_less_than_a_torch_import(tmp_path, monkeypatch, gpus, limit_s):
    seen = []
    monkeypatch.setattr(parts, "run_child", lambda argv, **kw: seen.append(argv) or Child(None, b"", b"", limit_s))
    ctx = Context(workdir=tmp_path, shapes=Shapes(gpus, 4, 7168, (1,), {}), gpus=gpus, quiet=True)
    parts.p2p_check(ctx, limit_s)
    per_pair = float(seen[0][seen[0].index("--timeout") + 1])
    side = float(p2p.default_child_argv(per_pair)(0, 1, tmp_path / "x.json")[-1])  # the pair child's own rule
    assert side >= MIN_P2P_SIDE_S >= 22.0  # 22 s: the slowest cold `import torch` bounds.py cites
    assert per_pair <= p2p.DEFAULT_TIMEOUT_S
    p2p.check_timeout(per_pair)  # and `check` takes it
