"""The real GPU peer-to-peer (P2P) check: every GPU pair tested in child processes, cached per box.

For each unordered GPU pair ``{i, j}`` one child (``python -m fastverify.topo.p2p pair i j OUT``)
starts two side processes, one per GPU (:func:`run_side`), that read and write each
other's memory over CUDA IPC. Direction ``(i, j)`` = memory on GPU ``i``, accessed from GPU ``j``.
Everything that can hang runs in a child with a timeout; no answer in time yields
``P2PResult(False, "timeout ...", timed_out=True)``, a status of its own (neither passed nor
failed: a slow start looks the same as a hang), never cached and retried on the next run.
Passes and failures are cached per box (:func:`cache_path`); ``fastverify p2p``
prints or writes the check file that proves P2P (:mod:`fastverify.topo.p2p_proof`).

The per-box cache, ``<cache>/p2p-<fingerprint>.json`` (:func:`box_key`, :func:`read_cache`,
:func:`write_cache`). The fingerprint covers GPU names, PCI bus ids, the driver version (NVML's, and
the loaded kernel module's from ``/proc/driver/nvidia/version``), the kernel command line
(``/proc/cmdline``: IOMMU and ACS switches decide whether peer traffic works),
``CUDA_VISIBLE_DEVICES`` and ``CUDA_DEVICE_ORDER`` (both change what CUDA ordinal ``i`` means); the
key itself is repeated inside the file, so a fingerprint collision or a file from another box is
never read as ours. Passes and failures are cached; timeouts never are (written or read: an older
file may hold them), so a direction that timed out is tested again on the next run.

One GPU's side of a pair test (:func:`run_side`; needs CUDA; run as ``python -m fastverify.topo.p2p
side``). The driver's P2P report (``cudaDeviceCanAccessPeer``, NVML's P2P status) can say yes where
P2P reads or writes fail, hang or corrupt data (IOMMU/ACS settings, some BIOSes and consumer
boards); vLLM tests P2P for real before enabling its custom all-reduce for that reason
(``custom_all_reduce_utils.py::gpu_p2p_access_check``). Each side allocates a 4 MiB buffer on its
GPU, fills it with its own byte pattern and publishes the buffer's CUDA IPC handle
(``UntypedStorage._share_cuda_``, the call behind ``torch.multiprocessing``'s CUDA sharing). It
opens the peer's handle **under its own device** (``UntypedStorage._new_shared_cuda``), so every
torch op on the peer's memory runs on its own GPU and crosses the PCIe/NVLink fabric: it reads the
peer pattern back (P2P read), writes a second pattern with a copy-engine copy (first half) and an SM
kernel (second half) (P2P write), and finally checks that its own buffer holds what the peer wrote.
This is legacy CUDA IPC (``cudaIpcOpenMemHandle``), the mechanism of the PCIe IPC all-reduces
(SGLang/vLLM custom all-reduce, FlashInfer); NCCL may use cuMem handles instead
(``NCCL_CUMEM_ENABLE``), which share the same fabric path."""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from fastverify.bounds import MIN_P2P_SIDE_S
from fastverify.errors import EXIT_USER_ERROR, UserError, one_line, shown
from fastverify.outputs import check_outputs, claim_output, write_files
from fastverify.procs import RankGroup, child_env, exit_reason, rank_workdir, stderr_path
from fastverify.topo import nvml as topo_nvml
from fastverify.topo.gpu_identity import gpu_identities
from fastverify.topo.p2p_proof import (
    POLL_S,
    P2PResult,
    check_document,
    count_statuses,
    results_from_json,
    results_to_json,
    write_json_atomic,
)

DEFAULT_TIMEOUT_S = 120.0
NO_CUDA = "no CUDA GPUs: the real P2P check needs a GPU box"


def side_timeout_s(timeout_s: float) -> float:
    """Seconds each side process of a pair gets (its ``--timeout``) when the pair child gets
    ``timeout_s``: a little less, so the pair child can report which step hung."""
    return max(1.0, timeout_s * 0.9 - 2.0)


