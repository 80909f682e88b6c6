"""Findings of a fresh-user test on the tune / launch / deploy / registry side: outputs that replaced
inputs, late tracebacks, SGLang's custom all-reduce NVLink rule, a P2P check the prediction
ignored, ``--hidden`` contradicting the model, unbounded deployment records, a record folder that
was ignored, and the wording of several one-line errors.

Most commands run in-process through :func:`fastverify.cli.main` (exit code and stderr as the
user sees them); the measure mode's sweep is replaced by a function that fails the test, so a
refusal that is checked here happened before any trial ran.
"""

from __future__ import annotations

import ast
import json
import os
import re
import zipfile
from pathlib import Path

import pytest
from conftest import REPO_ROOT as REPO, SHARED, cli, one_line_error, run_fastverify, two_rank_trace_profile

TOPO_307 = SHARED / "inputs" / "topo-nccl-tests-307.txt"
TWO_GPU_TOPO = "        GPU0    GPU1\nGPU0     X      PHB\nGPU1    PHB      X\n"
_GPUS = [
    {"index": i, "pci_bus_id": f"00000000:{0x18 + i:02X}:00.0", "uuid": f"GPU-{i:08x}-0000-0000-0000-000000000000"}
    for i in range(8)
]
PCIE_4090_BOX = json.dumps({"gpu_name": "NVIDIA GeForce RTX 4090", "sm": [8, 9], "gpu_count": 8, "gpus": _GPUS})


@pytest.fixture
def box_dir(tmp_path, monkeypatch):
    """A working folder with the 8 x RTX 4090 topology (topo.txt), a 2-GPU one (t2.txt), a plain
    file (afile), P2P check results (every direction passing; one failing of 56) and a trace
    profile without a hidden size; the measure mode's sweep fails the test if it is reached."""
    if not TOPO_307.is_file():
        pytest.skip(f"{TOPO_307} absent (../shared/inputs)")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "topo.txt").write_text(TOPO_307.read_text())
    (tmp_path / "t2.txt").write_text(TWO_GPU_TOPO)
    (tmp_path / "afile").write_text("a file\n")
    pairs = [(i, j) for i in range(8) for j in range(8) if i != j]
    (tmp_path / "p2pgood.json").write_text(
        json.dumps(
            {
                "schema": "fastverify.p2p_check",
                "version": 2,
                "gpus": [dict(g, cuda=g["index"]) for g in _GPUS],
                "results": [{"src": i, "dst": j, "ok": True, "reason": ""} for i, j in pairs],
            }
        )
    )
    (tmp_path / "p2pbad.json").write_text(
        json.dumps(
            [
                {"src": i, "dst": j, "ok": (i, j) != (0, 5), "reason": "" if (i, j) != (0, 5) else "read back zeros"}
                for i, j in pairs
            ]
        )
    )
    prof = two_rank_trace_profile()
    (tmp_path / "pin.json").write_text(json.dumps(prof))

    def no_sweep(*a, **k):
        raise AssertionError("the sweep ran: the refusal must come before any trial")

    monkeypatch.setattr("fastverify.tune.measure.run_sweep", no_sweep)
    monkeypatch.delenv("FASTVERIFY_DESCRIBE_BOX", raising=False)
    for k in [k for k in os.environ if k.startswith("NCCL_")]:
        monkeypatch.delenv(k)
    return tmp_path


PREDICT_8 = ["tune", "--predict", "--topology", "topo.txt", "--model", "kimi-k2", "--tp", "8"]
PREDICT_PIN = ["tune", "--predict", "--topology", "t2.txt", "--profile", "pin.json"]
MEASURE = ["tune", "--model", "tiny", "--tp", "2", "--top", "0"]


# --- item 1: an output never replaces an input nor another output ------------------------------------


