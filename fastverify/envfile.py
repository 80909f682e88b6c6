"""Env files with tuned settings, and the CSV of NCCL's example tuner plugin.

Env file format (``nccl_configs/<fingerprint>.env``): ``#`` comment lines, blank lines and plain
``KEY=VALUE`` lines (no quotes, no ``export``, no spaces around ``=``), so that one file reads the
same in ``docker run --env-file FILE`` (everything after the first ``=``, quotes included), systemd
``EnvironmentFile=FILE`` (``#``/``;`` comments, strips quotes, processes backslashes) and
``set -a; . FILE; set +a`` (expands ``$``, runs backticks, splits on ``;``). Values are therefore
restricted to ``A-Z a-z 0-9 _ . , : / @ % + = ^ -``; anything else is refused, not quoted (quoting
would break ``docker --env-file``).

Only :data:`ALLOWED_KEYS` may appear: NCCL settings that pass the catalogue
(:func:`fastverify.nccl.checks.validate_setting`) and ``CUDA_DEVICE_MAX_CONNECTIONS``. No
``SGLANG_*`` switch or size: sourced without fastverify, a switch would start SGLang's PCIe IPC
all-reduce with no P2P check (the start-up hang :mod:`fastverify.patch.launch` refuses); the backend
lives in the deployment record (:mod:`fastverify.deploy`) and ``launch`` sets the switch after the
proof. An env file is written with its record by :func:`fastverify.deploy.write_deployment` (both
or neither); the tuner CSV by :func:`fastverify.outputs.atomic_write_text` (an old file kept as ``.bak``).
"""

from __future__ import annotations

import datetime as _dt
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from fastverify import __version__
from fastverify.bounds import MAX_BATCH, MAX_DRAFT_TOKENS, MAX_HIDDEN
from fastverify.errors import UserError
from fastverify.inputs import read_text
from fastverify.nccl.checks import CATALOGUE, Severity, validate_setting, validate_settings
from fastverify.nccl.version import NcclVersion
from fastverify.outputs import atomic_write_text
from fastverify.registry import BACKENDS as REGISTRY

# --- what may be written --------------------------------------------------------------------------

# NCCL: every setting the catalogue checks (fastverify.nccl.checks.CATALOGUE). NCCL names that
# NCCL reads but the catalogue does not check (NCCL_SOCKET_IFNAME, NCCL_IB_*, ...) are refused:
# a tuned file must hold nothing whose value fastverify cannot vouch for.
NCCL_KEYS = frozenset(s.name for s in CATALOGUE)

# SGLang switches fastverify sets, from the backend registry (SGLang 0.5.23,
# srt/distributed/device_communicators/pcie_ipc_ar.py: SGLANG_ENABLE_PCIE_IPC_ALLREDUCE turns
# FlashInfer's PCIe IPC all-reduce on, SGLANG_PCIE_IPC_MAX_NUMEL bounds its workspace in elements:
# max batch x draft tokens x hidden, decode-sized; a prefill-sized one costs TTFT).
# Never in an env file (module docstring): `fastverify launch` exports the switch itself after the
# P2P proof, and validates an inherited size with check_setting().
SWITCH_KEYS = frozenset(b.sglang_switch for b in REGISTRY if b.sglang_switch)
SIZE_KEYS = frozenset(b.size_env for b in REGISTRY if b.size_env)
SGLANG_KEYS = SWITCH_KEYS | SIZE_KEYS

# CUDA: only CUDA_DEVICE_MAX_CONNECTIONS (hardware work queues per CUDA context; whether the driver
# reads it at cuInit or at context creation is not documented). SGLang overwrites it with 8 in its
# launcher (entrypoints/engine.py); `fastverify launch` restores it at interpreter start in every
# rank (fastverify.patch.launch.settings_env says why); other launchers honour it directly.
# Deliberately NOT allowed: CUDA_VISIBLE_DEVICES — it chooses which GPUs the server runs on, which
# belongs to the deployment (docker --gpus, the unit file), and a tuned file silently overriding it
# would move the server onto GPUs whose topology was never tuned. Nor LD_PRELOAD, PATH, PYTHON*,
# or anything else that changes what code runs.
CUDA_KEYS = frozenset({"CUDA_DEVICE_MAX_CONNECTIONS"})

ALLOWED_KEYS: frozenset[str] = NCCL_KEYS | CUDA_KEYS
"""What an env file may hold: NCCL settings and ``CUDA_DEVICE_MAX_CONNECTIONS``, no switch."""

_KEY_RE = re.compile(r"[A-Z_][A-Z0-9_]*", re.ASCII)
_VALUE_RE = re.compile(r"[A-Za-z0-9_.,:/@%+=^-]+", re.ASCII)
_DECIMAL_RE = re.compile(r"[1-9][0-9]{0,17}", re.ASCII)
_MAX_HEADER_LINE = 500