MIN_TIMEOUT_S = float(math.ceil((MIN_P2P_SIDE_S + 2.0) / 0.9))
"""The least per-pair timeout, seconds: the one whose sides get :data:`fastverify.bounds.MIN_P2P_SIDE_S`."""


def check_timeout(timeout_s: float, flag: str = "--timeout") -> None:
    """Refuse a per-pair timeout under :data:`MIN_TIMEOUT_S` (UserError, one line)."""
    if timeout_s < MIN_TIMEOUT_S:
        raise UserError(
            f"{flag} {timeout_s:g}: under {MIN_TIMEOUT_S:g} s per pair leaves each side process of the "
            f"P2P check less than {MIN_P2P_SIDE_S:g} s, less than a cold `import torch` can take; give "
            f"at least {MIN_TIMEOUT_S:g}"
        )


# argv of the child that tests the unordered pair {i, j} and writes its JSON result to out_path.
ChildArgv = Callable[[int, int, Path], Sequence[str]]


def default_child_argv(timeout_s: float = DEFAULT_TIMEOUT_S) -> ChildArgv:
    """The real pair child: ``python -m fastverify.topo.p2p pair I J OUT --timeout S`` (the inner
    timeout, :func:`side_timeout_s`, is a little shorter, so the child can report which step hung)."""
    inner = side_timeout_s(timeout_s)

    def argv(i: int, j: int, out_path: Path) -> list[str]:
        return [
            sys.executable,
            "-m",
            "fastverify.topo.p2p",
            "pair",
            str(i),
            str(j),
            str(out_path),
            "--timeout",
            f"{inner:g}",
        ]

    return argv


def _child_env() -> dict[str, str]:
    env = child_env()  # the parent's environment, this package importable
    # Expandable segments export cuMem handles instead of cudaIpc ones; test the legacy path that
    # the PCIe IPC all-reduces use.
    env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:False"
    return env


def _tail(text: bytes | str | None, limit: int = 200) -> str:
    if not text:
        return ""
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    last = lines[-1] if lines else ""
    return last if len(last) <= limit else last[: limit - 3] + "..."


def _file_tail(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - 4096))
            return _tail(f.read())
    except OSError:
        return ""


def run_pair_child(
    argv: Sequence[str],
    i: int,
    j: int,
    out_path: Path,
    timeout_s: float,
    env: dict[str, str] | None = None,
    stop: threading.Event | None = None,
) -> dict[tuple[int, int], P2PResult]:
    """Run one pair child with a timeout and read its result file; both directions ``(i, j)`` and
    ``(j, i)`` always get a result (a failure reason when the child did not give one).

    The child runs under :class:`fastverify.procs.RankGroup`, the one launcher: its own process
    group (so the side processes it starts go with it), stdout and stderr in a temporary folder
    that is removed afterwards, and one kill rule at the end (SIGTERM to the group, SIGKILL after
    the grace period). ``stop`` set (Ctrl-C in the caller) ends the wait at once: the child is
    stopped by that rule and both directions say ``interrupted`` (never returned to a caller,
    which re-raises the interrupt)."""

    def both(ok: bool, reason: str, timed_out: bool = False) -> dict[tuple[int, int], P2PResult]:
        return {(i, j): P2PResult(ok, reason, timed_out), (j, i): P2PResult(ok, reason, timed_out)}

    with RankGroup(prefix="fastverify-p2p-child-", env=env, capture_stdout=True) as child:
        try:
            child.start([argv])
        except OSError as err:
            return both(False, f"could not start the check: {err}")
        deadline = time.monotonic() + timeout_s
        while not child.all_exited():
            if stop is not None and stop.is_set():
                return both(False, "interrupted", timed_out=True)
            if time.monotonic() >= deadline:
                return both(
                    False,
                    f"timeout: no answer within {timeout_s:g} s (P2P access hung or the child "
                    "started slowly; not a failure: retried on the next run)",
                    timed_out=True,
                )
            time.sleep(POLL_S)
        code = child.returncode(0)
        stderr, stdout = _file_tail(stderr_path(child.workdir, 0)), _file_tail(child.workdir / "rank0.stdout")
    if code != 0:
        return both(False, f"check process failed ({exit_reason(code)}): {stderr or stdout or 'no output'}")
    try:
        doc = json.loads(out_path.read_text())
        results = results_from_json(doc.get("results") if isinstance(doc, dict) else None)
    except (OSError, ValueError, UnicodeDecodeError) as err:
        return both(False, f"check process wrote no readable result ({' '.join(str(err).split())[:120]})")
    out = {}
    for pair in ((i, j), (j, i)):
        out[pair] = results.get(pair, P2PResult(False, "check process gave no result for this direction"))
    return out


