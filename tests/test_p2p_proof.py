"""The P2P proof is bound to the box (P2P issue, item 1).

A check that only counted passing directions "proved" P2P for any box: 56 passing rows about
GPUs 50-57 let ``launch`` deploy ``pcie_ipc`` on a box with GPUs 0-7, the partial-P2P start-up hang
the gate exists to prevent. Now the check file names the GPUs it tested (NVML index, PCI bus id,
UUID, and the CUDA_VISIBLE_DEVICES it ran under), and ``launch`` accepts it only when every GPU of
its TP group is one the check tested (by UUID, else PCI address) and every ordered pair ``(i, j)``,
``i != j``, of the group passed: ``world x (world - 1)`` directions, checked pair by pair, so one
fewer is refused, and so is the right count with a wrong pair. Old files and old records (no GPU
identities) prove nothing and say to rerun the check.

Expected values come from the rule itself (ordered pairs of a TP group), never from fastverify's
own helpers; GPUs are described (``plan_launch(box=...)``, ``--describe-box``) or a stand-in NVML.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import SGLANG_0523, SHARED, assert_user_error, cli, pin_pcie_ipc, run_fastverify

from fastverify.deploy import (
    BoxFingerprint,
    DeploymentRecord,
    GpuId,
    P2PFacts,
    VerifyShapes,
    encode_record,
    read_record,
    record_path_for,
)
from fastverify.errors import UserError
from fastverify.patch import launch as L
from fastverify.registry import BackendName
from fastverify.topo import gpu_identity as G, p2p as P, p2p_proof as PF

NVML_GPUS = G.nvml_gpus  # the real reader, before any test stands in for it
SGL = SGLANG_0523
NAME = "NVIDIA RTX PRO 6000 Blackwell Server Edition"


def gpu(i: int, box: str = "a") -> GpuId:
    """GPU ``i`` of box ``box``: its own bus id and UUID (another box's GPU 0 has others)."""
    tag = {"a": 0x10, "b": 0x80}[box]
    return GpuId(
        index=i, pci_bus_id=f"00000000:{tag + i:02X}:00.0", uuid=f"GPU-{box * 8}-{i:04x}-4000-8000-{i:012x}", name=NAME
    )


BOX_A = tuple(gpu(i) for i in range(8))
BOX_B = tuple(gpu(i, "b") for i in range(8))


def box(gpus=BOX_A, tp=8, **kw) -> BoxFingerprint:
    return BoxFingerprint(gpu_name=NAME, sm=(12, 0), gpu_count=len(gpus), tp=tp, gpus=tuple(gpus), **kw)


def pairs(ordinals):
    return [(i, j) for i in ordinals for j in ordinals if i != j]


def check_file(path: Path, gpus=BOX_A, rows=None, *, ordinals=None, failing=(), cvd=None) -> Path:
    """A file as `fastverify p2p` writes it: ``gpus`` at CUDA ordinals
    ``ordinals`` (default 0..n-1), and ``rows`` (default every ordered pair, passing)."""
    ordinals = list(range(len(gpus))) if ordinals is None else list(ordinals)
    rows = pairs(ordinals) if rows is None else rows
    doc = {
        "schema": "fastverify.p2p_check",
        "version": 2,
        "cuda_visible_devices": cvd,
        "cuda_device_order": None,
        "gpus": [
            {"cuda": k, "index": g.index, "pci_bus_id": g.pci_bus_id, "uuid": g.uuid, "name": g.name}
            for k, g in zip(ordinals, gpus)
        ],
        "results": [
            {
                "src": i,
                "dst": j,
                "ok": (i, j) not in failing,
                "reason": "ok" if (i, j) not in failing else "read back zeros",
            }
            for i, j in rows
        ],
    }
    path.write_text(json.dumps(doc))
    return path


def cmd(tp=8, *extra):
    return ["python", "-m", "sglang.launch_server", "--model-path", "M", "--tp-size", str(tp), *extra]


def digest(folder: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def plan(p2p_file, b=None, tp=8, extra=(), **kw):
    return L.plan_launch(
        None,
        "pcie_ipc",
        None,
        cmd(tp, *extra),
        environ=kw.pop("environ", {}),
        sglang=SGL,
        box=b or box(tp=tp),
        p2p_file=p2p_file,
        **kw,
    )


# --- the boundary: world x (world - 1) ordered pairs, each one ----------------------------------------


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_every_ordered_pair_of_the_tp_group_proves_it(tmp_path, tp):
    f = check_file(tmp_path / "p2p.json", BOX_A[:tp])
    before = digest(tmp_path)
    pl = plan(f, box(BOX_A[:tp], tp=tp), tp=tp)
    assert pl.p2p.proven and pl.p2p.pairs == tp * (tp - 1) and pl.p2p.gpus == BOX_A[:tp]
    assert pl.env["SGLANG_ENABLE_PCIE_IPC_ALLREDUCE"] == "1"
    assert digest(tmp_path) == before


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_one_direction_fewer_is_refused_naming_the_file(tmp_path, tp):
    rows = pairs(range(tp))
    dropped = rows.pop(len(rows) // 2)  # world x (world - 1) - 1 passing directions
    f = check_file(tmp_path / "p2p.json", BOX_A[:tp], rows)
    before = digest(tmp_path)
    with pytest.raises(UserError) as e:
        plan(f, box(BOX_A[:tp], tp=tp), tp=tp)
    msg = str(e.value)
    assert msg.startswith(f"{f}: the P2P check misses direction {dropped}") and "\n" not in msg
    assert f"TP {tp} needs all {tp * (tp - 1)} ordered pairs" in msg
    assert digest(tmp_path) == before


def test_the_right_count_with_a_pair_given_twice_is_refused(tmp_path):
    rows = pairs(range(8))
    rows[rows.index((7, 6))] = (0, 1)  # 56 rows, (0, 1) twice, (7, 6) missing
    assert len(rows) == 8 * 7
    f = check_file(tmp_path / "p2p.json", rows=rows)
    with pytest.raises(UserError) as e:
        plan(f)
    msg = str(e.value)
    assert msg.startswith(f"{f}: direction (0, 1) is given twice") and "\n" not in msg


def test_the_right_count_with_a_pair_outside_the_tp_group_is_refused(tmp_path):
    """9 GPUs, TP 8 on GPUs 0-7: 55 of the group's pairs plus (0, 8) make 56 rows, and prove nothing
    about (7, 6)."""
    nine = tuple(gpu(i) for i in range(9))
    rows = [p for p in pairs(range(8)) if p != (7, 6)] + [(0, 8)]
    assert len(rows) == 8 * 7
    f = check_file(tmp_path / "p2p.json", nine, rows)
    with pytest.raises(UserError) as e:
        plan(f, box(nine))
    assert str(e.value).startswith(f"{f}: the P2P check misses direction (7, 6)")


def test_a_failed_direction_of_the_group_fails_but_one_outside_it_does_not_count(tmp_path):
    with pytest.raises(UserError, match=r"^pcie_ipc: needs P2P between every GPU pair and it fails"):
        plan(check_file(tmp_path / "bad.json", failing={(3, 5)}))
    # TP 4 on GPUs 0-3 of an 8-GPU box: a failure between GPUs 6 and 7 is not this group's
    ok = plan(check_file(tmp_path / "other.json", failing={(6, 7)}), box(tp=4), tp=4)
    assert ok.p2p.proven and ok.p2p.pairs == 12


# --- the GPUs must be this box's ---------------------------------------------------------------------


def test_a_check_of_another_boxs_gpus_is_refused(tmp_path):
    f = check_file(tmp_path / "p2p.json", BOX_B)  # 56 passing directions, other GPUs
    with pytest.raises(UserError) as e:
        plan(f)
    msg = str(e.value)
    assert msg.startswith(f"{f}: the P2P check did not test GPU 0 (0000:10:00.0), TP rank 0's GPU on this box")
    assert "0000:80:00.0" in msg and "\n" not in msg


def test_the_issues_gpus_50_to_57_are_refused_in_both_forms(tmp_path):
    # new form: the check ran where CUDA ordinals 50..57 were other GPUs
    f = check_file(tmp_path / "p2p.json", BOX_B, ordinals=range(50, 58))
    with pytest.raises(UserError, match=f"^{f}: the P2P check did not test GPU 0"):
        plan(f)
    # old form (a bare result list, as before): it names no GPU, so it proves nothing
    old = tmp_path / "old.json"
    old.write_text(json.dumps([{"src": i, "dst": j, "ok": True, "reason": "ok"} for i, j in pairs(range(50, 58))]))
    with pytest.raises(UserError) as e:
        plan(old)
    assert str(e.value) == (
        f"{old}: this P2P check names no GPU (written before the check recorded which GPUs it "
        "tested), so it cannot show they are this box's: rerun `fastverify p2p --output FILE` "
        "on this box"
    )


def test_an_old_file_of_this_box_is_refused_too_and_the_old_cache_file(tmp_path):
    old = tmp_path / "old.json"
    old.write_text(json.dumps([{"src": i, "dst": j, "ok": True, "reason": "ok"} for i, j in pairs(range(8))]))
    with pytest.raises(UserError, match="names no GPU.*rerun `fastverify p2p"):
        plan(old)
    cache = tmp_path / "cache.json"
    cache.write_text(json.dumps({"schema_version": 1, "results": json.loads(old.read_text())}))
    with pytest.raises(UserError, match="names no GPU"):
        plan(cache)


def test_the_gpus_are_matched_by_uuid_else_pci_never_by_index(tmp_path):
    by_pci = tuple(GpuId(index=g.index, pci_bus_id=g.pci_bus_id) for g in BOX_A)  # NVML gave no UUID
    assert plan(check_file(tmp_path / "a.json", by_pci)).p2p.proven
    by_uuid = tuple(GpuId(index=7 - g.index, uuid=g.uuid.lower()) for g in BOX_A)  # other index, same GPU
    assert plan(check_file(tmp_path / "b.json", by_uuid)).p2p.proven
    same_index = tuple(GpuId(index=g.index, pci_bus_id=g.pci_bus_id, uuid=h.uuid) for g, h in zip(BOX_A, BOX_B))
    with pytest.raises(UserError, match="did not test GPU 0"):  # same bus ids, other UUIDs: other GPUs
        plan(check_file(tmp_path / "c.json", same_index))


def test_the_tp_group_starts_at_base_gpu_id(tmp_path):
    """SGLang puts TP rank r on base_gpu_id + r x gpu_id_step (entrypoints/engine.py)."""
    four = check_file(tmp_path / "low.json", BOX_A[:4])
    assert plan(four, box(tp=4), tp=4).p2p.proven
    with pytest.raises(UserError, match="did not test GPU 4 .*TP rank 0's GPU"):
        plan(four, box(tp=4), tp=4, extra=("--base-gpu-id", "4"))
    assert plan(check_file(tmp_path / "all.json"), box(tp=4), tp=4, extra=("--base-gpu-id", "4")).p2p.proven
    with pytest.raises(UserError, match="did not test GPU 4 .*TP rank 2's GPU"):  # step 2: GPUs 0, 2, 4, 6
        plan(four, box(tp=4), tp=4, extra=("--gpu-id-step", "2"))


def test_a_box_whose_gpus_are_unknown_cannot_be_proven(tmp_path):
    f = check_file(tmp_path / "p2p.json")
    with pytest.raises(UserError) as e:
        plan(f, BoxFingerprint(gpu_name=NAME, sm=(12, 0), gpu_count=8, tp=8))
    assert str(e.value).startswith(f"{f}: cannot tell whether the P2P check tested this box's GPUs")


def test_nothing_needs_p2p_the_file_is_still_read(tmp_path):
    f = check_file(tmp_path / "p2p.json", BOX_B)
    pl = L.plan_launch(None, "nccl", None, cmd(), environ={}, sglang=SGL, box=box(), p2p_file=f)
    assert any("nothing in this plan needs P2P" in n for n in pl.notes)
    dup = check_file(tmp_path / "dup.json", rows=pairs(range(8)) + [(0, 1)])
    with pytest.raises(UserError, match="given twice"):
        L.plan_launch(None, "nccl", None, cmd(), environ={}, sglang=SGL, box=box(), p2p_file=dup)


# --- the record's proof is bound the same way ---------------------------------------------------------


def _record(tmp_path, p2p, name="r"):
    env = tmp_path / f"{name}.env"
    env.write_text("NCCL_P2P_LEVEL=SYS\n")
    rec = DeploymentRecord(
        backend=BackendName.pcie_ipc,
        shapes=VerifyShapes(32, 4, 7168),
        p2p=p2p,
        box=BoxFingerprint(gpu_name=NAME, sm=(12, 0), gpu_count=8, tp=8),
        sglang_version="0.5.23",
    )
    record_path_for(env).write_bytes(encode_record(rec))
    return env


@pytest.mark.parametrize(
    "gpus, ok, words",
    [
        (BOX_A, True, ""),
        ((), False, "names no GPU (a record written before the check recorded which GPUs it tested)"),
        (BOX_B, False, "did not test GPU 0 (0000:10:00.0) of this TP group"),
        (BOX_A[:4], False, "did not test GPU 4"),
    ],
)
def test_a_records_proof_must_name_this_tp_groups_gpus(tmp_path, gpus, ok, words):
    env = _record(tmp_path, P2PFacts(ok=True, source="p2p_check", note="all passed", pairs=56, gpus=gpus))
    before = digest(tmp_path)
    if ok:
        pl = L.plan_launch(str(env), "auto", None, cmd(), environ={}, sglang=SGL, box=box())
        assert pl.env["SGLANG_ENABLE_PCIE_IPC_ALLREDUCE"] == "1"
    else:
        with pytest.raises(UserError) as e:
            L.plan_launch(str(env), "auto", None, cmd(), environ={}, sglang=SGL, box=box())
        msg = str(e.value)
        assert msg.startswith("pcie_ipc: needs P2P between every GPU pair and it is not proven") and words in msg
        assert "--p2p-check FILE" in msg and "\n" not in msg
        # the check file of this box proves it instead
        pl = L.plan_launch(
            str(env), "auto", None, cmd(), environ={}, sglang=SGL, box=box(), p2p_file=check_file(tmp_path / "p2p.json")
        )
        assert pl.p2p.proven
        (tmp_path / "p2p.json").unlink()
    assert digest(tmp_path) == before


def test_an_old_record_without_gpus_still_reads(tmp_path):
    """Records written before P2PFacts.gpus / BoxFingerprint.gpus decode (the fields default)."""
    env = _record(tmp_path, P2PFacts(ok=True, source="p2p_check", pairs=56))
    doc = json.loads(record_path_for(env).read_text())
    del doc["p2p"]["gpus"], doc["box"]["gpus"], doc["box"]["gpu_memory_bytes"]
    record_path_for(env).write_text(json.dumps(doc))
    rec = read_record(record_path_for(env))
    assert rec.p2p.gpus == () and rec.box.gpus is None


# --- the check file: what `check` prints, and reading it --------------------------------------------


class FakeNvml:
    """pynvml's names and return shapes (nvidia-ml-py), for GPUs ``gpus``."""

    class NVMLError(Exception):
        pass

    def __init__(self, gpus, mem=(48 << 30)):
        self.gpus, self.mem = list(gpus), mem

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        pass

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetPciInfo(self, h):
        return SimpleNamespace(busId=self.gpus[h].pci_bus_id.encode())

    def nvmlDeviceGetUUID(self, h):
        return self.gpus[h].uuid

    def nvmlDeviceGetName(self, h):
        return self.gpus[h].name

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(total=self.mem, free=self.mem, used=0)


class FakeTorch:
    """``torch.cuda`` of a process that sees NVML GPUs ``order`` as ordinals 0, 1, ...; torch's
    UUID has no "GPU-" prefix and its PCI address is three integers."""

    def __init__(self, order, uuid=True):
        def props(k):
            g = BOX_A[order[k]]
            bus = int(g.pci_bus_id.split(":")[1], 16)
            return SimpleNamespace(
                name=g.name, uuid=g.uuid[4:] if uuid else None, pci_domain_id=0, pci_bus_id=bus, pci_device_id=0
            )

        self.cuda = SimpleNamespace(device_count=lambda: len(order), get_device_properties=props)


@pytest.mark.parametrize("uuid", [True, False])
def test_check_names_each_cuda_ordinal_as_nvml_does(tmp_path, uuid):
    ids = P.gpu_identities(nvml=FakeNvml(BOX_A), torch_mod=FakeTorch([4, 5, 6, 7], uuid=uuid))
    assert [(g["cuda"], g["index"], g["uuid"], g["pci_bus_id"]) for g in ids] == [
        (k, 4 + k, BOX_A[4 + k].uuid, BOX_A[4 + k].pci_bus_id) for k in range(4)
    ]
    results = {(i, j): P.P2PResult(True, "ok") for i, j in pairs(range(4))}
    doc = P.check_document(results, ids, environ={"CUDA_VISIBLE_DEVICES": "4,5,6,7"})
    assert (doc["schema"], doc["version"], doc["cuda_visible_devices"]) == ("fastverify.p2p_check", 2, "4,5,6,7")
    f = tmp_path / "p2p.json"
    f.write_text(json.dumps(doc))
    check = PF.read_check_file(f)
    assert [check.gpus[k].same_gpu(BOX_A[4 + k]) for k in range(4)] == [True] * 4
    # the server runs with the same CUDA_VISIBLE_DEVICES: its ordinals 0..3 are those GPUs
    assert plan(f, box(BOX_A[4:], tp=4), tp=4).p2p.proven


def test_the_check_command_prints_the_gpus_and_caches_them(tmp_path, monkeypatch, capsys):
    """`fastverify p2p` end to end with the CUDA parts stood in for."""
    ids = P.gpu_identities(nvml=FakeNvml(BOX_A), torch_mod=FakeTorch(list(range(8))))
    monkeypatch.setattr(P, "gpu_count_or_fail", lambda: 8)
    monkeypatch.setattr(P, "gpu_identities", lambda: ids)
    seen = {}

    def fake_check(**kw):
        seen.update(kw)
        return {(i, j): P.P2PResult(True, "ok") for i, j in pairs(range(8))}

    monkeypatch.setattr(P, "check_p2p", fake_check)
    assert P.main(["check", "--cache-dir", str(tmp_path)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["gpus"] == ids and len(doc["results"]) == 56 and seen["gpus"] == ids
    f = tmp_path / "p2p.json"
    f.write_text(json.dumps(doc))
    assert plan(f).p2p.proven


def test_the_cache_file_with_gpus_proves_like_the_output(tmp_path):
    key = {
        "gpus": [[g.name, g.pci_bus_id] for g in BOX_A],
        "driver": "x",
        "cuda_visible_devices": None,
        "cuda_device_order": None,
    }
    ids = [
        {"cuda": k, "index": g.index, "pci_bus_id": g.pci_bus_id, "uuid": g.uuid, "name": g.name}
        for k, g in enumerate(BOX_A)
    ]
    path = tmp_path / "cache.json"
    P.write_cache(path, key, {(i, j): P.P2PResult(True, "ok") for i, j in pairs(range(8))}, ids)
    assert P.read_cache(path, key)  # still the cache
    assert plan(path).p2p.proven


@pytest.mark.parametrize(
    "doc, words",
    [
        ({"schema": "other", "version": 2, "results": [{"src": 0, "dst": 1, "ok": True}]}, ["not a P2P check"]),
        (
            {"schema": "fastverify.p2p_check", "version": 3, "results": [{"src": 0, "dst": 1, "ok": True}]},
            ["version 3"],
        ),
        (
            {"gpus": [{"cuda": 0, "uuid": "GPU-x"}], "results": [{"src": 0, "dst": 1, "ok": True}]},
            ["CUDA ordinal 1", "does not name"],
        ),
        (
            {"gpus": [{"cuda": 0, "index": 0}], "results": [{"src": 0, "dst": 1, "ok": True}]},
            ["GPU 0", "uuid or a PCI"],
        ),
        (
            {
                "gpus": [{"cuda": 0, "uuid": "GPU-x"}, {"cuda": 1, "uuid": "gpu-X"}],
                "results": [{"src": 0, "dst": 1, "ok": True}],
            },
            ["named for two CUDA ordinals"],
        ),
        ({"gpus": [{"uuid": "GPU-x"}], "results": [{"src": 0, "dst": 1, "ok": True}]}, ["own CUDA ordinal"]),
        ([{"src": 0, "dst": 1, "ok": True}, {"src": 0, "dst": 1, "ok": False}], ["(0, 1) is given twice"]),
    ],
)
def test_malformed_check_files_are_refused_in_one_line(tmp_path, doc, words):
    f = tmp_path / "p2p.json"
    f.write_text(json.dumps(doc))
    with pytest.raises(UserError) as e:
        PF.read_check_file(f)
    msg = str(e.value)
    assert msg.startswith(str(f)) and "\n" not in msg
    for w in words:
        assert w in msg, (w, msg)


# --- which GPUs a command sees: NVML mapped through CUDA_VISIBLE_DEVICES -------------------------------


def _rows(gpus):
    return [
        {"index": g.index, "pci_bus_id": g.pci_bus_id, "uuid": g.uuid, "name": g.name, "memory_bytes": 1} for g in gpus
    ]


@pytest.mark.parametrize(
    "env, want",
    [
        ({}, list(range(8))),
        ({"CUDA_VISIBLE_DEVICES": "4,5,6,7"}, [4, 5, 6, 7]),
        ({"CUDA_VISIBLE_DEVICES": "3,1"}, [3, 1]),
        ({"CUDA_VISIBLE_DEVICES": f"{BOX_A[6].uuid[:17]},{BOX_A[2].uuid}"}, [6, 2]),  # a unique UUID prefix
    ],
)
def test_visible_gpus_follow_cuda_visible_devices(env, want):
    rows, why = G.visible_gpus(_rows(BOX_A), env)
    assert [r["index"] for r in rows] == want and why == ""


# CUDA C Programming Guide, "CUDA Environment Variables": parsing stops at the first entry CUDA cannot
# use ("0,2,-1,1" shows GPUs 0 and 2); torch/cuda/__init__.py (_parse_visible_devices) reads it so.
@pytest.mark.parametrize(
    "text, want, entry",
    [
        ("2,9,3", [2], "entry 2 ('9') names no GPU NVML lists here (GPU index 9)"),
        ("0,2,-1,1", [0, 2], "entry 3 ('-1') is not a GPU index"),
        (
            "4,MIG-5e4c1f2a-0f1d-5b7e-9c2a-1d2e3f4a5b6c,5",
            [4],
            "entry 2 ('MIG-5e4c1f2a-0f1d-5b7e-9c2a-1d2e3f4a5b6c') is a MIG instance, not a whole GPU",
        ),
        (f"{BOX_A[6].uuid},1", [6], "entry 2 ('1') is not a GPU UUID, in a list of UUIDs"),
        (f"{BOX_A[6].uuid[:12]},1", [], "matches 8 GPUs"),  # an ambiguous prefix
        ("", [], "entry 1 ('') is not a GPU index"),
    ],
)
def test_visible_gpus_say_where_cuda_stops_reading(text, want, entry):
    rows, why = G.visible_gpus(_rows(BOX_A), {"CUDA_VISIBLE_DEVICES": text})
    assert [r["index"] for r in rows] == want
    seen = ", ".join(f"GPU {i}" for i in want) or "no GPU"
    assert why.startswith(f"CUDA_VISIBLE_DEVICES={text}: ") and entry in why and f"the command sees {seen} " in why
    assert "\n" not in why


def test_visible_gpus_read_only_ascii_digits_and_any_number_of_them():
    """strtoul reads ASCII digits and saturates on a huge index (no GPU has it); an Arabic-Indic
    zero is no digit to CUDA, so it stops there and shows no GPU."""
    rows, why = G.visible_gpus(_rows(BOX_A), {"CUDA_VISIBLE_DEVICES": "\u0660,1"})
    assert rows == [] and "is not a GPU index" in why
    rows, why = G.visible_gpus(_rows(BOX_A), {"CUDA_VISIBLE_DEVICES": "0,1," + "9" * 5000})
    assert [r["index"] for r in rows] == [0, 1] and "names no GPU NVML lists here" in why
    rows, why = G.visible_gpus(_rows(BOX_A), {"CUDA_VISIBLE_DEVICES": "0003,00"})
    assert [r["index"] for r in rows] == [3, 0] and why == ""


def test_a_long_cuda_visible_devices_is_shortened_in_the_line():
    rows, why = G.visible_gpus(_rows(BOX_A), {"CUDA_VISIBLE_DEVICES": "GPU-" + "a" * 100_000})
    assert rows == [] and len(why) < 400 and "(100004 characters)" in why


@pytest.mark.parametrize(
    "text", ["MIG-5e4c1f2a-0f1d-5b7e-9c2a-1d2e3f4a5b6c", f"MIG-{BOX_A[0].uuid}/1/0,MIG-{BOX_A[1].uuid}/2/0"]
)
def test_visible_gpus_of_mig_instances_are_not_whole_gpus(text):
    """MIG instances (both forms, ``MIG-<uuid>`` and ``MIG-<GPU-uuid>/<gi>/<ci>``) are slices of a
    GPU: no P2P proof binds to them, and the reason says so."""
    rows, why = G.visible_gpus(_rows(BOX_A), {"CUDA_VISIBLE_DEVICES": text})
    assert rows is None and "MIG instances" in why and "P2P" in why


def test_visible_gpus_naming_a_gpu_twice_show_none():
    rows, why = G.visible_gpus(_rows(BOX_A), {"CUDA_VISIBLE_DEVICES": "1,3,1"})
    assert rows is None and "names a GPU twice" in why


def test_launch_prints_where_cuda_stopped_reading(tmp_path, monkeypatch):

    monkeypatch.setattr(L, "read_box", lambda tp=0, **k: BoxFingerprint(gpu_name=NAME, sm=(12, 0), gpu_count=8, tp=tp))
    monkeypatch.setattr(L, "nvml_gpus", lambda nvml=None: NVML_GPUS(FakeNvml(BOX_A)))
    monkeypatch.delenv("FASTVERIFY_DESCRIBE_BOX", raising=False)
    pl = L.plan_launch(
        None,
        "pcie_ipc",
        None,
        cmd(2),
        environ={"CUDA_VISIBLE_DEVICES": "4,MIG-x,5"},
        sglang=SGL,
        p2p_file=check_file(tmp_path / "p2p.json"),
        collect_blockers=True,
    )
    assert pl.box.gpus == (BOX_A[4],)  # what CUDA shows the command: GPU 4 alone
    assert any(n.startswith("CUDA_VISIBLE_DEVICES=4,MIG-x,5: entry 2 ('MIG-x') is a MIG instance") for n in pl.notes)


def test_visible_gpus_of_a_mixed_box_need_pci_order():
    mixed = list(BOX_A[:2]) + [GpuId(index=2, pci_bus_id="00000000:40:00.0", uuid="GPU-zz", name="NVIDIA L40S")]
    rows, why = G.visible_gpus(_rows(mixed), {})
    assert rows is None and "CUDA_DEVICE_ORDER" in why
    rows, _ = G.visible_gpus(_rows(mixed), {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"})
    assert [r["index"] for r in rows] == [0, 1, 2]


def test_launch_reads_this_boxs_gpus_from_nvml(tmp_path, monkeypatch):
    """The real-box path: read_box's fingerprint, NVML's identities and memory, the command's
    CUDA_VISIBLE_DEVICES. A check run on all 8 GPUs proves TP 4 on GPUs 4-7; one run on 0-3 does not."""

    monkeypatch.setattr(L, "read_box", lambda tp=0, **k: BoxFingerprint(gpu_name=NAME, sm=(12, 0), gpu_count=8, tp=tp))
    monkeypatch.setattr(L, "nvml_gpus", lambda nvml=None: NVML_GPUS(FakeNvml(BOX_A, 96 << 30)))
    monkeypatch.delenv("FASTVERIFY_DESCRIBE_BOX", raising=False)
    env = {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}
    full = check_file(tmp_path / "all.json")
    pl = L.plan_launch(None, "pcie_ipc", None, cmd(4), environ=env, sglang=SGL, p2p_file=full)
    assert pl.p2p.proven and pl.p2p.gpus == BOX_A[4:]
    assert pl.box.gpus == BOX_A[4:] and pl.box.gpu_memory_bytes == 96 << 30
    with pytest.raises(UserError, match="did not test GPU 4"):
        L.plan_launch(
            None,
            "pcie_ipc",
            None,
            cmd(4),
            environ=env,
            sglang=SGL,
            p2p_file=check_file(tmp_path / "low.json", BOX_A[:4]),
        )
    monkeypatch.setattr(L, "nvml_gpus", lambda nvml=None: [])  # no NVML: nothing to bind the proof to
    with pytest.raises(UserError, match="cannot tell whether the P2P check tested this box's GPUs"):
        L.plan_launch(None, "pcie_ipc", None, cmd(4), environ=env, sglang=SGL, p2p_file=full)


def test_nvml_gpus_reads_identity_and_memory():
    rows = NVML_GPUS(FakeNvml(BOX_A[:2], 24 << 30))
    assert rows == [
        {"index": i, "pci_bus_id": BOX_A[i].pci_bus_id, "uuid": BOX_A[i].uuid, "name": NAME, "memory_bytes": 24 << 30}
        for i in range(2)
    ]

    class Broken(FakeNvml):
        def nvmlInit(self):
            raise self.NVMLError("Driver Not Loaded")

    assert NVML_GPUS(Broken([])) == []


# --- tune keeps the check's GPUs in the record; launch binds them ---------------------------------------


TOPO_307 = SHARED / "inputs" / "topo-nccl-tests-307.txt"


def test_tune_records_the_checked_gpus_and_launch_binds_them(tmp_path, monkeypatch, capsys):
    if not TOPO_307.is_file():
        pytest.skip(f"{TOPO_307} absent (../shared/inputs)")
    (tmp_path / "topo.txt").write_text(TOPO_307.read_text())
    check_file(tmp_path / "p2p.json")
    monkeypatch.chdir(tmp_path)
    pin_pcie_ipc(monkeypatch)  # the packaged data alone leave pcie_ipc unknown: pinned evidence makes it win
    rc, out, err = cli(
        [
            "tune",
            "--predict",
            "--topology",
            "topo.txt",
            "--model",
            "kimi-k2",
            "--tp",
            "8",
            "--sm",
            "120",
            "--max-batch",
            "32",
            "--p2p-check",
            "p2p.json",
            "--write-env",
            "e.env",
        ],
        capsys,
    )
    assert rc == 0, err
    rec = read_record(tmp_path / "e.deploy.json")
    assert rec.backend is BackendName.pcie_ipc and rec.p2p.proven and rec.p2p.gpus == BOX_A
    inputs = digest(tmp_path)

    def described(gpus):
        return json.dumps(
            {
                "gpu_name": None,
                "sm": [12, 0],
                "gpu_count": 8,
                "gpus": [{"index": g.index, "pci_bus_id": g.pci_bus_id, "uuid": g.uuid} for g in gpus],
            }
        )

    ok = run_fastverify(
        ["launch", "--env", "e.env", "--describe-box", described(BOX_A), "--dry-run", "--", *cmd()], cwd=tmp_path
    )
    assert ok.returncode == 0, ok.stderr
    assert "FASTVERIFY_BACKEND=pcie_ipc" in ok.stdout and "P2P: proven (p2p_check" in ok.stdout
    other = run_fastverify(
        ["launch", "--env", "e.env", "--describe-box", described(BOX_B), "--dry-run", "--", *cmd()], cwd=tmp_path
    )
    assert_user_error(other, "pcie_ipc", "is not proven", "did not test GPU 0 (0000:80:00.0)")
    assert digest(tmp_path) == inputs


# --- a timed-out direction is not known, not failed -----------------------------------------------------


def test_a_timed_out_direction_of_the_group_is_unknown_not_failed(tmp_path):
    f = check_file(tmp_path / "p2p.json", BOX_A[:4])
    doc = json.loads(f.read_text())
    for row in doc["results"]:
        if (row["src"], row["dst"]) == (2, 3):
            row.update(ok=False, reason="timeout: no answer within 36 s", timed_out=True)
    f.write_text(json.dumps(doc))
    with pytest.raises(UserError) as e:
        plan(f, box(BOX_A[:4], tp=4), tp=4)
    msg = str(e.value)
    assert "1 of 12 directions of the TP group timed out (no answer in time, not a failure)" in msg
    assert "rerun `fastverify p2p`" in msg and "fails" not in msg and "\n" not in msg
    assert PF.complete_gpus(PF.read_check_file(f)) == ()
    # A real failure beside it still says failed.
    for row in doc["results"]:
        if (row["src"], row["dst"]) == (0, 1):
            row.update(ok=False, reason="read back zeros")
    f.write_text(json.dumps(doc))
    ok, note = PF.proof_for(PF.read_check_file(f), list(BOX_A[:4]))
    assert ok is False and note.startswith("1 of 12 directions of the TP group failed")
    from fastverify.topo.box import p2p_from_results

    late = {(0, 1): P.P2PResult(True, "ok"), (1, 0): P.P2PResult(False, "timeout: x", timed_out=True)}
    facts = p2p_from_results(late)
    assert facts.ok is None and facts.note.startswith("1 of 2 directions timed out (not a failure")


# --- a check of 8 GPUs that tested only GPUs 0-3 proves nothing for the 8 --------------------------------


def test_a_check_naming_8_gpus_testing_12_directions_among_0_to_3_is_not_complete(tmp_path):
    """12 passing directions among GPUs 0-3 in a file that names GPUs 0-7: every ordered pair
    among all of them must be present and passed (complete_gpus), not any of them."""
    f = check_file(tmp_path / "p2p.json", BOX_A, rows=pairs(range(4)))
    check = PF.read_check_file(f)
    assert len(check.results) == 12 and all(r.ok for r in check.results.values()) and len(check.gpus) == 8
    assert PF.complete_gpus(check) == ()
    # the full 56 do prove all 8; one missing direction or one failure does not
    assert PF.complete_gpus(PF.read_check_file(check_file(tmp_path / "all.json"))) == BOX_A
    assert PF.complete_gpus(PF.read_check_file(check_file(tmp_path / "55.json", rows=pairs(range(8))[1:]))) == ()
    assert PF.complete_gpus(PF.read_check_file(check_file(tmp_path / "f.json", failing=[(7, 6)]))) == ()


def test_the_record_of_a_partial_check_proves_nothing_at_launch(tmp_path, monkeypatch, capsys):
    """The record path: `tune --write-env --p2p-check` of the partial file keeps no GPU as proof,
    so launch refuses pcie_ipc on this box's 8 GPUs instead of "all 56 directions passed"."""
    if not TOPO_307.is_file():
        pytest.skip(f"{TOPO_307} absent (../shared/inputs)")
    (tmp_path / "topo.txt").write_text(TOPO_307.read_text())
    check_file(tmp_path / "p2p.json", BOX_A, rows=pairs(range(4)))
    monkeypatch.chdir(tmp_path)
    pin_pcie_ipc(monkeypatch)
    rc, out, err = cli(
        [
            "tune",
            "--predict",
            "--topology",
            "topo.txt",
            "--model",
            "kimi-k2",
            "--tp",
            "8",
            "--sm",
            "120",
            "--max-batch",
            "32",
            "--p2p-check",
            "p2p.json",
            "--write-env",
            "e.env",
        ],
        capsys,
    )
    assert rc == 0, err
    rec = read_record(tmp_path / "e.deploy.json")
    assert rec.p2p.gpus == ()
    described = json.dumps(
        {
            "gpu_name": None,
            "sm": [12, 0],
            "gpu_count": 8,
            "gpus": [{"index": g.index, "pci_bus_id": g.pci_bus_id, "uuid": g.uuid} for g in BOX_A],
        }
    )
    res = run_fastverify(
        ["launch", "--env", "e.env", "--backend", "pcie_ipc", "--describe-box", described, "--dry-run", "--", *cmd()],
        cwd=tmp_path,
    )
    assert res.returncode == 2 and "all 56 directions" not in res.stdout + res.stderr
    assert "pcie_ipc" in res.stderr and "not proven" in res.stderr, res.stderr
