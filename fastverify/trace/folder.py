"""The several-file side of loading traces: which files a ``--trace`` run reads (folders searched,
duplicates and fastverify's own profiles dropped), how many to decode at once, and whether the
ranks read can be the ranks of one run.

:func:`fastverify.trace.load.load_traces` is the public entry point that uses these; nothing here
reads a trace's events.
"""

from __future__ import annotations

from pathlib import Path

from fastverify.errors import UserError, path_text
from fastverify.events import RankEvents

MAX_TRACE_FILES = 1024
"""Most trace files one ``--trace`` run reads: one per rank of one run (SGLang writes one per TP
rank, and tune bounds TP at 64; a DP x TP x PP x EP run of 1,024 GPUs is far past any PCIe box).
A folder with more is the wrong folder (a whole /tmp), refused before any is read."""

PEAK_BYTES_PER_JSON_BYTE = 4
"""A worker's peak memory per byte of inflated trace JSON, rounded up: 207 MB peak RSS (interpreter
and imports included) for the 53.7 MB HTA ``df_index_resolver`` trace, measured with
``/usr/bin/time`` on the benchmark machine (the trace benchmark)."""

PARALLEL_MIN_BYTES = 16 << 20
"""Below this much JSON in all, files are read one after the other: starting worker processes
costs more (30-100 ms measured on 2 cores) than reading two 3 MB traces takes."""

# Facts every rank of one run shares (distributedInfo and deviceProperties), with their wording.
_RUN_FACTS = (("world_size", "distributedInfo.world_size"), ("gpu_name", "GPU model (deviceProperties)"),
              ("nccl_version", "distributedInfo.nccl_version"), ("dist_backend", "distributedInfo.backend"))


def _is_fastverify_profile(path: Path) -> bool:
    """A profile written by fastverify (its first key is ``"schema": "fastverify.profile"``, or
    ``"fastverify.verify_log"`` for ``profile --verify-log``), which a user may well have written
    into the trace folder: not a trace, so a folder scan skips it."""
    try:
        with open(path, "rb") as f:
            head = f.read(64)
    except OSError:
        return False
    return b'"fastverify.profile"' in head or b'"fastverify.verify_log"' in head


def trace_files(paths: list[str | Path]) -> list[Path]:
    """The trace files under ``paths`` (files as given, folders searched for ``*.json`` /
    ``*.json.gz``, sorted by name), each once, in that order.

    Raises
    ------
    UserError
        A path that does not exist, a folder without traces or with a non-regular file named like
        one, or more than :data:`MAX_TRACE_FILES` files.
    """
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            named = sorted(f for f in p.iterdir() if f.name.endswith(".json") or f.name.endswith(".json.gz"))
            odd = [f for f in named if not f.is_file() and not f.is_dir()]
            if odd:  # a FIFO or device named like a trace: refused as it is when given directly
                raise UserError(f"{odd[0]}: not a regular file (a trace folder's *.json / *.json.gz must be files)")
            found = [f for f in named if f.is_file() and not _is_fastverify_profile(f)]
            if not found:
                raise UserError(f"{p}: folder holds no .json or .json.gz trace files")
            files.extend(found)
        elif p.exists():
            files.append(p)
        else:
            raise UserError(f"{p}: no such file or folder")
    seen: set[Path] = set()
    files = [f for f in files if not (f.resolve() in seen or seen.add(f.resolve()))]  # a file given twice counts once
    if len(files) > MAX_TRACE_FILES:
        raise UserError(f"{len(files):,} trace files under {', '.join(path_text(p) for p in paths)[:200]}: more than "
                        f"{MAX_TRACE_FILES:,}, the ranks one run can have; give the folder of one profile")
    return files