def gpu_count_or_fail() -> int:
    try:
        import torch  # noqa: PLC0415
    except ImportError as err:
        raise UserError(f"{NO_CUDA} (torch is not installed: {' '.join(str(err).split())})") from None
    if not torch.cuda.is_available() or torch.cuda.device_count() < 1:
        raise UserError(NO_CUDA)
    return torch.cuda.device_count()


def check_p2p(
    *,
    pairs: Iterable[tuple[int, int]] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    cache_dir: str | os.PathLike | None = None,
    refresh: bool = False,
    max_parallel: int = 4,
    n_gpus: int | None = None,
    key: dict | None = None,
    child_argv: ChildArgv | None = None,
    gpus: Sequence[dict] | None = None,
) -> dict[tuple[int, int], P2PResult]:
    """Test P2P between GPUs for real, in child processes; cached per box.

    Parameters
    ----------
    pairs
        Unordered GPU pairs (CUDA ordinals) to test; default every pair of ``range(n_gpus)``.
    timeout_s
        Wall-clock limit per pair child, seconds; a child still running then is killed with its
        process group and both directions get ``P2PResult(False, "timeout: ...", timed_out=True)``
        (not cached: the next call tests them again).
    cache_dir
        Folder of ``p2p-<fingerprint>.json``; default ``$FASTVERIFY_CACHE_DIR`` or
        ``~/.cache/fastverify``.
    refresh
        Ignore cached results (they are still rewritten). Timeouts are never cached: those
        directions are always tested again.
    max_parallel
        Pair children running at once.
    n_gpus, key, child_argv
        For tests and callers that know better: the GPU count (default torch's), the box key
        (default :func:`box_key`), and the pair child's argv (default :func:`default_child_argv`).
        With the default child the CUDA check below applies.
    gpus
        The GPUs' identities (:func:`gpu_identities`), written into the cache file with the results.

    Returns
    -------
    dict[tuple[int, int], P2PResult]
        Both directions of every pair: ``(i, j)`` means memory on GPU i accessed from GPU j.

    Raises
    ------
    UserError
        ``no CUDA GPUs: the real P2P check needs a GPU box`` when the real check is asked for and
        torch sees no CUDA device.
    """
    if child_argv is None:
        count = gpu_count_or_fail()
        n_gpus = count if n_gpus is None else n_gpus
        child_argv = default_child_argv(timeout_s)
    if n_gpus is None:
        raise ValueError("n_gpus is required with a custom child_argv")
    wanted = sorted(
        {
            (min(p), max(p))
            for p in (pairs if pairs is not None else [(a, b) for a in range(n_gpus) for b in range(a + 1, n_gpus)])
        }
    )
    for a, b in wanted:
        if a == b or not (0 <= a < n_gpus and 0 <= b < n_gpus):
            raise ValueError(f"GPU pair ({a}, {b}) is not two different GPUs of 0..{n_gpus - 1}")
    box = key if key is not None else box_key()
    path = cache_path(box, cache_dir)
    cached = {} if refresh else read_cache(path, box)
    todo = [(a, b) for a, b in wanted if (a, b) not in cached or (b, a) not in cached]
    results = dict(cached)
    if todo:
        with rank_workdir("fastverify-p2p-") as tmp:
            results.update(_run_pairs(todo, child_argv, Path(tmp), timeout_s, max_parallel))
        write_cache(path, box, results, gpus)
    return {p: results[p] for a, b in wanted for p in ((a, b), (b, a))}