@pytest.mark.parametrize(
    "argv, words, kept",
    [
        (PREDICT_8 + ["--write-tuner-config", "topo.txt"], ["--write-tuner-config", "--topology"], "topo.txt"),
        (PREDICT_8 + ["--write-tuner-config", "./topo.txt"], ["--write-tuner-config", "--topology"], "topo.txt"),
        (PREDICT_PIN + ["--write-tuner-config", "pin.json"], ["--write-tuner-config", "--profile"], "pin.json"),
        (
            PREDICT_PIN + ["--write-env", "pin.env", "--hidden", "7168", "--write-tuner-config", "pin.deploy.json"],
            ["--write-tuner-config", "--write-env (deployment record)"],
            None,
        ),
        (
            PREDICT_8 + ["--p2p-check", "p2pgood.json", "--write-tuner-config", "p2pgood.json"],
            ["--write-tuner-config", "--p2p-check"],
            "p2pgood.json",
        ),
        (
            PREDICT_8 + ["--write-env", "z.env", "--write-tuner-config", "z.env"],
            ["--write-tuner-config", "--write-env"],
            None,
        ),
        (
            PREDICT_8 + ["--write-env", "w.env", "--write-tuner-config", "w.deploy.json"],
            ["--write-tuner-config", "w.deploy.json", "--write-env"],
            None,
        ),
        (MEASURE + ["--topology", "topo.txt", "--journal", "topo.txt"], ["--journal", "--topology"], "topo.txt"),
        (
            ["tune", "--profile", "pin.json", "--top", "0", "--journal", "pin.json"],
            ["--journal", "--profile"],
            "pin.json",
        ),
        (MEASURE + ["--topology", "topo.txt", "--png", "topo.txt"], ["--png", "--topology"], "topo.txt"),
        (MEASURE + ["--journal", "j.jsonl", "--png", "j.jsonl"], ["--png", "--journal"], None),
    ],
)
def test_outputs_never_replace_an_input_or_each_other(box_dir, capsys, argv, words, kept):
    before = {p.name: p.read_bytes() for p in box_dir.iterdir() if p.is_file()}
    one_line_error(*cli(argv, capsys), *words)
    after = {p.name: p.read_bytes() for p in box_dir.iterdir() if p.is_file()}
    assert after == before, "nothing written, nothing replaced"
    if kept:
        assert (box_dir / kept).read_bytes() == before[kept]


def test_a_model_config_file_is_an_input_too(box_dir, capsys):
    from fastverify.live.config import load_model_config

    cfg = json.loads(Path(load_model_config("tiny").source).read_text())
    (box_dir / "m.json").write_text(json.dumps(cfg))
    argv = ["tune", "--predict", "--topology", "t2.txt", "--model", "m.json", "--write-tuner-config", "m.json"]
    one_line_error(*cli(argv, capsys), "--write-tuner-config", "--model")
    assert json.loads((box_dir / "m.json").read_text()) == cfg


# --- item 4 and the "File exists" wording: output folders and formats, before the sweep ----------------


@pytest.mark.parametrize(
    "argv, words",
    [
        (MEASURE + ["--png", "chart.txt"], ["--png chart.txt", "matplotlib cannot write .txt", "png"]),
        (MEASURE + ["--png", "afile/c.png"], ["--png afile/c.png: afile is a file, not a folder"]),
        (MEASURE + ["--journal", "afile/j.jsonl"], ["--journal afile/j.jsonl: afile is a file, not a folder"]),
        (PREDICT_8 + ["--write-env", "afile/x.env"], ["--write-env afile/x.env: afile is a file, not a folder"]),
        (PREDICT_8 + ["--write-tuner-config", "afile/t.csv"], ["--write-tuner-config afile/t.csv: afile is a file"]),
    ],
)
def test_output_paths_refused_before_any_work(box_dir, capsys, argv, words):
    line = one_line_error(*cli(argv, capsys), *words)
    assert "File exists" not in line and "x.deploy.json" not in line


