"""The NCCL sweep as data: one table (:data:`fastverify.tune.predict.NCCL_SWEEP`) drives the
candidates of ``tune`` and of ``topo``'s advice; one function turns an environment into the cost
model's inputs (:func:`fastverify.nccl.model.inputs_for_env`) for both; ``tune --set NAME=VALUE``
adds candidates, measured even where the model cannot price them."""

from __future__ import annotations

import inspect
import json

import orjson
from conftest import assert_user_error, run_fastverify

from fastverify import topo_command
from fastverify.cli import main
from fastverify.nccl import model as M
from fastverify.topo import diagnose as D
from fastverify.topo.diagnose import diagnose
from fastverify.topo.matrix import parse_nvidia_smi_topo
from fastverify.tune import predict
from fastverify.tune.predict import MEASURED_ONLY, NCCL_SWEEP, SweepValue, priced, rank_nccl_settings
from fastverify.tune.workload import Workload


def _topo_advice_names(topo_path, capsys) -> set[str]:
    assert main(["topo", "--topology", str(topo_path), "--json"]) == 0
    doc = orjson.loads(capsys.readouterr().out)
    return {e["candidate"] for e in doc["advice"]}


def test_the_sweep_table_drives_tune_and_topo(shared_dir, monkeypatch, capsys):
    monkeypatch.setattr(topo_command, "read_nccl_version", lambda: None)  # the newest grammar in both
    topo = shared_dir / "inputs" / "topo-nccl-tests-307.txt"
    w = Workload(msg_sizes=((57344, 123),), tp=8, source="test")
    tune_before = {c.name for c in rank_nccl_settings(w, topo, env={})}
    topo_before = _topo_advice_names(topo, capsys)
    assert "NCCL_P2P_LEVEL=SYS" in tune_before and "NCCL_P2P_LEVEL=SYS" in topo_before
    # one entry changed: SYS out, LL128 in
    table = tuple(e for e in NCCL_SWEEP if e.value != "SYS") + (SweepValue("NCCL_PROTO", "LL128", per_function=True),)
    monkeypatch.setattr(predict, "NCCL_SWEEP", table)
    tune_after = {c.name for c in rank_nccl_settings(w, topo, env={})}
    topo_after = _topo_advice_names(topo, capsys)
    for names in (tune_after, topo_after):
        assert not any("NCCL_P2P_LEVEL=SYS" in n for n in names), names
        assert any("NCCL_PROTO=allreduce:ll128" in n for n in names), names
    assert not any("ll128" in n for n in tune_before | topo_before)


def test_one_env_to_inputs_function_for_tune_and_topo(shared_dir, monkeypatch):
    """tune's baseline and topo's current-settings prediction ask the same function, and get the
    same inputs for the same environment; the per-command conversions are gone."""
    calls = []
    real = M.inputs_for_env

    def spy(env, n_ranks, **kw):
        got = real(env, n_ranks, **kw)
        calls.append((dict(env), n_ranks, kw, got[0]))
        return got

    monkeypatch.setattr(M, "inputs_for_env", spy)
    text = (shared_dir / "inputs" / "topo-nccl-tests-307.txt").read_text()
    topo = parse_nvidia_smi_topo(text, source="t")
    env = {"NCCL_PROTO": "Simple", "NCCL_ALGO": "Ring"}
    d = diagnose(topo, None, env, nccl_version="2.21.5", pcie_gen=5, sm=120, batches=(1,))
    assert d.predictions and calls
    topo_inputs = calls[0][3]
    calls.clear()
    ranked = rank_nccl_settings(
        Workload(msg_sizes=((57344, 1),), tp=8, source="t"),
        topo,
        env=env,
        nccl_version="2.21.5",
        pcie_gen=5,
        sm=120,
    )
    base = next(c for c in ranked if c.is_baseline)
    assert calls and base.inputs == topo_inputs
    assert topo_inputs.protos == frozenset({M.Proto.SIMPLE}) and topo_inputs.algos == frozenset({M.Algo.RING})
    for module in (predict, D):
        src = inspect.getsource(module)
        assert "inputs_for_pcie_box(" not in src and "enabled_algos_protos(env, version, sm)" not in src


def test_priced():
    assert priced("NCCL_P2P_LEVEL", "SYS", None)
    assert priced("NCCL_PROTO", "LL128", None)
    assert not priced("NCCL_ALGO", "nvls", None)  # no algorithm of the model left on
    assert not priced("NCCL_BUFFSIZE", "1048576", None)  # the model does not read it


def test_tune_set_measures_what_the_model_cannot_price(shared_dir, tmp_path):
    topo = shared_dir / "inputs" / "topo-nccl-tests-307.txt"
    args = ["tune", "--topology", str(topo), "--model", "tiny", "--tp", "2", "--top", "0", "--iters", "2"]
    args += ["--warmup", "1", "--journal", "j.jsonl", "--timeout", "60", "--set", "NCCL_BUFFSIZE=1048576"]
    proc = run_fastverify(args, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    label = f"NCCL_BUFFSIZE=1048576 ({MEASURED_ONLY})"
    trials = [r for r in map(json.loads, (tmp_path / "j.jsonl").read_text().splitlines()) if r["kind"] == "trial"]
    assert len(trials) == 2  # the baseline and the --set candidate (--top 0: none from the model)
    assert any(label in json.dumps(t) for t in trials)
    assert label in " ".join(proc.stdout.split())  # the ranking


def test_tune_set_errors(shared_dir, tmp_path):
    topo = str(shared_dir / "inputs" / "topo-nccl-tests-307.txt")
    base = ["tune", "--topology", topo, "--model", "tiny", "--tp", "2"]
    assert_user_error(run_fastverify([*base, "--set", "NCCL_BUFSIZE=1048576"], tmp_path), "NCCL_BUFFSIZE?")
    assert_user_error(run_fastverify([*base, "--set", "NCCL_PROTO=bogus"], tmp_path), "--set NCCL_PROTO=bogus")
    assert_user_error(run_fastverify([*base, "--set", "NCCL_PROTO"], tmp_path), "NAME=VALUE")
    proc = run_fastverify([*base, "--predict", "--set", "NCCL_BUFFSIZE=1048576"], tmp_path)
    assert_user_error(proc, "NCCL_BUFFSIZE=1048576", "cannot price")
    assert not (tmp_path / "nccl_configs").exists()