def _run_pairs(
    todo: Sequence[tuple[int, int]], child_argv: ChildArgv, tmp: Path, timeout_s: float, max_parallel: int
) -> dict[tuple[int, int], P2PResult]:
    """Both directions of every pair in ``todo``, ``max_parallel`` pair children at a time.

    Ctrl-C (or any exception) while waiting cancels the pairs not yet started, tells the running
    ones to stop their children (process groups, :func:`run_pair_child`) and re-raises once they
    have: the caller leaves within the kill rule's grace period, not after every queued pair."""
    env, stop, results = _child_env(), threading.Event(), {}
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, max_parallel))
    try:
        futures = [
            pool.submit(
                run_pair_child,
                child_argv(a, b, tmp / f"pair-{a}-{b}.json"),
                a,
                b,
                tmp / f"pair-{a}-{b}.json",
                timeout_s,
                env,
                stop,
            )
            for a, b in todo
        ]
        for future in futures:
            results.update(future.result())
    except BaseException:
        stop.set()
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown(wait=True)
    return results


def run_pair(i: int, j: int, out_path: Path, timeout_s: float) -> None:
    """Test both directions between GPUs ``i`` and ``j`` with two side processes; write
    ``{"results": [{"src", "dst", "ok", "reason"[, "timed_out"]}, ...]}`` to ``out_path``."""
    deadline = time.monotonic() + timeout_s + 5.0
    gpu_of = {"a": i, "b": j}
    # The two sides run under the one launcher (fastverify.procs.RankGroup): side "a" is rank 0,
    # "b" rank 1; their stderr and reports live in its temporary folder, removed on leaving.
    with RankGroup(prefix="fastverify-p2p-pair-") as group:
        workdir = group.workdir
        sides = {"a": 0, "b": 1}
        group.start(
            [
                sys.executable,
                "-m",
                "fastverify.topo.p2p",
                "side",
                me,
                peer,
                str(gpu_of[me]),
                str(gpu_of[peer]),
                str(workdir),
                "--timeout",
                f"{timeout_s:g}",
            ]
            for me, peer in (("a", "b"), ("b", "a"))
        )
        while not group.all_exited() and time.monotonic() < deadline:
            time.sleep(POLL_S)
        errors: dict[str, dict] = {}
        for me, rank in sides.items():
            code = group.returncode(rank)
            if code is None:
                errors[me] = {
                    "ok": False,
                    "reason": f"timeout: GPU {gpu_of[me]}'s side gave no answer within {timeout_s:g} s",
                    "timed_out": True,
                }
            elif code != 0:
                err = _file_tail(stderr_path(workdir, rank))
                errors[me] = {
                    "ok": False,
                    "reason": f"GPU {gpu_of[me]}'s side failed ({exit_reason(code)}): {err or 'no output'}",
                }
        group.stop()  # the kill rule, before the reports are read: a hung side writes nothing more
        reports = {}
        for me in sides:
            try:
                reports[me] = json.loads((workdir / f"{me}.report.json").read_text())
            except (OSError, ValueError):
                reports[me] = None

    def direction(owner: str, user: str) -> dict:
        # Memory of `owner`, accessed from `user`: user's access report, then owner's check of the write.
        for side in (user, owner):
            if reports[side] is None:
                return errors.get(side, {"ok": False, "reason": f"GPU {gpu_of[side]}'s side wrote no report"})
        access, own = reports[user]["access"], reports[owner]["own"]
        return own if access["ok"] and not own["ok"] else access

    rows = [dict(src=i, dst=j, **direction("a", "b")), dict(src=j, dst=i, **direction("b", "a"))]
    write_json_atomic(out_path, {"results": rows})