def _check_key(key: object, where: str, *, launch_keys: bool = False) -> str:
    """``key`` when an env file may hold it (``launch_keys``: also the SGLang variables
    ``launch`` itself exports); one-line :class:`UserError` otherwise."""
    if not isinstance(key, str) or not _KEY_RE.fullmatch(key):
        raise UserError(f"{where}: {key!r} is not an environment variable name (A-Z, 0-9, _)")
    if launch_keys and key in SGLANG_KEYS:
        return key
    if key.startswith("SGLANG_"):
        raise UserError(
            f"{where}: {key}: env files hold NCCL settings only, no SGLang switch or size (sourced "
            "without fastverify, by docker --env-file or systemd EnvironmentFile=, it would start "
            "SGLang's IPC all-reduce with no P2P check): rerun `fastverify tune --write-env`, or delete "
            "the line and keep the backend in the deployment record (`fastverify launch` switches it "
            "on after the P2P proof)"
        )
    if key not in ALLOWED_KEYS:
        if key.startswith("NCCL_"):
            why = "not a setting fastverify's NCCL catalogue checks"
        else:
            why = "env files hold only NCCL_* settings and CUDA_DEVICE_MAX_CONNECTIONS"
        raise UserError(f"{where}: {key} is not allowed in an env file ({why})")
    return key


def _check_value(key: str, value: object, where: str, version: NcclVersion | None) -> str:
    if not isinstance(value, str):
        raise UserError(f"{where}: {key}: value must be text, got {type(value).__name__}")
    if value == "":
        raise UserError(f"{where}: {key} has an empty value (leave the key out instead)")
    if not _VALUE_RE.fullmatch(value):
        bad = next((ch for ch in value if not _VALUE_RE.fullmatch(ch)), value[:1])
        raise UserError(
            f"{where}: {key}={value!r}: character {bad!r} is not allowed (no spaces, '#', quotes, "
            "'$', ';' or backslashes: docker --env-file, systemd and `set -a; . FILE` must read the "
            "same value)"
        )
    if key in NCCL_KEYS:
        f = validate_setting(key, value, version)
        if f.severity is Severity.ERROR:
            raise UserError(f"{where}: {key}={value}: {f.reason}" + (f" ({f.fix})" if f.fix else ""))
    elif key in SWITCH_KEYS:
        if value not in ("0", "1"):
            raise UserError(f"{where}: {key}={value}: write 1 (on) or 0 (off)")
    elif key in SIZE_KEYS:
        most = MAX_BATCH * MAX_DRAFT_TOKENS * MAX_HIDDEN  # the widest verify step fastverify's bounds admit
        if not _DECIMAL_RE.fullmatch(value) or int(value) > most:
            raise UserError(
                f"{where}: {key}={value}: must be a positive decimal integer of at most {most} elements "
                f"({MAX_BATCH} requests x {MAX_DRAFT_TOKENS} tokens x hidden {MAX_HIDDEN})"
            )
    elif key == "CUDA_DEVICE_MAX_CONNECTIONS":
        if not _DECIMAL_RE.fullmatch(value) or not 1 <= int(value) <= 32:
            raise UserError(f"{where}: {key}={value}: must be an integer in 1..32")
    return value


def check_setting(key: str, value: str, where: str, version: NcclVersion | None = None) -> str:
    """Check one ``KEY=VALUE`` that fastverify may export: an env-file name (:data:`ALLOWED_KEYS`)
    or one of the SGLang variables ``launch`` sets itself (:data:`SGLANG_KEYS`: the switch ``0``/``1``,
    the workspace size a positive decimal within the bounds), a plain value, and for ``NCCL_*`` no
    ``error`` finding from :func:`fastverify.nccl.checks.validate_setting` for ``version``.
    Returns ``value``. (The env file itself never holds an SGLang key: :func:`read_env_file`.)

    Raises
    ------
    UserError
        ``<where>: <what is wrong>``.
    """
    return _check_value(_check_key(key, where, launch_keys=True), value, where, version)


def _comment_lines(lines: Iterable[str]) -> list[str]:
    out = []
    for line in lines:
        text = str(line)
        for part in text.splitlines() or [""]:
            part = "".join(ch if ch.isprintable() else "?" for ch in part)[:_MAX_HEADER_LINE]
            out.append(("# " + part).rstrip())
    return out


# --- env files ---------------------------------------------------------------------------------------


def _version_text(version: NcclVersion | None) -> str:
    if version is None:
        return "NCCL version: unknown (values checked against the newest grammar fastverify knows)"
    return f"NCCL version: {version} (values checked against it)"


