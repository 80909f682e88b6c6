"""One reading of each input: the all_reduce_perf table (topo and tune read the same column, the
rank count from busBw/algBw, dropped rows), NCCL logs of any version (2.8.3), TUNING numbers, and
the provenance labels of the published measurements."""

from __future__ import annotations

import json
import math
from argparse import Namespace
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import cli

from fastverify.errors import UserError
from fastverify.nccl.perftable import parse_all_reduce_perf
from fastverify.nccl.version import NcclVersion

SHARED = Path(__file__).resolve().parents[2] / "shared" / "inputs"
DATA = Path(__file__).resolve().parent / "data"
TABLE = SHARED / "allreduceperf-blog-chlc-rtx4090-p2punlocked.txt"
TOPO = SHARED / "topo-blog-chlc-rtx4090.txt"
MSG = 32 * 4 * 7168 * 2  # batch 32 x 4 draft tokens x hidden 7168 x 2 B = 1,835,008 B


def _loglog(x, x0, t0, x1, t1):
    return math.exp(
        math.log(t0) + (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0)) * (math.log(t1) - math.log(t0))
    )


# the table's in-place times at 1 MiB and 2 MiB (217.2 and 322.6 µs; out-of-place: 216.1 and 321.5)
IN_PLACE_US = _loglog(MSG, 1048576, 217.2, 2097152, 322.6)


def test_topo_and_tune_read_the_same_in_place_time(capsys):
    rc, out, err = cli(["topo", "--nvidia-smi", TOPO, "--perf-table", TABLE, "--batch", "32", "--json"], capsys)
    assert rc == 0, err
    m = json.loads(out)["measured"]
    assert [(x["msg_bytes"], x["column"]) for x in m] == [(MSG, "in-place")]
    assert m[0]["time_us"] == round(IN_PLACE_US, 1) == 298.9
    # tune: its reader, then its baseline (the line that reads the table)
    from fastverify.tune.candidates import baseline_figure
    from fastverify.tune.command import read_perf as _read_perf

    perf, warnings = _read_perf(Namespace(perf_table=TABLE, topology=TOPO), 8)
    assert warnings == []
    workload = SimpleNamespace(
        measured_on_gpu=False,
        profile_backend=None,
        allreduce_us_by_size={},
        msg_sizes=((MSG, 1),),
        source="w",
        clock="wall",
    )
    base = SimpleNamespace(
        per_size=[SimpleNamespace(msg_bytes=MSG, time_us=1.0)], transport="SHM", inputs=None, p2p_level="PXB", notes=()
    )
    import inspect

    # the model/range inputs are not reached where the table has the size; passed as None
    rest = {k: None for k, v in inspect.signature(baseline_figure).parameters.items() if v.kind is v.KEYWORD_ONLY}
    fig = baseline_figure(workload, base, **{**rest, "perf": perf})
    assert fig.per_call_us[MSG] == pytest.approx(IN_PLACE_US, abs=1e-9)
    assert any("(in-place column)" in e for e in fig.evidence)
    rc, out, err = cli(["topo", "--nvidia-smi", TOPO, "--perf-table", TABLE, "--batch", "32"], capsys)
    assert "298.9" in out and "in-place" in out
    assert "for the smallest verify message (1,835,008 B, in-place column" in " ".join(out.split())


def test_smallest_verify_message_is_the_smallest_size(capsys):
    rc, out, err = cli(["topo", "--nvidia-smi", TOPO, "--perf-table", TABLE, "--batch", "32", "1", "--json"], capsys)
    assert rc == 0, err
    acts = " ".join(json.loads(out)["actions"])
    # batch 1: 1 x 4 x 7168 x 2 = 57,344 B is the smallest verify message, not 1,835,008 B
    assert "for the smallest verify message (57,344 B" in acts and "1,835,008 B" not in acts


