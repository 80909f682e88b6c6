"""Env files (docker --env-file, systemd EnvironmentFile=, `set -a; . FILE`) and the tuner CSV."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from fastverify import outputs
from fastverify.deploy import BoxFingerprint, DeploymentRecord, P2PFacts, VerifyShapes, write_deployment
from fastverify.envfile import (
    ALLOWED_KEYS,
    TunerChoice,
    default_env_path,
    read_env_file,
    write_tuner_config,
)
from fastverify.errors import UserError
from fastverify.nccl.checks import CATALOGUE, Severity, validate_setting

GOOD = {
    "NCCL_P2P_LEVEL": "SYS",
    "NCCL_PROTO": "allreduce:ll",
    "NCCL_ALGO": "allreduce:ring",
    "CUDA_DEVICE_MAX_CONNECTIONS": "1",
}


RECORD = DeploymentRecord(
    backend="nccl",
    shapes=VerifyShapes(8, 4, 7168, "bfloat16"),
    p2p=P2PFacts(True, "p2p_check", "all 2 ordered pairs passed", 2),
    box=BoxFingerprint("test GPU", (9, 0), 2, 2),
)


def write_env_file(path: Path, settings, *, header_lines=(), nccl_version=None) -> Path:
    """The env file as ``tune --write-env`` writes it: with its deployment record beside it."""
    env, _record = write_deployment(path, settings, RECORD, header_lines=list(header_lines), nccl_version=nccl_version)
    return env


def _settings_lines(path: Path) -> list[str]:
    return [ln for ln in path.read_text().splitlines() if ln and not ln.startswith("#")]


def test_round_trip_and_plain_lines(tmp_path):
    p = write_env_file(tmp_path / "box.env", GOOD, header_lines=["predicted", "numbers: 1 -> 2"], nccl_version="2.27.3")
    assert read_env_file(p, nccl_version="2.27.3") == GOOD
    lines = _settings_lines(p)
    assert len(lines) == len(GOOD)
    for ln in lines:
        key, value = ln.split("=", 1)
        assert key in GOOD and value == GOOD[key]
        # docker --env-file takes the value literally: no quotes, no export, no spaces
        assert not any(ch in ln for ch in "\"' \t") and not ln.startswith("export")
    text = p.read_text()
    assert text.startswith("# written by fastverify")
    assert "(UTC)" in text and "NCCL version: 2.27.3" in text and "# predicted" in text
    assert text.endswith("\n")


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash not installed")
def test_set_a_dot_file_exports_the_values(tmp_path):
    p = write_env_file(tmp_path / "box.env", GOOD, header_lines=["a comment with ; $HOME `x` and 'quotes'"])
    out = subprocess.run(
        ["bash", "-c", f'set -a; . "{p}"; set +a; env'],
        capture_output=True,
        text=True,
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""
    seen = dict(line.split("=", 1) for line in out.stdout.splitlines() if "=" in line)
    for k, v in GOOD.items():
        assert seen[k] == v


@pytest.mark.parametrize(
    "key",
    [
        "LD_PRELOAD",
        "PATH",
        "CUDA_VISIBLE_DEVICES",
        "PYTHONPATH",
        "NCCL_SOCKET_IFNAME",
        "nccl_proto",
        "NCCL PROTO",
        "SGLANG_ENABLE_PCIE_IPC_ALLREDUCE",
        "SGLANG_PCIE_IPC_MAX_NUMEL",
        "SGLANG_ANYTHING_ELSE",
    ],
)
def test_disallowed_key_is_refused_and_named(tmp_path, key):
    p = tmp_path / "x.env"
    with pytest.raises(UserError) as err:
        write_env_file(p, {**GOOD, key: "1"})
    assert key in str(err.value)
    assert not p.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "key, value",
    [
        ("NCCL_P2P_LEVEL", "sys"),  # NCCL compares level names case-sensitively
        ("NCCL_PROTO", "allreduce:fast"),  # unknown protocol: init fails on >= 2.24
        ("NCCL_MAX_NCHANNELS", "99"),  # clamped
        ("NCCL_BUFFSIZE", "4MB"),  # strtoll reads 4
        ("CUDA_DEVICE_MAX_CONNECTIONS", "64"),
    ],
)
def test_invalid_value_is_refused(tmp_path, key, value):
    if key.startswith("NCCL_"):
        assert validate_setting(key, value).severity is Severity.ERROR  # the catalogue's own verdict
    with pytest.raises(UserError, match=key):
        write_env_file(tmp_path / "x.env", {key: value})
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "value", ["a b", "x#y", '"SYS"', "'SYS'", "$HOME", "a;b", "`id`", "a\\b", "", "é", "a\nNCCL_DEBUG=INFO"]
)
def test_values_that_readers_disagree_on_are_refused(tmp_path, value):
    with pytest.raises(UserError):
        write_env_file(tmp_path / "x.env", {"NCCL_TUNER_CONFIG_FILE": value})
    assert list(tmp_path.iterdir()) == []


def test_existing_file_is_kept_as_backup(tmp_path):
    p = tmp_path / "box.env"
    write_env_file(p, {"NCCL_P2P_LEVEL": "PHB"})
    first = p.read_text()
    write_env_file(p, {"NCCL_P2P_LEVEL": "SYS"})
    assert (tmp_path / "box.env.bak").read_text() == first
    assert read_env_file(p) == {"NCCL_P2P_LEVEL": "SYS"}
    assert sorted(x.name for x in tmp_path.iterdir()) == [
        "box.deploy.json",
        "box.deploy.json.bak",
        "box.env",
        "box.env.bak",
    ]


def test_nothing_half_written_when_the_rename_fails(tmp_path, monkeypatch):
    p = tmp_path / "box.env"
    write_env_file(p, {"NCCL_P2P_LEVEL": "PHB"})
    before = p.read_bytes()

    real = os.replace

    def failing(src, dst):
        if Path(dst) == p:
            raise OSError(28, "No space left on device")
        return real(src, dst)

    monkeypatch.setattr(outputs.os, "replace", failing)
    with pytest.raises(UserError, match="cannot write"):
        write_env_file(p, {"NCCL_P2P_LEVEL": "SYS"})
    assert p.read_bytes() == before
    assert not [x for x in tmp_path.iterdir() if x.name.endswith(".tmp")]


def test_refuses_a_directory(tmp_path):
    (tmp_path / "d.env").mkdir()
    with pytest.raises(UserError, match="directory"):
        write_env_file(tmp_path / "d.env", {"NCCL_P2P_LEVEL": "SYS"})


def test_empty_settings_still_make_a_valid_file(tmp_path):
    p = write_env_file(tmp_path / "x.env", {})
    assert read_env_file(p) == {} and "no setting to change" in p.read_text()


def test_header_cannot_inject_settings(tmp_path):
    p = write_env_file(tmp_path / "x.env", {}, header_lines=["line one\nLD_PRELOAD=/evil.so", "\rx"])
    assert read_env_file(p) == {}
    assert all(ln.startswith("#") for ln in p.read_text().splitlines())


@pytest.mark.parametrize(
    "text, needle",
    [
        ("NCCL_P2P_LEVEL=SYS\nLD_PRELOAD=/x.so\n", "line 2: LD_PRELOAD"),
        ("export NCCL_P2P_LEVEL=SYS\n", "line 1: 'export'"),
        ("NCCL_P2P_LEVEL = SYS\n", "line 1: spaces"),
        ('NCCL_P2P_LEVEL="SYS"\n', "line 1"),
        ("# c\n\nNCCL_P2P_LEVEL=SYS\nNCCL_P2P_LEVEL=PHB\n", "line 4: NCCL_P2P_LEVEL is set twice"),
        ("NCCL_P2P_LEVEL=sys\n", "line 1: NCCL_P2P_LEVEL=sys"),
        ("just words\n", "line 1: expected KEY=VALUE"),
        ("NCCL_P2P_LEVEL=SYS\r\n", "line 1: CRLF"),
    ],
)
def test_read_is_strict_with_line_numbers(tmp_path, text, needle):
    p = tmp_path / "x.env"
    p.write_text(text, newline="")
    with pytest.raises(UserError) as err:
        read_env_file(p)
    assert str(p) in str(err.value) and needle in str(err.value)


def test_allowed_keys():
    assert {s.name for s in CATALOGUE} <= ALLOWED_KEYS
    assert "CUDA_DEVICE_MAX_CONNECTIONS" in ALLOWED_KEYS
    assert not {"CUDA_VISIBLE_DEVICES", "LD_PRELOAD", "PATH", "LD_LIBRARY_PATH"} & ALLOWED_KEYS
    # NCCL settings only: no SGLang switch or size (an env file sourced without launch would start
    # SGLang's IPC all-reduce with no P2P check)
    assert not {k for k in ALLOWED_KEYS if k.startswith("SGLANG_")}
    assert all(k.startswith(("NCCL_", "CUDA_")) for k in ALLOWED_KEYS)


@pytest.mark.parametrize(
    "fp, name",
    [
        ("8x NVIDIA GeForce RTX 4090/PIX+SYS", "8x-NVIDIA-GeForce-RTX-4090-PIX-SYS.env"),
        ("../../etc/passwd", "etc-passwd.env"),
        ("", "box.env"),
        ("a" * 300, "a" * 120 + ".env"),
    ],
)
def test_default_env_path(fp, name):
    p = default_env_path(fp)
    assert p == Path("nccl_configs") / name
    assert p.parent == Path("nccl_configs")


# --- tuner CSV -------------------------------------------------------------------------------------------


def test_tuner_csv_rows_have_explicit_positive_channels(tmp_path):
    rows = [TunerChoice(0, 65535, "ring", "ll", 1, 8), TunerChoice(65536, 2**63 - 1, "ring", "simple", 4, 8)]
    p = write_tuner_config(tmp_path / "nccl_tuner.conf", rows, header_lines=["predicted"])
    data = [ln for ln in p.read_text().splitlines() if ln and not ln.startswith("#")]
    assert data == ["allreduce,0,65535,ring,ll,1,1,8", f"allreduce,65536,{2**63 - 1},ring,simple,4,1,8"]
    for ln in data:
        fields = ln.split(",")
        assert len(fields) == 8
        assert int(fields[5]) >= 1  # explicit, never -1
        assert ln == ln.lower()
    assert "# collective_type,min_bytes,max_bytes,algorithm,protocol,channels,nNodes,nRanks" in p.read_text()


@pytest.mark.parametrize(
    "row, needle",
    [
        (TunerChoice(0, 10, "ring", "ll", -1, 8), "channels"),
        (TunerChoice(0, 10, "ring", "ll", 0, 8), "channels"),
        (TunerChoice(0, 10, "Ring", "ll", 1, 8), "algorithm"),
        (TunerChoice(0, 10, "ring", "LL", 1, 8), "protocol"),
        (TunerChoice(10, 0, "ring", "ll", 1, 8), "byte range"),
        (TunerChoice(0, 10, "ring", "ll", 1, 8, collective="AllReduce"), "collective"),
    ],
)
def test_tuner_csv_refuses_bad_rows(tmp_path, row, needle):
    with pytest.raises(UserError, match=needle):
        write_tuner_config(tmp_path / "t.conf", [row])
    assert list(tmp_path.iterdir()) == []


def test_tuner_csv_refuses_overlaps_and_empty(tmp_path):
    with pytest.raises(UserError, match="overlaps"):
        write_tuner_config(
            tmp_path / "t.conf", [TunerChoice(0, 100, "ring", "ll", 1, 8), TunerChoice(50, 200, "ring", "simple", 2, 8)]
        )
    with pytest.raises(UserError, match="no rows"):
        write_tuner_config(tmp_path / "t.conf", [])


def test_tuner_csv_from_a_prediction(tmp_path, shared_dir):
    from fastverify.live.config import load_model_config
    from fastverify.tune.predict import rank_nccl_settings, tuner_choices
    from fastverify.tune.workload import workload_from_model

    w = workload_from_model(load_model_config("kimi-k2"), tp=8, draft_tokens=4, batch=1)
    best = rank_nccl_settings(w, shared_dir / "inputs" / "topo-nccl-tests-307.txt", env={})[0]
    p = write_tuner_config(tmp_path / "t.conf", tuner_choices(best))
    data = [ln.split(",") for ln in p.read_text().splitlines() if ln and not ln.startswith("#")]
    assert data and all(int(f[5]) >= 1 and f[7] == "8" for f in data)


@pytest.mark.parametrize(
    "line",
    [
        "SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1",
        "SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=0",
        "SGLANG_PCIE_IPC_MAX_NUMEL=917504",
        "SGLANG_PCIE_IPC_MAX_NUMEL=" + "1" + "0" * 18,
    ],
)
def test_an_sglang_key_in_an_env_file_is_refused_with_what_to_do(tmp_path, line):
    f = tmp_path / "old.env"
    f.write_text(f"# an env file written before the backend moved to the record\nNCCL_P2P_LEVEL=SYS\n{line}\n")
    before = f.read_bytes()
    with pytest.raises(UserError) as err:
        read_env_file(f)
    msg = str(err.value)
    key = line.split("=")[0]
    assert msg.startswith(f"{f}: line 3: {key}: env files hold NCCL settings only") and "\n" not in msg
    assert "rerun `fastverify tune --write-env`" in msg and "deployment record" in msg and "P2P" in msg
    assert f.read_bytes() == before


@pytest.mark.parametrize("value", ["17179869185", "1" + "0" * 18, "1" + "0" * 29])
def test_a_workspace_size_past_the_bounds_says_the_bound(value):
    """What launch checks before an inherited SGLANG_PCIE_IPC_MAX_NUMEL reaches SGLang (never from an env
    file any more): the bound of fastverify.bounds, 4096 x 64 x 65536 elements."""
    from fastverify.envfile import check_setting

    with pytest.raises(UserError, match=r"at most 17179869184 elements \(4096 requests x 64 tokens x hidden 65536\)"):
        check_setting("SGLANG_PCIE_IPC_MAX_NUMEL", value, "the environment")
    assert check_setting("SGLANG_PCIE_IPC_MAX_NUMEL", "17179869184", "the environment") == "17179869184"
    with pytest.raises(UserError, match="write 1 .on. or 0 .off."):
        check_setting("SGLANG_ENABLE_PCIE_IPC_ALLREDUCE", "yes", "the environment")


def test_backup_path_follows_a_symlink(tmp_path):
    real = tmp_path / "real.env"
    real.write_text("NCCL_P2P_LEVEL=SYS\n")
    link = tmp_path / "link.env"
    link.symlink_to(real)
    assert outputs.backup_path(tmp_path / "x.env") == tmp_path / "x.env.bak"
    assert outputs.backup_path(link) == real.with_name("real.env.bak")