def render_env(
    settings: Mapping[str, str],
    *,
    header_lines: Sequence[str] = (),
    nccl_version: NcclVersion | str | None = None,
    where: str = "env file",
) -> str:
    """The text of an env file, every key and value checked (written beside its deployment record
    by :func:`fastverify.deploy.write_deployment`).

    Parameters
    ----------
    settings
        Variable → value. Keys must be in :data:`ALLOWED_KEYS`; values must be plain (see the
        module docstring); ``NCCL_*`` values must pass the catalogue for ``nccl_version``.
    header_lines
        Comment lines after the standard ones (fastverify version, UTC time, NCCL version, usage):
        how the values were obtained (measured or predicted), GPUs, topology source, the numbers.
    nccl_version
        The NCCL the server loads; ``None`` checks against the newest grammar and says so.
    where
        What an error names (the file).

    Raises
    ------
    UserError
        A key not allowed (named), a value with a forbidden character, or a value the catalogue
        rejects.
    """
    version = NcclVersion.parse(nccl_version) if isinstance(nccl_version, str) else nccl_version
    body = []
    for key in sorted(settings):
        _check_key(key, where)
        body.append(f"{key}={_check_value(key, settings[key], where, version)}")
    check_together(dict(settings), where, version)

    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    head = [
        f"written by fastverify {__version__} on {stamp} (UTC)",
        _version_text(version),
        "use: docker run --env-file FILE | systemd EnvironmentFile=FILE | set -a; . FILE; set +a",
        *header_lines,
    ]
    if not body:
        head.append("no setting to change: the current environment is already the best candidate")
    return "\n".join(_comment_lines(head) + body) + "\n"


def read_env_file(path: str | Path, *, nccl_version: NcclVersion | str | None = None) -> dict[str, str]:
    """Read an env file strictly, with the rules of :func:`render_env`.

    Blank lines and lines starting with ``#`` are skipped; every other line must be ``KEY=VALUE``
    with an allowed key, a plain value and no key twice.

    Raises
    ------
    UserError
        ``<path>: line N: <what is wrong>``, or the file cannot be read.
    """
    path = Path(path)
    version = NcclVersion.parse(nccl_version) if isinstance(nccl_version, str) else nccl_version
    # the one input opener (regular file, 16 MiB cap, UTF-8); bytes, since universal newlines
    # would hide a CRLF
    text = read_text(path, kind="text", what="env file")
    out: dict[str, str] = {}
    for n, line in enumerate(text.split("\n"), 1):
        where = f"{path}: line {n}"
        if line.endswith("\r"):
            raise UserError(f"{where}: CRLF line end (docker and systemd would keep the \\r in the value)")
        if line == "" or line.startswith("#"):
            continue
        if line.startswith("export "):
            raise UserError(f"{where}: 'export' is not allowed (docker --env-file would read it as part of the name)")
        if "=" not in line:
            raise UserError(f"{where}: expected KEY=VALUE, got {line[:60]!r}")
        key, value = line.split("=", 1)
        if key != key.strip() or value != value.strip():
            raise UserError(f"{where}: spaces around '=' or at the line's ends are not allowed")
        _check_key(key, where)
        if key in out:
            raise UserError(f"{where}: {key} is set twice")
        out[key] = _check_value(key, value, where, version)
    check_together(out, str(path), version)
    return out


def check_together(settings: dict[str, str], where: str, version: NcclVersion | None) -> None:
    """Refuse NCCL settings that contradict each other (each one already valid on its own): the
    catalogue's :func:`~fastverify.nccl.checks.validate_settings` errors, e.g. a minimum channel
    count above the maximum, which NCCL resolves silently against the maximum.

    Raises
    ------
    UserError
        One line naming ``where`` and the setting.
    """
    for f in validate_settings({k: v for k, v in settings.items() if k in NCCL_KEYS}, version):
        if f.severity is Severity.ERROR:
            raise UserError(f"{where}: {f.name}={f.value}: {f.reason}" + (f" ({f.fix})" if f.fix else ""))