def test_png_into_a_new_folder_is_written_after_a_real_cpu_sweep(tmp_path):
    """`--png nodir/c.png` raised FileNotFoundError after the sweep; the folder is now created."""
    proc = run_fastverify(
        [
            "tune",
            "--model",
            "tiny",
            "--tp",
            "2",
            "--top",
            "0",
            "--iters",
            "1",
            "--warmup",
            "0",
            "--journal",
            "j.jsonl",
            "--png",
            "nodir/c.png",
        ],
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "nodir" / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not [p for p in (tmp_path / "nodir").iterdir() if p.name != "c.png"], "no temporary file left"


def test_plot_format_follows_the_installed_matplotlib(tmp_path):
    from matplotlib.figure import Figure

    from fastverify.errors import UserError
    from fastverify.tune.ranking import plot_format

    supported = Figure().canvas.get_supported_filetypes()
    assert plot_format(tmp_path / "a.svg") == "svg" and "svg" in supported
    assert plot_format(tmp_path / "noext") == "png"
    with pytest.raises(UserError, match=r"cannot write \.txt"):
        plot_format(tmp_path / "a.txt")


def test_launch_profile_verify_under_a_file(box_dir, capsys):
    argv = ["launch", "--profile-verify", "afile/v", "--dry-run", "--", "python", "-c", "pass"]
    one_line_error(*cli(argv, capsys), "--profile-verify afile/v: afile is a file, not a folder")


# --- item 6: SGLang's custom all-reduce needs full NVLink beyond 2 GPUs ---------------------------------


def _sglang_custom_ar_rule():
    """(supported world sizes, k) from the SGLang 0.5.23 wheel's own source: ``CustomAllreduce.
    _SUPPORTED_WORLD_SIZES`` (custom_all_reduce.py) and the ``world_size > k and not full_nvlink``
    test of ``can_use_custom_all_reduce_with_nvlink`` (custom_all_reduce_utils.py)."""
    whl = os.environ.get("FASTVERIFY_SGLANG_WHEEL")
    if not whl or not Path(whl).is_file():
        pytest.skip("FASTVERIFY_SGLANG_WHEEL is not set to an SGLang 0.5.23 wheel: no source to read the rule from")
    base = "sglang/srt/distributed/device_communicators/"
    with zipfile.ZipFile(whl) as z:
        car = ast.parse(z.read(base + "custom_all_reduce.py").decode())
        utils = ast.parse(z.read(base + "custom_all_reduce_utils.py").decode())
    supported = next(
        ast.literal_eval(node.value)
        for node in ast.walk(car)
        if isinstance(node, ast.Assign)
        and any(getattr(t, "id", None) == "_SUPPORTED_WORLD_SIZES" for t in node.targets)
    )
    fn = next(
        n
        for n in ast.walk(utils)
        if isinstance(n, ast.FunctionDef) and n.name == "can_use_custom_all_reduce_with_nvlink"
    )
    ks = []
    for node in ast.walk(fn):
        t = node.test if isinstance(node, ast.If) else None
        if (
            isinstance(t, ast.BoolOp)
            and isinstance(t.op, ast.And)
            and len(t.values) == 2
            and isinstance(t.values[0], ast.Compare)
            and getattr(t.values[0].left, "id", "") == "world_size"
            and isinstance(t.values[0].ops[0], ast.Gt)
            and isinstance(t.values[1], ast.UnaryOp)
            and isinstance(t.values[1].op, ast.Not)
            and getattr(t.values[1].operand, "id", "") == "full_nvlink"
            and any(isinstance(s, ast.Return) for s in node.body)
        ):
            ks.append(t.values[0].comparators[0].value)
    assert len(ks) == 1, "SGLang's `world_size > k and not full_nvlink` test not found"
    return tuple(supported), ks[0]


def test_registry_custom_ar_rule_is_sglangs_own():
    from fastverify.registry import BackendName, backend_info, unreachable_reason

    supported, k = _sglang_custom_ar_rule()
    info = backend_info(BackendName.custom_ar)
    assert info.world_sizes == supported == (2, 4, 6, 8)
    assert info.world_sizes_without_nvlink == tuple(w for w in supported if not w > k) == (2,)
    for w in range(1, 10):
        for nvlink in (True, False, None):
            sglang_runs = w in supported and not (w > k and not nvlink)  # unknown NVLink counts as none
            reason = unreachable_reason(
                info,
                sm=(9, 0),
                world_size=w,
                p2p_ok=True,
                p2p_source="p2p_check",
                sglang_version="0.5.23",
                nvlink_full=nvlink,
            )
            assert (reason is None) == sglang_runs, (w, nvlink, reason)


@pytest.mark.parametrize(
    "tp, box, ok",
    [
        ("8", PCIE_4090_BOX, False),
        ("4", PCIE_4090_BOX, False),
        ("2", PCIE_4090_BOX, True),
        ("8", PCIE_4090_BOX[:-1] + ', "nvlink_full": true}', True),
    ],
)
def test_launch_custom_ar_follows_the_nvlink_rule(box_dir, capsys, monkeypatch, tp, box, ok):
    monkeypatch.setenv("FASTVERIFY_DESCRIBE_BOX", box)
    argv = [
        "launch",
        "--backend",
        "custom_ar",
        "--p2p-check",
        "p2pgood.json",
        "--dry-run",
        "--",
        "python",
        "-m",
        "sglang.launch_server",
        "--tp-size",
        tp,
    ]
    rc, out, err = cli(argv, capsys)
    if ok:
        assert rc == 0 and "backend: custom_ar" in out, err
    else:
        one_line_error(rc, out, err, "custom_ar", f"world size {tp}", "full NVLink", "custom_all_reduce_utils.py")


def test_topo_and_predicted_record_agree_with_launch(box_dir, capsys):
    """topo says custom all-reduce cannot run on the 8 PCIe GPUs; the predicted record says the
    box has no full NVLink, so launch refuses custom_ar with that record as well."""
    from fastverify.deploy import read_record
    from fastverify.topo.diagnose import diagnose
    from fastverify.topo.matrix import parse_nvidia_smi_topo

    d = diagnose(parse_nvidia_smi_topo((box_dir / "topo.txt").read_text(), source="topo.txt"), None, {}, batches=())
    assert d.custom_allreduce["possible"] is False and "full NVLink" in d.custom_allreduce["reason"]
    rc, out, err = cli(PREDICT_8 + ["--p2p-check", "p2pgood.json", "--write-env", "e.env"], capsys)
    assert rc == 0, err
    assert read_record("e.deploy.json").box.nvlink_full is False
    rc, out, err = cli(
        [
            "launch",
            "--env",
            "e.env",
            "--backend",
            "custom_ar",
            "--describe-box",
            PCIE_4090_BOX[:-1] + ', "nvlink_full": false}',
            "--dry-run",
            "--",
            "python",
            "x",
            "--tp-size",
            "8",
        ],
        capsys,
    )
    one_line_error(rc, out, err, "custom_ar", "this box has none")


def test_read_box_asks_nvml_for_nvlink_like_sglang():
    """read_box's NVLink fact is SGLang's is_full_nvlink: nvmlDeviceGetP2PStatus(a, b,
    NVML_P2P_CAPS_INDEX_NVLINK) == NVML_P2P_STATUS_OK for every pair (stand-in NVML; pynvml's
    constants are 3 and 0 in nvml.h / pynvml)."""
    from types import SimpleNamespace

    from fastverify.topo.box import read_box

    def nvml(links_ok):
        asked = []

        def status(a, b, index):
            asked.append((a, b, index))
            return 0 if links_ok(a, b) else 4

        return asked, SimpleNamespace(
            NVMLError=RuntimeError,
            NVML_P2P_CAPS_INDEX_NVLINK=3,
            NVML_P2P_STATUS_OK=0,
            nvmlInit=lambda: None,
            nvmlShutdown=lambda: None,
            nvmlDeviceGetCount=lambda: 4,
            nvmlDeviceGetHandleByIndex=lambda i: i,
            nvmlDeviceGetName=lambda h: "G",
            nvmlDeviceGetCudaComputeCapability=lambda h: (9, 0),
            nvmlSystemGetDriverVersion=lambda: "1",
            nvmlDeviceGetP2PStatus=status,
        )

    asked, full = nvml(lambda a, b: True)
    assert read_box(4, nvml=full, nccl_version="2.21.5").nvlink_full is True
    assert {(a, b) for a, b, _ in asked} == {(a, b) for a in range(4) for b in range(a + 1, 4)}
    assert {i for *_, i in asked} == {3}
    _, pcie = nvml(lambda a, b: (a, b) != (1, 3))
    assert read_box(4, nvml=pcie, nccl_version="2.21.5").nvlink_full is False
    _, first_two = nvml(lambda a, b: (a, b) == (0, 1))
    assert read_box(2, nvml=first_two, nccl_version="2.21.5").nvlink_full is True  # only the first tp GPUs


# --- item 7: the P2P check's per-pair results drive the prediction -------------------------------------


def test_predict_uses_a_failing_p2p_check(box_dir, capsys):
    from fastverify.deploy import read_record
    from fastverify.envfile import read_env_file

    rc, out, err = cli(PREDICT_8 + ["--p2p-check", "p2pbad.json", "--write-env", "b.env", "--explain"], capsys)
    assert rc == 0, err
    text = " ".join(out.split())
    # GPU 5 cannot reach GPU 0's memory: that pair is SHM at any level, so SYS moves 15 of the 16
    # SYS pairs (27/28) and the ring stays SHM-paced: SYS gains nothing, the baseline is kept.
    assert "27/28" in text and "28/28" not in text
    assert "fastverify p2p" not in text
    assert read_env_file("b.env") == {}
    assert read_record("b.deploy.json").p2p.ok is False


def test_predict_with_a_passing_p2p_check_does_not_ask_for_it(box_dir, capsys):
    rc, out, err = cli(PREDICT_8 + ["--p2p-check", "p2pgood.json", "--explain"], capsys)
    assert rc == 0, err
    text = " ".join(out.split())
    assert "28/28" in text and "assuming the driver allows it" not in text
    assert "fastverify p2p" not in text


def test_a_p2p_check_of_another_box_is_refused(box_dir, capsys):
    (box_dir / "other.json").write_text(json.dumps([{"src": 0, "dst": 9, "ok": True, "reason": ""}]))
    one_line_error(*cli(PREDICT_8 + ["--p2p-check", "other.json"], capsys), "GPU 9", "topo.txt")


# --- item 11: --p2p-check is read whenever given -------------------------------------------------------


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda d: None, ["missing.json", "cannot read"]),
        (lambda d: (d / "missing.json").write_text("garbage"), ["missing.json", "not valid JSON"]),
        (lambda d: (d / "missing.json").mkdir(), ["missing.json", "cannot read"]),
        (lambda d: (d / "missing.json").write_text("[]"), ["missing.json", "no P2P results"]),
    ],
)
def test_p2p_check_is_validated_without_write_env(box_dir, capsys, make, words):
    make(box_dir)
    one_line_error(*cli(PREDICT_8 + ["--p2p-check", "missing.json"], capsys), *words)