def merge_ranks(files: list[Path], loaded: list[list[RankEvents]], *, force: bool) -> list[RankEvents]:
    """The ranks of every file (``loaded[i]`` read from ``files[i]``) as one run, sorted by rank.

    With ``force``, traces that cannot be one run (:func:`merge_conflict`) are merged anyway and
    the first rank's ``meta["merge_conflict"]`` (written in place) says why they should not have been.

    Raises
    ------
    UserError
        Two files claiming the same rank, CPU-only and GPU traces together, or (without ``force``)
        traces of different runs.
    """
    result: dict[int, RankEvents] = {}
    for f, ranks in zip(files, loaded):
        for r in ranks:
            if r.rank in result:
                if r.meta.get("rank_source", "").startswith("default") or \
                        result[r.rank].meta.get("rank_source", "").startswith("default"):
                    raise UserError(f"{f}: no rank in the trace (distributedInfo) or its file name, and "
                                    f"{result[r.rank].origin} is rank {r.rank} too; name files with -TP-<rank>")
                raise UserError(f"{f}: rank {r.rank} also claimed by {result[r.rank].origin}")
            result[r.rank] = r
    kinds = {r.meta["timing"]: r.origin for r in result.values()}
    if len(kinds) > 1:  # GPU kernel times and host wall clock must never be added up together
        raise UserError(f"{kinds.get('cpu_trace')}: a CPU-only trace (host clock), but {kinds.get('trace')} "
                        "has GPU events; profile the traces of one run at a time")
    ordered = [result[k] for k in sorted(result)]
    conflict = merge_conflict(ordered)
    if conflict and not force:
        raise UserError(f"{conflict}; these traces are not one run (pass --force to merge them anyway)")
    if conflict:
        ordered[0].meta["merge_conflict"] = f"merged with --force although {conflict}"
    return ordered


def merge_conflict(ranks: list[RankEvents]) -> str | None:
    """Why ``ranks`` cannot be the ranks of one run, naming both files; None when they can.

    Every rank of one torch.distributed run records the same ``world_size``, NCCL version and
    backend in its ``distributedInfo`` (torch ``profiler/_utils``/Kineto write them per process from
    the one default group), and a TP group runs on one GPU model; a rank absent from a trace
    says nothing. A rank at or past another file's ``world_size`` cannot be in that run either.
    """
    for key, what in _RUN_FACTS:
        seen: dict = {}
        for r in ranks:
            v = r.meta.get(key)
            if v is None:
                continue
            if seen and v not in seen:
                other_v, other = next(iter(seen.items()))
                return f"{what} differs: {other_v!r} in {other}, {v!r} in {r.origin}"
            seen.setdefault(v, r.origin)
    worlds = [(r.meta["world_size"], r.origin) for r in ranks if r.meta.get("world_size")]
    for r in ranks:
        for world, origin in worlds:
            if r.rank >= world:
                return (f"rank {r.rank} of {r.origin} is not below world_size {world} of {origin}")
    return None


def json_size(path: Path) -> int:
    """Bytes of JSON a trace file holds: its size, or for gzip the trailer's ISIZE (the inflated
    size modulo 2**32; RFC 1952), whichever is larger (0 when unreadable)."""
    import stat

    try:
        st = path.stat()
        if not stat.S_ISREG(st.st_mode):  # a FIFO or device is never opened here (the reader refuses it)
            return 0
        size = st.st_size
        with open(path, "rb") as f:
            if f.read(2) != b"\x1f\x8b" or size < 18:
                return size
            f.seek(-4, 2)
            return max(size, int.from_bytes(f.read(4), "little"))
    except OSError:
        return 0


def load_workers(files: list[Path]) -> int:
    """How many files to decode at once: 1 below :data:`PARALLEL_MIN_BYTES` of JSON in all, else
    one per usable core, no more than the files, and no more
    than fit in half of the memory available now at :data:`PEAK_BYTES_PER_JSON_BYTE` times the
    largest file's JSON (so peak memory stays under about ``workers x 4 x`` that size)."""
    import os

    if len(files) < 2:
        return 1
    sizes = [json_size(f) for f in files]
    if sum(sizes) < PARALLEL_MIN_BYTES:
        return 1
    from fastverify.painter import usable_cores

    cores = usable_cores()
    need = PEAK_BYTES_PER_JSON_BYTE * max(sizes)
    try:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        avail = 0
    by_memory = max(1, int(avail // 2 // need)) if need and avail else cores
    return max(1, min(cores, len(files), by_memory))