def run_check_command(*, output: Path | None, timeout_s: float, refresh: bool, force: bool = False) -> int:
    """``fastverify p2p``: the check on every GPU pair, its JSON (:func:`check_document`) printed,
    or written to ``output`` by the one writer (:func:`fastverify.outputs.write_files`) with a
    one-line summary (:func:`summary_line`). An existing ``output`` is replaced only with ``force``
    (:func:`fastverify.outputs.claim_output`). Returns 0 when every ordered pair passed, else 1.

    Raises
    ------
    UserError
        No GPU pair to check (fewer than 2 GPUs, no NVIDIA driver), an unusable ``output``, or a
        ``timeout_s`` under :data:`MIN_TIMEOUT_S`.
    """
    check_timeout(timeout_s)
    if output is not None:
        check_outputs({"--output": output})
        claim_output(output, "--output", force=force)  # an existing file only with --force
    gpu_count_or_fail()
    gpus = gpu_identities()
    results = check_p2p(timeout_s=timeout_s, refresh=refresh, gpus=gpus)
    text = json.dumps(check_document(results, gpus), indent=1) + "\n"
    if output is None:
        sys.stdout.write(text)
        if not all(r.ok for r in results.values()):
            print(shown(summary_line(results)), file=sys.stderr)
    else:
        write_files([(output, lambda tmp: tmp.write_text(text))])
        sys.stdout.write(shown(f"{summary_line(results)}; wrote {output}") + "\n")
    return 0 if all(r.ok for r in results.values()) else 1


def summary_line(results: dict[tuple[int, int], P2PResult]) -> str:
    """``P2P: P of N ordered GPU pairs passed`` plus the failures and the timeouts, each said as
    such (a timeout is not a failure: it was not cached and is retried on the next run)."""
    n = count_statuses(results.values())
    line = f"P2P: {n['passed']} of {len(results)} ordered GPU pairs passed"
    if n["failed"]:
        line += f", {n['failed']} failed"
    if n["timeout"]:
        line += (
            f", {n['timeout']} timed out (no answer in time: not a failure, not cached; run `fastverify p2p` "
            "again to retry them)"
        )
    return line


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fastverify.topo.p2p", description="Real GPU P2P check (children of fastverify topo)."
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    check = sub.add_parser("check", help="test every GPU pair; print JSON results")
    check.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds per pair")
    check.add_argument("--cache-dir", default=None)
    check.add_argument("--refresh", action="store_true")
    pair = sub.add_parser("pair", help="(internal) test GPUs I and J both ways")
    pair.add_argument("i", type=int)
    pair.add_argument("j", type=int)
    pair.add_argument("out", type=Path)
    pair.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S)
    side = sub.add_parser("side", help="(internal) one GPU's side of a pair test")
    side.add_argument("me", choices=["a", "b"])
    side.add_argument("peer", choices=["a", "b"])
    side.add_argument("my_gpu", type=int)
    side.add_argument("peer_gpu", type=int)
    side.add_argument("workdir", type=Path)
    side.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S)
    args = parser.parse_args(argv)
    if args.cmd == "check":
        try:
            check_timeout(args.timeout)
            gpu_count_or_fail()
            gpus = gpu_identities()
            results = check_p2p(timeout_s=args.timeout, cache_dir=args.cache_dir, refresh=args.refresh, gpus=gpus)
        except UserError as err:
            print(f"error: {one_line(str(err))}", file=sys.stderr)
            return EXIT_USER_ERROR
        sys.stdout.write(json.dumps(check_document(results, gpus), indent=1) + "\n")  # closed: raises
        if not all(r.ok for r in results.values()):
            print(shown(summary_line(results)), file=sys.stderr)
        return 0 if all(r.ok for r in results.values()) else 1
    if args.cmd == "pair":
        # The launcher's kill rule starts with SIGTERM: leave through the ``with`` blocks, so the
        # sides are stopped and the pair's temporary folder is removed before SIGKILL would come.
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
        run_pair(args.i, args.j, args.out, args.timeout)
        return 0
    run_side(args.me, args.peer, args.my_gpu, args.peer_gpu, args.workdir, args.timeout)
    return 0