# --- item 8: --hidden must not contradict a known hidden size -----------------------------------------


def test_hidden_contradicting_the_model_is_refused(box_dir, capsys):
    one_line_error(*cli(PREDICT_8 + ["--hidden", "100", "--write-env", "h.env"], capsys), "--hidden 100", "7168")
    assert not (box_dir / "h.env").exists() and not (box_dir / "h.deploy.json").exists()


def test_hidden_equal_to_the_model_and_for_a_trace_profile_is_accepted(box_dir, capsys):
    from fastverify.deploy import read_record

    rc, _, err = cli(PREDICT_8 + ["--hidden", "7168", "--write-env", "h.env"], capsys)
    assert rc == 0, err
    assert read_record("h.deploy.json").shapes.hidden == 7168
    # a trace profile records neither hidden size nor draft tokens: both come from the flags
    one_line_error(*cli(PREDICT_PIN + ["--hidden", "4096", "--write-env", "p.env"], capsys), "--draft-tokens N")
    rc, _, err = cli(PREDICT_PIN + ["--hidden", "4096", "--draft-tokens", "3", "--write-env", "p.env"], capsys)
    assert rc == 0, err
    assert (read_record("p.deploy.json").shapes.hidden, read_record("p.deploy.json").shapes.draft_tokens) == (4096, 3)