def test_out_of_place_only_where_in_place_is_missing():
    t = parse_all_reduce_perf(TABLE.read_text())
    assert t.verify_time_us(1048576) == (217.2, "in-place")
    import dataclasses

    rows = tuple(dataclasses.replace(r, ip_time_us=0.0) if r.size_bytes == 1048576 else r for r in t.rows)
    t2 = dataclasses.replace(t, rows=rows)
    assert t2.verify_time_us(1048576) == (216.1, "out-of-place")
    assert t.verify_time_us(4) == (None, None)


def _multinode_table() -> str:
    # 24 ranks (3 nodes x 8): busBw = algBw x 2*23/24 = algBw x 1.91667; nThread 1 nGpus 1 per MPI process
    head = (
        "# nThread 1 nGpus 1 minBytes 1048576 maxBytes 4194304 step: 2(factor) warmup iters: 5 iters: 20 "
        "agg iters: 1 validation: 1 graph: 0\n#\n"
        "#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   "
        "busbw #wrong\n"
    )
    rows = ""
    for size, alg in ((1048576, 4.00), (2097152, 6.00), (4194304, 10.00)):
        t = size / 1e3 / alg
        bus = alg * 46 / 24
        rows += (
            f"{size:12d}  {size // 4:12d}     float     sum      -1  {t:7.1f}  {alg:6.2f}  {bus:6.2f}      0"
            f"  {t:7.1f}  {alg:6.2f}  {bus:6.2f}      0\n"
        )
    return head + rows


def test_multinode_table_is_flagged_by_topo_and_tune(tmp_path, capsys):
    p = tmp_path / "multi.txt"
    p.write_text(_multinode_table())
    t = parse_all_reduce_perf(p.read_text(), source="multi.txt")
    assert (t.n_ranks_bw, t.n_ranks, t.n_ranks_basis) == (24, 24, "busBw/algBw")
    want = "this table ran on about 24 ranks (busBw/algBw), likely several nodes: its times are not this box's"
    rc, out, err = cli(["topo", "--nvidia-smi", TOPO, "--perf-table", p], capsys)
    assert rc == 0, err
    assert want in " ".join(out.split())
    from fastverify.tune.command import read_perf as _read_perf

    perf, warnings = _read_perf(Namespace(perf_table=p, topology=TOPO), 8)
    assert perf is None and len(warnings) == 1 and want in warnings[0] and warnings[0].startswith("# warning: ")


def test_single_node_table_is_not_flagged():
    t = parse_all_reduce_perf(TABLE.read_text())
    assert t.n_ranks == 8 and t.n_ranks_bw == 8 and t.several_nodes(8) is None


def test_row_without_a_size_is_reported_dropped(tmp_path, capsys):
    lines = TABLE.read_text().splitlines()
    i = next(k for k, line in enumerate(lines) if line.split()[:1] == ["1024"])
    lines[i] = "         256     float     sum      -1    41.70    0.02    0.04      0    41.67    0.02    0.04      0"
    p = tmp_path / "nosize.txt"
    p.write_text("\n".join(lines) + "\n")
    t = parse_all_reduce_perf(p.read_text(), source="nosize.txt")
    assert [(d.line, d.reason) for d in t.dropped] == [
        (i + 1, "no size column (the row starts with its element count)")
    ]
    assert 1024 not in t.sizes and len(t.rows) == 24
    rc, out, err = cli(["topo", "--nvidia-smi", TOPO, "--perf-table", p], capsys)
    text = " ".join(out.split())
    assert rc == 0 and f"1 data row(s) dropped; the first, line {i + 1}: no size column" in text