def default_env_path(fingerprint: str, folder: str | Path = "nccl_configs") -> Path:
    """``nccl_configs/<fingerprint>.env`` with the fingerprint made safe as a file name: runs of
    anything but ``A-Z a-z 0-9 . _ -`` become ``-``, no leading dot, at most 120 characters."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "-", str(fingerprint)).strip("-.")[:120].strip("-.")
    return Path(folder) / f"{safe or 'box'}.env"


# --- NCCL example tuner plugin CSV ---------------------------------------------------------------------

TUNER_COLLECTIVES = ("broadcast", "reduce", "allgather", "reducescatter", "allreduce")
TUNER_ALGORITHMS = ("tree", "ring", "collnet_direct", "collnet_chain", "nvls", "nvls_tree", "pat")
TUNER_PROTOCOLS = ("ll", "ll128", "simple")
TUNER_MAX_BYTES = 2**63 - 1
TUNER_COLUMNS = "collective_type,min_bytes,max_bytes,algorithm,protocol,channels,nNodes,nRanks"


@dataclass(frozen=True)
class TunerChoice:
    """One row of the example tuner's CSV: for ``collective`` messages of ``min_bytes..max_bytes``
    (inclusive) on ``n_nodes`` nodes of ``n_ranks`` ranks, run ``algorithm``/``protocol`` on
    ``channels`` channels. Names are NCCL's example-plugin spellings (lower case)."""

    min_bytes: int
    max_bytes: int
    algorithm: str
    protocol: str
    channels: int
    n_ranks: int
    n_nodes: int = 1
    collective: str = "allreduce"

    def row(self) -> str:
        return (
            f"{self.collective},{self.min_bytes},{self.max_bytes},{self.algorithm},{self.protocol},"
            f"{self.channels},{self.n_nodes},{self.n_ranks}"
        )


def _check_choice(i: int, c: TunerChoice) -> None:
    where = f"tuner row {i}"

    def is_int(v: object) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    if c.collective not in TUNER_COLLECTIVES:
        raise UserError(
            f"{where}: collective {c.collective!r}: expected one of {', '.join(TUNER_COLLECTIVES)} "
            "(lower case: the plugin compares with strcmp)"
        )
    if c.algorithm not in TUNER_ALGORITHMS:
        raise UserError(
            f"{where}: algorithm {c.algorithm!r}: expected one of {', '.join(TUNER_ALGORITHMS)} "
            "(the plugin reads anything else as ring)"
        )
    if c.protocol not in TUNER_PROTOCOLS:
        raise UserError(
            f"{where}: protocol {c.protocol!r}: expected one of {', '.join(TUNER_PROTOCOLS)} "
            "(the plugin reads anything else as simple)"
        )
    if not is_int(c.channels) or not 1 <= c.channels <= 64:
        raise UserError(
            f"{where}: channels {c.channels!r}: need an explicit count in 1..64 (the example plugin "
            "pins -1 and unmatched sizes to ONE channel)"
        )
    if not (is_int(c.min_bytes) and is_int(c.max_bytes) and 0 <= c.min_bytes <= c.max_bytes <= TUNER_MAX_BYTES):
        raise UserError(f"{where}: byte range {c.min_bytes!r}..{c.max_bytes!r}: need 0 <= min <= max")
    for name in ("n_ranks", "n_nodes"):
        v = getattr(c, name)
        if not is_int(v) or v < 1:
            raise UserError(f"{where}: {name} {v!r}: need a positive count")


def render_tuner_config(choices: Iterable[TunerChoice], *, header_lines: Sequence[str] = ()) -> str:
    """The CSV text :func:`write_tuner_config` writes (validated the same way)."""
    rows = list(choices)
    if not rows:
        raise UserError("tuner config: no rows (an empty file pins every collective to one channel)")
    for i, c in enumerate(rows):
        _check_choice(i, c)
    # First matching line wins: an overlap would silently hide the later row.
    seen: dict[tuple, list[tuple[int, int, int]]] = {}
    for i, c in enumerate(rows):
        key = (c.collective, c.n_nodes, c.n_ranks)
        for lo, hi, j in seen.get(key, []):
            if c.min_bytes <= hi and lo <= c.max_bytes:
                raise UserError(f"tuner row {i} ({c.row()}) overlaps row {j}: the plugin would never use part of it")
        seen.setdefault(key, []).append((c.min_bytes, c.max_bytes, i))

    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    head = [
        f"NCCL example tuner plugin config (NCCL_TUNER_CONFIG_FILE), written by fastverify {__version__} "
        f"on {stamp} (UTC)",
        "load with NCCL_TUNER_PLUGIN=<path to libnccl-tuner-example.so>; NCCL >= 2.27.7 reads this CSV",
        "every row has an explicit channel count: the example plugin runs -1 and unmatched sizes on 1 channel",
        *header_lines,
        TUNER_COLUMNS,
    ]
    return "\n".join(_comment_lines(head) + [c.row() for c in rows]) + "\n"


def write_tuner_config(path: str | Path, choices: Iterable[TunerChoice], *, header_lines: Sequence[str] = ()) -> Path:
    """Write the example tuner plugin's CSV (``collective_type,min_bytes,max_bytes,algorithm,protocol,
    channels,nNodes,nRanks``), atomically, an existing file kept as ``<path>.bak``.

    Raises
    ------
    UserError
        No rows, a name the plugin does not know, a channel count that is not explicit and
        positive, a bad byte range, overlapping rows, or the file cannot be written.
    """
    return atomic_write_text(Path(path), render_tuner_config(choices, header_lines=header_lines))