# --- item 9: the record's values are bounded and its NCCL settings validated ---------------------------


def _record_doc():
    from fastverify.deploy import (
        BoxFingerprint,
        DeploymentRecord,
        P2PFacts,
        VerifyShapes,
        encode_record,
    )
    from fastverify.registry import BackendName

    rec = DeploymentRecord(
        backend=BackendName.pcie_ipc,
        shapes=VerifyShapes(32, 4, 7168),
        p2p=P2PFacts(ok=None),
        box=BoxFingerprint(gpu_name="G", sm=(8, 9), gpu_count=8, tp=8),
        nccl_settings={"NCCL_P2P_LEVEL": "PHB"},
    )
    return json.loads(encode_record(rec))


@pytest.mark.parametrize(
    "path, value, words",
    [
        (("shapes", "max_batch"), 10**15, ["max_batch", "1..4096"]),
        (("shapes", "max_batch"), 4097, ["max_batch", "1..4096"]),
        (("shapes", "draft_tokens"), 65, ["draft_tokens", "1..64"]),
        (("shapes", "hidden"), 65537, ["hidden", "1..65536"]),
        (("box", "tp"), -8, ["tp", ">= 0"]),
        (("box", "tp"), 0, ["box.tp", ">= 1"]),
        (("box", "gpu_count"), -1, ["gpu_count", ">= 0"]),
        (("box", "sm"), [-1, 9], ["sm", ">= 0"]),
        (("nccl_settings", "NCCL_P2P_LEVEL"), "sys", ["nccl_settings", "NCCL_P2P_LEVEL=sys", "case-sensitively"]),
        (("nccl_settings", "NCCL_PROTOCOL"), "LL", ["nccl_settings", "NCCL_PROTOCOL"]),
        (("nccl_settings", "CUDA_DEVICE_MAX_CONNECTIONS"), "8", ["nccl_settings", "CUDA_DEVICE_MAX_CONNECTIONS"]),
        (("box", "nccl_version"), "garbage", ["box.nccl_version", "garbage"]),
        (("version",), "1", ["version '1'", "str", "integer 1"]),
    ],
)
def test_record_values_are_bounded(tmp_path, path, value, words):
    from fastverify.deploy import read_record
    from fastverify.errors import UserError

    doc = _record_doc()
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    (tmp_path / "r.deploy.json").write_text(json.dumps(doc))
    with pytest.raises(UserError) as e:
        read_record(tmp_path / "r.deploy.json")
    msg = str(e.value)
    assert msg.startswith(str(tmp_path / "r.deploy.json")) and "\n" not in msg
    for w in words:
        assert w in msg, (w, msg)