def test_nccl_2_8_3_log_reads_with_the_loc_diagnosis(capsys):
    log = DATA / "nccl-2.8.3-loc.log"
    rc, out, err = cli(["topo", "--nccl-log", log, "--json"], capsys)
    assert rc == 0, err
    d = json.loads(out)
    assert d["nccl_version"] == "2.8.3" and d["p2p_level_now"] == "LOC"
    pairs = [(p["a"], p["b"], p["transport_now"], p["basis"]) for p in d["pairs"]]
    assert pairs == [(a, b, "SHM", "environment: NCCL_P2P_LEVEL=LOC") for a in range(4) for b in range(a + 1, 4)]
    from fastverify.nccl.debuglog import parse_nccl_log

    parsed = parse_nccl_log(log.read_text())
    assert parsed.problems == () and {t.kind for t in parsed.transports} == {"SHM"} and len(parsed.transports) == 14
    rc, out, err = cli(["topo", "--nccl-log", log], capsys)
    assert rc == 0 and "NCCL 2.8.3" in out and "turns P2P off for every pair" in " ".join(out.split())


@pytest.mark.parametrize("code,text", [(2803, "2.8.3"), (21903, "2.19.3"), (2708, "2.7.8"), (20906, "2.9.6")])
def test_version_code_both_encodings(code, text):
    assert str(NcclVersion.from_code(code)) == text
    assert str(NcclVersion.parse(str(code))) == text  # ncclGetVersion's integer as text
    assert NcclVersion.parse(text).code == code


@pytest.mark.parametrize("bad", ["2950", "2901", "99"])
def test_version_code_text_that_no_release_has(bad):
    with pytest.raises(UserError) as e:
        NcclVersion.parse(bad)
    assert "\n" not in str(e.value)


def test_model_inputs_take_the_old_encoding():
    from fastverify.nccl.model import ModelInputs

    assert ModelInputs(n_ranks=4, sm=80, bw_intra_gbps=12.0, n_channels=2, nccl_version=2803).nccl_version == 2803
    with pytest.raises(ValueError):
        ModelInputs(n_ranks=4, sm=80, bw_intra_gbps=12.0, n_channels=2, nccl_version=2950)


def test_tuning_numbers_in_topo_json_and_text(capsys):
    log = DATA / "nccl-2.29.7-tuning.log"
    rc, out, err = cli(["topo", "--nccl-log", log, "--json"], capsys)
    assert rc == 0, err
    table = {
        (r["algo"], r["proto"]): (r["latency_us"], r["algbw_gbps"])
        for r in json.loads(out)["nccl_tuning"]["model_table"]
    }
    # the AllReduce row of the log, first block: Tree 16.8/0.5 31.0/0.0 36.4/1.9, Ring 16.6/1.2 31.0/0.0 36.4/2.4
    assert table[("TREE", "LL")] == (16.8, 0.5) and table[("RING", "SIMPLE")] == (36.4, 2.4)
    assert table[("RING", "LL")] == (16.6, 1.2) and table[("TREE", "SIMPLE")] == (36.4, 1.9)
    rc, out, err = cli(["topo", "--nccl-log", log], capsys)
    assert rc == 0
    text = " ".join(out.split())
    assert "RING/SIMPLE 36.4 µs + size/2.4 GB/s" in text
    assert "NCCL's model table from the log" in text


def test_provenance_labels(tmp_path):
    from fastverify.tune import backend_model as B

    tools = {m.id: m.tool for m in B.load().measurements}
    assert tools["asus-nccl-4gpu-bf16"].startswith("SGLang PCIe oneshot auto-crossover benchmark")
    assert tools["asus-nccl-8gpu-fp16"].startswith("p2pmark")
    assert all(t.startswith(B.TOOL_LABELS) or not t.startswith("nccl-tests") for t in tools.values())
    raw = json.loads((Path(B.__file__).parents[1] / "data" / "published_allreduce.json").read_text())
    bad = next(m for m in raw["measurements"] if m["id"] == "asus-nccl-8gpu-fp16")
    bad["tool"] = "nccl-tests all_reduce_perf"
    (tmp_path / "x.json").write_text(json.dumps(raw))
    with pytest.raises(UserError, match="labelled 'nccl-tests all_reduce_perf' but its note names 'p2pmark'"):
        B.load(tmp_path / "x.json")
