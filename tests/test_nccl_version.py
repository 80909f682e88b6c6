"""fastverify.nccl.version: decoding ncclGetVersion's integer, parsing, ordering, finding libnccl.

Expected codes come from the NCCL_VERSION macro in NVIDIA/nccl src/nccl.h.in
(X*1000+Y*100+Z when X <= 2 and Y <= 8, else X*10000+Y*100+Z) and from shared/research/nccl.md §4
(nvidia-nccl-cu12 2.32.3 reports 23203), worked out by hand.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fastverify.errors import UserError
from fastverify.nccl.version import NcclVersion, encode_version, find_libnccl, read_nccl_version

# (code from ncclGetVersion, (major, minor, patch))
CODES = [
    (23203, (2, 32, 3)),  # nvidia-nccl-cu12/cu13 2.32.3 wheel, research notes §4
    (23007, (2, 30, 7)),  # NCCL HEAD read for the notes; SGLang's comment "2.30.7 -> 23007"
    (22000, (2, 20, 0)),  # patch 0: where string slicing of the code goes wrong (STYLE.md §2)
    (22703, (2, 27, 3)),
    (21805, (2, 18, 5)),
    (20906, (2, 9, 6)),  # first release with the 5-digit encoding
    (2804, (2, 8, 4)),  # last release with the 4-digit encoding
    (2708, (2, 7, 8)),
    (1304, (1, 3, 4)),
]


@pytest.mark.parametrize("code,triple", CODES)
def test_from_code_decodes_both_encodings(code, triple):
    v = NcclVersion.from_code(code, library="/x/libnccl.so.2")
    assert (v.major, v.minor, v.patch) == triple
    assert v.code == code
    assert v.library == "/x/libnccl.so.2"


@pytest.mark.parametrize("code,triple", CODES)
def test_encode_matches_the_macro(code, triple):
    assert encode_version(*triple) == code
    assert NcclVersion.of(*triple).code == code


@pytest.mark.parametrize("bad", [0, -1, True, 2.5, "23203", None])
def test_from_code_rejects_non_codes(bad):
    with pytest.raises(ValueError):
        NcclVersion.from_code(bad)


@pytest.mark.parametrize(
    "text,triple",
    [
        ("2.27.5", (2, 27, 5)),
        ("2.27", (2, 27, 0)),
        ("v2.30.7-1", (2, 30, 7)),  # git tag form
        ("2.32.3+cuda12.9", (2, 32, 3)),  # "NCCL version 2.32.3+cuda12.9" log form
        (" 2.8.4 ", (2, 8, 4)),
    ],
)
def test_parse(text, triple):
    v = NcclVersion.parse(text)
    assert (v.major, v.minor, v.patch) == triple
    assert v.library is None


@pytest.mark.parametrize("text", ["", "2", "two.27.5", "2.27.5.1", "2.27.x", "2.100.0", "2.27.5 extra"])
def test_parse_rejects_with_one_line_naming_the_text(text):
    with pytest.raises(UserError) as err:
        NcclVersion.parse(text)
    assert repr(text) in str(err.value) and "\n" not in str(err.value)


def test_str_and_ordering():
    assert str(NcclVersion.from_code(23203)) == "2.32.3"
    assert str(NcclVersion.from_code(22000)) == "2.20.0"
    texts = ["2.24.3", "2.9.6", "2.23.4", "2.8.4", "2.27.5", "2.21.5", "2.18.1"]
    ordered = sorted(NcclVersion.parse(t) for t in texts)
    assert [str(v) for v in ordered] == ["2.8.4", "2.9.6", "2.18.1", "2.21.5", "2.23.4", "2.24.3", "2.27.5"]
    assert NcclVersion.parse("2.23.4") < NcclVersion.parse("2.24.0") <= NcclVersion.parse("2.24")
    # The library a version was read from does not change its identity.
    assert NcclVersion.from_code(22705, library="/a") == NcclVersion.parse("2.27.5")
    assert hash(NcclVersion.from_code(22705, library="/a")) == hash(NcclVersion.parse("2.27.5"))


# --- finding and loading the library -----------------------------------------------------------


def _fake_wheel(site: Path, content: bytes = b"not an ELF file\n") -> Path:
    """The layout of the nvidia-nccl-cu12 wheel: nvidia/ and nvidia/nccl/ without __init__.py."""
    lib = site / "nvidia" / "nccl" / "lib" / "libnccl.so.2"
    lib.parent.mkdir(parents=True)
    lib.write_bytes(content)
    (site / "nvidia" / "nccl" / "include").mkdir()
    return lib


def test_find_libnccl_explicit_then_env_then_wheel(tmp_path, monkeypatch):
    lib = _fake_wheel(tmp_path / "site")
    other_site = tmp_path / "site2"
    (other_site / "nvidia" / "cublas" / "lib").mkdir(parents=True)  # another nvidia wheel, no NCCL
    monkeypatch.syspath_prepend(str(other_site))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    found = find_libnccl("/opt/explicit/libnccl.so.2", environ={"NCCL_LIBRARY": "/opt/env/libnccl.so.2"})
    assert found[:3] == ["/opt/explicit/libnccl.so.2", "/opt/env/libnccl.so.2", str(lib)]
    assert not any("cublas" in p for p in found)
    # Without explicit entries the wheel comes first, and listing is stable and duplicate-free.
    plain = find_libnccl(environ={})
    assert plain[0] == str(lib)
    assert len(plain) == len(set(plain))


def test_find_libnccl_lists_every_wheel_portion_in_sys_path_order(tmp_path, monkeypatch):
    first = _fake_wheel(tmp_path / "a")
    second = _fake_wheel(tmp_path / "b")
    monkeypatch.syspath_prepend(str(tmp_path / "b"))
    monkeypatch.syspath_prepend(str(tmp_path / "a"))
    found = find_libnccl(environ={})
    assert found.index(str(first)) < found.index(str(second))


def test_a_fake_wheel_library_fails_cleanly_and_is_skipped(tmp_path, monkeypatch):
    lib = _fake_wheel(tmp_path / "site")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    v = read_nccl_version(environ={})
    # The fake is skipped; a real library elsewhere on this box may still answer.
    assert v is None or v.library != str(lib)


def test_explicit_library_that_is_not_a_library(tmp_path):
    lib = _fake_wheel(tmp_path / "site")
    with pytest.raises(UserError) as err:
        read_nccl_version(str(lib), environ={})
    message = str(err.value)
    assert str(lib) in message and "\n" not in message


def test_explicit_library_that_does_not_exist(tmp_path):
    missing = tmp_path / "nope" / "libnccl.so.2"
    with pytest.raises(UserError) as err:
        read_nccl_version(str(missing), environ={})
    assert str(missing) in str(err.value) and "\n" not in str(err.value)


def test_explicit_library_without_nccl_symbols():
    libc = "libc.so.6"  # loads everywhere on glibc Linux, has no ncclGetVersion
    with pytest.raises(UserError) as err:
        read_nccl_version(libc, environ={})
    assert libc in str(err.value) and "ncclGetVersion" in str(err.value)


def test_nccl_library_env_is_explicit(tmp_path):
    lib = _fake_wheel(tmp_path / "site")
    with pytest.raises(UserError) as err:
        read_nccl_version(environ={"NCCL_LIBRARY": str(lib)})
    assert str(lib) in str(err.value) and "NCCL_LIBRARY" in str(err.value)


def test_real_libnccl_if_present():
    """Loads the libnccl this box would use and calls ncclGetVersion (no GPU needed)."""
    candidates = [p for p in find_libnccl(environ={}) if os.sep not in p or os.path.isfile(p)]
    version = read_nccl_version(environ={})
    if version is None:
        pytest.skip(
            "no loadable libnccl here (torch CPU build, no nvidia-nccl-cu12/cu13 wheel, no system NCCL); "
            f"candidates tried: {candidates or 'none'}"
        )
    assert version.major == 2 and version.minor >= 9  # every NCCL a current torch or wheel ships
    assert version.code == version.major * 10000 + version.minor * 100 + version.patch
    assert version.library in candidates
    assert read_nccl_version(version.library, environ={}) == version


def test_an_nccl_3_version_is_one_line_in_tune_and_a_note_in_topo(tmp_path, shared_dir):
    """NCCL 3.x is beyond the 2.x releases the cost model knows: tune refuses in one line (exit 2),
    topo still reads the box and says so in a note; neither gives a traceback."""
    from conftest import run_fastverify

    topo = shared_dir / "inputs" / "topo-nccl-tests-307.txt"
    log = tmp_path / "nccl3.log"
    log.write_text("host0:1:1 [0] NCCL INFO NCCL version 3.1.0+cuda12.4\n")
    base = [
        "tune",
        "--predict",
        "--topology",
        str(topo),
        "--model",
        "kimi-k2.5",
        "--tp",
        "8",
        "--sm",
        "120",
        "--pcie-gen",
        "5",
    ]
    for extra in (["--nccl-version", "3.0"], ["--nccl-log", str(log)]):
        proc = run_fastverify(base + extra, cwd=tmp_path)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr
        assert proc.stderr.strip().count("\n") == 0 and "newer than the NCCL 2.x releases" in proc.stderr
    proc = run_fastverify(["topo", "--topology", str(topo), "--nccl-log", str(log)], cwd=tmp_path)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr
    assert "NCCL 3.1.0 is newer than the 2.x releases the cost model knows" in " ".join(proc.stdout.split())