def test_record_at_the_bounds_decodes_and_its_numel_fits_the_env_file(tmp_path):
    from fastverify.deploy import read_record, sglang_settings
    from fastverify.envfile import check_setting

    doc = _record_doc()
    doc["shapes"].update(max_batch=4096, draft_tokens=64, hidden=65536)
    (tmp_path / "r.deploy.json").write_text(json.dumps(doc))
    rec = read_record(tmp_path / "r.deploy.json")
    assert rec.shapes.max_numel == 4096 * 64 * 65536 == 2**34
    for k, v in sglang_settings(rec.backend).items():
        check_setting(k, v, "test")  # SGLANG_PCIE_IPC_MAX_NUMEL=17179869184 passes the env-file rule


@pytest.mark.parametrize(
    "doc, words",
    [
        ([1], ["a JSON array", "fastverify.deployment"]),
        ("x", ["a JSON string"]),
    ],
)
def test_record_that_is_not_an_object(tmp_path, doc, words):
    from fastverify.deploy import read_record
    from fastverify.errors import UserError

    (tmp_path / "r.json").write_text(json.dumps(doc))
    with pytest.raises(UserError) as e:
        read_record(tmp_path / "r.json")
    assert "schema 'list'" not in str(e.value) and "schema 'str'" not in str(e.value)
    for w in words:
        assert w in str(e.value)


def test_launch_notes_env_settings_that_differ_from_the_record(box_dir, capsys, monkeypatch):
    from fastverify.deploy import decode_record, write_deployment

    doc = _record_doc()
    doc["backend"] = "nccl"
    env, _ = write_deployment(box_dir / "d.env", {"NCCL_P2P_LEVEL": "SYS"}, decode_record(json.dumps(doc).encode()))
    monkeypatch.setenv("FASTVERIFY_DESCRIBE_BOX", '{"gpu_name": "G", "sm": [8, 9], "gpu_count": 8}')
    rc, out, err = cli(["launch", "--env", "d.env", "--dry-run", "--", "python", "x", "--tp-size", "8"], capsys)
    assert rc == 0, err
    assert (
        "note: d.env: NCCL settings differ from the deployment record's (NCCL_P2P_LEVEL: env SYS / record PHB)"
        in " ".join(out.split())
    )
    assert "NCCL_P2P_LEVEL=SYS" in out  # the env file's value is the one set
    env.write_text("NCCL_P2P_LEVEL=PHB\n")
    rc, out, err = cli(["launch", "--env", "d.env", "--dry-run", "--", "python", "x", "--tp-size", "8"], capsys)
    assert rc == 0 and "differ from the deployment record" not in out, err