SCHEMA_VERSION = 1  # of the cache file (its own "schema_version")
CMDLINE_PATH = "/proc/cmdline"
"""The kernel command line (Linux ``proc(5)``): ``intel_iommu=``, ``amd_iommu=``, ``iommu=``,
``pci=`` (ACS overrides) change whether P2P works without any GPU or driver change."""
NVIDIA_VERSION_PATH = "/proc/driver/nvidia/version"
"""The loaded NVIDIA kernel module's version line (its first line, ``NVRM version: ...``); it can
differ from NVML's user-space library after an upgrade without a reboot."""


def default_cache_dir() -> Path:
    """``$FASTVERIFY_CACHE_DIR``, else ``~/.cache/fastverify``."""
    env = os.environ.get("FASTVERIFY_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "fastverify"


def _file_first_line(path: str) -> str | None:
    """The file's first line, stripped; None where it cannot be read (no such file, not Linux)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.readline().strip()
    except OSError:
        return None


def box_key(nvml: Any | None = None) -> dict:
    """What identifies this box for the P2P cache: GPU names and PCI bus ids (NVML order), the
    driver version (NVML's, and the kernel module's :data:`NVIDIA_VERSION_PATH`), the kernel command
    line (:data:`CMDLINE_PATH`), ``CUDA_VISIBLE_DEVICES`` and ``CUDA_DEVICE_ORDER``. Without NVML
    the GPU list comes from torch and NVML's driver is ``None``; an unreadable file is ``None``."""
    key: dict[str, Any] = {
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "cuda_device_order": os.environ.get("CUDA_DEVICE_ORDER"),
        "kernel_cmdline": _file_first_line(CMDLINE_PATH),
        "driver_module": _file_first_line(NVIDIA_VERSION_PATH),
    }
    try:
        topo = topo_nvml.read_nvml_topology(nvml)
        key["gpus"] = [[g.name, g.pci_bus_id] for g in topo.gpus]
        key["driver"] = topo.source
    except UserError:
        import torch  # noqa: PLC0415 - optional, only where NVML cannot start

        key["gpus"] = [[torch.cuda.get_device_name(k), None] for k in range(torch.cuda.device_count())]
        key["driver"] = None
    return key


def fingerprint_of(key: dict) -> str:
    """16 hex digits of the SHA-256 of ``key`` as canonical JSON."""
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def cache_path(key: dict, cache_dir: str | os.PathLike | None = None) -> Path:
    """``<cache_dir>/p2p-<fingerprint>.json``; ``cache_dir`` defaults to :func:`default_cache_dir`."""
    return Path(cache_dir if cache_dir is not None else default_cache_dir()) / f"p2p-{fingerprint_of(key)}.json"


def read_cache(path: Path, key: dict) -> dict[tuple[int, int], P2PResult]:
    """Cached results in ``path`` when the file is ours and was written for ``key``, less any
    timeout (retried, module docstring); else ``{}``."""
    try:
        doc = json.loads(path.read_text())
        if (
            not isinstance(doc, dict)
            or doc.get("schema_version") != SCHEMA_VERSION
            or doc.get("fingerprint") != fingerprint_of(key)
            or doc.get("box") != key
        ):
            return {}
        return {p: r for p, r in results_from_json(doc.get("results")).items() if not r.timed_out}
    except (OSError, ValueError, UnicodeDecodeError):
        return {}


def write_cache(
    path: Path, key: dict, results: dict[tuple[int, int], P2PResult], gpus: Sequence[dict] | None = None
) -> None:
    """Write ``results`` less their timeouts (module docstring) atomically (temporary file in the
    same folder, then rename); with
    ``gpus`` (:func:`fastverify.topo.gpu_identity.gpu_identities`) the file names the GPUs too,
    and proves like the check's own output (:func:`fastverify.topo.p2p_proof.read_check_file`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "schema_version": SCHEMA_VERSION,
        "fingerprint": fingerprint_of(key),
        "box": key,
        "written_unix_s": round(time.time(), 3),
        "results": results_to_json({p: r for p, r in results.items() if not r.timed_out}),
    }
    if gpus is not None:
        doc.update(
            cuda_visible_devices=key.get("cuda_visible_devices"),
            cuda_device_order=key.get("cuda_device_order"),
            gpus=list(gpus),
        )
    write_json_atomic(path, doc)


BUFFER_BYTES = 4 << 20
NO_PEER_ACCESS = "driver reports no peer access"  # a direction's reason starts with it: P2P not offered
_SEEDS = {"a": (1, 3), "b": (2, 4)}  # per side: (pattern of its own buffer, pattern it writes to the peer)


class _CheckFailed(Exception):
    """A failure this module diagnosed itself (its message is the whole reason)."""


class _TimedOut(_CheckFailed):
    """No answer from the peer in time: a timeout, not a failure (the report row says
    ``"timed_out": true``; :class:`~fastverify.topo.p2p_proof.P2PResult`)."""


def _pattern(torch: Any, seed: int, n: int, device: str) -> Any:
    """``n`` bytes ``(k * (2*seed + 1) + seed) % 256`` on ``device``: different for each seed."""
    k = torch.arange(n, dtype=torch.int64, device=device)
    return ((k * (2 * seed + 1) + seed) % 256).to(torch.uint8)


def _encode_share(share: Sequence[Any]) -> list:
    return [{"hex": v.hex()} if isinstance(v, bytes) else v for v in share]


def _decode_share(items: list) -> tuple:
    return tuple(bytes.fromhex(v["hex"]) if isinstance(v, dict) else v for v in items)


def _wait_for(path: Path, deadline: float, what: str) -> Any:
    while not path.exists():
        if time.monotonic() > deadline:
            raise _TimedOut(f"timeout waiting for {what}")
        time.sleep(POLL_S)
    return json.loads(path.read_text())


def _failed(err: BaseException) -> dict:
    """A report entry for ``err``: ``{"ok": False, "reason"}``, plus ``"timed_out": True`` for a timeout."""
    return {"ok": False, "reason": _first_line(err), **({"timed_out": True} if isinstance(err, _TimedOut) else {})}


def _first_line(err: BaseException) -> str:
    text = " ".join(str(err).split())[:200]
    if isinstance(err, _CheckFailed):
        return text
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def publish_buffer(torch: Any, me: str, my_gpu: int, workdir: Path) -> Any | None:
    """This side's buffer, its IPC handle published in ``<me>.handle.json``; None when it could
    not be shared, after writing the failure as this side's handle, written flag and report."""
    try:
        torch.cuda.set_device(my_gpu)
        buf = _pattern(torch, _SEEDS[me][0], BUFFER_BYTES, f"cuda:{my_gpu}")
        torch.cuda.synchronize(my_gpu)
        share = tuple(buf.untyped_storage()._share_cuda_())
        if len(share) != 8:
            raise _CheckFailed(
                f"torch's CUDA IPC handle has {len(share)} fields, expected 8 (torch {torch.__version__})"
            )
    except Exception as err:  # noqa: BLE001 - reported to the peer and the pair child
        failed = {"ok": False, "reason": f"GPU {my_gpu} could not share a buffer: {_first_line(err)}"}
        write_json_atomic(workdir / f"{me}.handle.json", {"error": failed["reason"]})
        write_json_atomic(workdir / f"{me}.written.json", {"wrote": False})
        write_json_atomic(workdir / f"{me}.report.json", {"access": failed, "own": failed})
        return None
    write_json_atomic(workdir / f"{me}.handle.json", {"share": _encode_share(share)})
    return buf


def run_side(me: str, peer: str, my_gpu: int, peer_gpu: int, workdir: Path, timeout_s: float) -> None:
    """One side of a pair test (needs CUDA). Writes ``<workdir>/<me>.report.json`` with
    ``access`` (this side's read+write of the peer's buffer) and ``own`` (whether the peer's write
    into this side's buffer arrived). Files it publishes on the way: ``<me>.handle.json`` (its
    buffer's IPC handle, or the error that prevented sharing it) and ``<me>.written.json``."""
    import torch  # noqa: PLC0415

    deadline = time.monotonic() + timeout_s
    n = BUFFER_BYTES
    dev = f"cuda:{my_gpu}"
    buf = publish_buffer(torch, me, my_gpu, workdir)
    if buf is None:
        return

    report: dict[str, Any] = {}
    storage = peer_view = None
    wrote = False
    try:
        doc = _wait_for(workdir / f"{peer}.handle.json", deadline, f"GPU {peer_gpu}'s buffer")
        if "error" in doc:
            raise _CheckFailed(str(doc["error"]))
        peer_share = _decode_share(doc["share"])
        if my_gpu != peer_gpu and not torch.cuda.can_device_access_peer(my_gpu, peer_gpu):
            raise _CheckFailed(f"{NO_PEER_ACCESS} (cudaDeviceCanAccessPeer({my_gpu}, {peer_gpu}) = 0)")
        # Open the peer's buffer under *this* device (first field replaced): the mapping lives in
        # this GPU's context, so the ops below run on this GPU and reach the peer's memory over
        # the fabric. Event sync is off: the peer synchronised before publishing the handle.
        storage = torch.UntypedStorage._new_shared_cuda(my_gpu, *peer_share[1:7], False)
        peer_view = torch.empty((0,), dtype=torch.uint8, device=dev).set_(storage, 0, (n,), (1,))
        seen = peer_view.clone()  # P2P read
        torch.cuda.synchronize(my_gpu)
        bad = int((seen != _pattern(torch, _SEEDS[peer][0], n, dev)).sum().item())
        if bad:
            raise _CheckFailed(f"P2P read returned {bad} of {n} bytes wrong")
        new = _pattern(torch, _SEEDS[me][1], n, dev)
        half = n // 2
        peer_view[:half].copy_(new[:half])  # copy engine (cudaMemcpyAsync device to device)
        torch.bitwise_or(new[half:], 0, out=peer_view[half:])  # SM stores from a kernel
        torch.cuda.synchronize(my_gpu)
        wrote = True
        report["access"] = {"ok": True, "reason": f"GPU {my_gpu} read and wrote {n >> 20} MiB on GPU {peer_gpu}"}
    except Exception as err:  # noqa: BLE001 - every CUDA failure becomes the reason of this direction
        report["access"] = _failed(err)
    write_json_atomic(workdir / f"{me}.written.json", {"wrote": wrote})

    try:
        peer_wrote = _wait_for(workdir / f"{peer}.written.json", deadline, f"GPU {peer_gpu} to write")["wrote"]
        if peer_wrote:
            torch.cuda.synchronize(my_gpu)
            bad = int((buf != _pattern(torch, _SEEDS[peer][1], n, dev)).sum().item())
            report["own"] = (
                {"ok": True, "reason": "the peer's write arrived"}
                if not bad
                else {"ok": False, "reason": f"P2P write from GPU {peer_gpu} left {bad} of {n} bytes wrong"}
            )
        else:
            report["own"] = {"ok": False, "reason": f"GPU {peer_gpu} did not write"}
    except Exception as err:  # noqa: BLE001
        report["own"] = _failed(err)
    try:
        del peer_view, storage  # drop the mapping of the peer's buffer before the peer frees it
        torch.cuda.synchronize(my_gpu)
    except Exception:  # noqa: BLE001 - a sticky CUDA error is already in the report
        pass
    write_json_atomic(workdir / f"{me}.report.json", report)
    # Keep this buffer alive until the peer has dropped its mapping of it.
    try:
        _wait_for(workdir / f"{peer}.report.json", deadline, "the peer to finish")
    except _CheckFailed:
        pass


if __name__ == "__main__":
    sys.exit(main())