# --- item 10: a record path that is a folder or unreadable is an error, not "no record" ----------------


@pytest.mark.parametrize("make", [lambda p: p.mkdir(), lambda p: p.symlink_to(p.parent / "gone.json")])
def test_launch_env_with_a_record_folder_is_refused(box_dir, capsys, make):
    (box_dir / "x.env").write_text("NCCL_P2P_LEVEL=SYS\n")
    make(box_dir / "x.deploy.json")
    rc, out, err = cli(["launch", "--env", "x.env", "--dry-run", "--", "python", "x"], capsys)
    one_line_error(rc, out, err, "x.deploy.json", "cannot read the deployment record")


# --- low items ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, words",
    [
        ("inf", ["--tok-s inf", "finite positive"]),
        ("nan", ["--tok-s nan", "finite positive"]),
        ("-3", ["--tok-s -3", "finite positive"]),
        ("1e9", ["--tok-s 1e+09", "shorter than the verify step"]),
    ],
)
def test_tok_s_refused_before_any_output(box_dir, capsys, value, words):
    rc, out, err = cli(PREDICT_8 + ["--tok-s", value], capsys)
    one_line_error(rc, out, err, *words)
    assert out == "", "nothing printed before the refusal"


@pytest.mark.parametrize("name", ["x.txt", "y.deploy.json", ".env", "noext"])
def test_write_env_needs_an_env_name(box_dir, capsys, name):
    one_line_error(*cli(PREDICT_8 + ["--write-env", name], capsys), f"--write-env {name}", ".env")
    assert sorted(p.name for p in box_dir.iterdir()) == sorted(
        ["topo.txt", "t2.txt", "afile", "p2pgood.json", "p2pbad.json", "pin.json"]
    )


def test_box_wording(box_dir, capsys, monkeypatch):
    monkeypatch.setenv("FASTVERIFY_DESCRIBE_BOX", "[]")
    line = one_line_error(
        *cli(["launch", "--backend", "pcie_ipc", "--dry-run", "--", "python", "x"], capsys),
        "FASTVERIFY_DESCRIBE_BOX",
        "JSON object",
        "list",
    )
    assert "No such file" not in line
    # tune reads the described box too: the same bad description is the same one line
    one_line_error(*cli(PREDICT_8, capsys), "FASTVERIFY_DESCRIBE_BOX", "JSON object", "list")
    monkeypatch.delenv("FASTVERIFY_DESCRIBE_BOX")
    assert cli(PREDICT_8 + ["--write-env", "e.env"], capsys)[0] == 0
    monkeypatch.setenv("FASTVERIFY_DESCRIBE_BOX", "{}")  # no GPU count given: no GPU seen
    line = one_line_error(
        *cli(["launch", "--env", "e.env", "--dry-run", "--", "python", "x"], capsys), "this box has no GPU;"
    )
    assert "0 x" not in line
    monkeypatch.setenv("FASTVERIFY_DESCRIBE_BOX", '{"gpu_count": 0}')  # a box of 0 GPUs is no box
    one_line_error(*cli(["launch", "--env", "e.env", "--dry-run", "--", "python", "x"], capsys), "gpu_count", "0 GPUs")


def test_no_negative_zero_percent(box_dir, capsys):
    from fastverify.tune.verify_time import change_pct

    assert [change_pct(v) for v in (-0.0, -0.04, 0.04, -3.46, 2.0)] == ["0.0 %", "0.0 %", "0.0 %", "-3.5 %", "+2.0 %"]
    rc, out, err = cli(PREDICT_8 + ["--p2p-check", "p2pbad.json"], capsys)  # the baseline wins: a 0 % change
    assert rc == 0, err
    assert "-0.0 %" not in out and not re.search(r"--\d", out)


def test_committed_examples_hold_no_absolute_path():
    for name in ("example.env", "example.deploy.json", "example-tuner.csv"):
        text = (REPO / "nccl_configs" / name).read_text()
        assert str(REPO) not in text and "/work/" not in text, name
