"""Read an ``NCCL_DEBUG=INFO`` log into an :class:`~fastverify.nccl.logrecords.NcclLog`.

Any subsystems, any number of ranks and communicators; other program output mixed in is skipped.
The line forms, and the NCCL source that prints each, are in :mod:`fastverify.nccl.loglines`.

Nothing here raises except :class:`~fastverify.errors.UserError`, in two cases: the text has no
NCCL line at all, or a line of a known form holds a number no NCCL prints, past fastverify's
plausibility bounds (:mod:`fastverify.bounds`): a channel index or count beyond NCCL's 64
(``MAXCHANNELS``), a bandwidth that is negative, nan, inf or over 1e6 GB/s, a time outside
[0, 1 hour], a message over 1 TiB, a rank or hop count over 1e9. Such a line is corrupt or
hand-edited, and every field is held to the same rule: the error names the file, the line, the
field and its value. Lines that start like a known form but do not parse (a line cut off) go to
``problems``.
"""

from __future__ import annotations

import re

from fastverify.bounds import (
    MAX_CHANNELS,
    MAX_COUNT,
    MAX_MSG_BYTES,
    implausible_bandwidth,
    implausible_count,
    implausible_time_us,
)
from fastverify.errors import UserError
from fastverify.nccl.loglines import (
    ALGO_BY_ID, BARE_VERSION, CALL, CHANNELS, COMM_INIT, COMM_NEW, ENV, ENV_INVALID, FALLBACK, GRAPH, KNOWN_STARTS,
    LATBW, MAX_LINE, NET_VIA, P2P_FAIL, P2P_VIA, PATH_ITEM, PATHS, PROTO_BY_ID, RING, RING_LINK, SHM_VIA, SYSTEM,
    TABLE_ALGO, TOPO_GPU, TRANSPORT, TREE_ITEM, TREES, TUNE_HEAD, TUNE_ROW, TUNER_NAME, VERSION, find_prefix,
    float_or_none, norm_node,
)
from fastverify.nccl.logrecords import (
    CallChoice, ChannelCounts, CommInfo, Dev, GraphInfo, NcclLog, PathInfo, Ring, RingLink, Transport, Tree, WarnLine,
)

__all__ = ["parse_nccl_log"]


class _State:
    """Mutable accumulator; frozen into an :class:`NcclLog` at the end."""

    def __init__(self, source: str = "<text>") -> None:
        self.source = source
        self.lists: dict[str, list] = {k: [] for k in (
            "comms", "transports", "rings", "ring_links", "trees", "channel_counts", "graphs",
            "graph_fallbacks", "calls", "p2p_unavailable", "tuner_lines", "warnings", "problems")}
        self.versions: list[tuple[str, str | None, int]] = []
        self.paths: dict[str, dict[str, PathInfo]] = {}
        self.gpu_ranks: dict[str, int] = {}
        self.system: tuple[float, float] | None = None
        self.tuning: dict[str, dict[tuple[str, str], tuple[float, float]]] = {}
        self.max_nthreads: dict[tuple[str, str], int] = {}
        self.env: dict[str, str] = {}
        self.env_invalid: dict[str, str] = {}
        self.tuner: str | None = None
        self.tables: dict[tuple[str, str], dict] = {}  # per (pid, tid): TUNING table columns
        self.comm_seen: set[tuple] = set()
        self.old_busid = False  # NCCL < 2.18 prints bus ids in transport brackets
        self.devices: set[int] = set()

    def problem(self, lineno: int, what: str, text: str) -> None:
        """Note a line that started like a known form but was not read (``NcclLog.problems``)."""
        t = " ".join(text.split())
        self.lists["problems"].append(f"line {lineno}: {what}: {t[:100]}")

    def refuse(self, lineno: int, what: str, why: str | None) -> None:
        """Raise the one-line error for a number past fastverify's bounds (``why``, from
        :mod:`fastverify.bounds`); nothing when ``why`` is None."""
        if why:
            raise UserError(f"{self.source}: line {lineno}: {what} {why}: no NCCL prints that "
                            "(a corrupt or hand-edited log; fastverify's plausibility bounds)")

    def channel(self, lineno: int, what: str, value: int | None, *, index: bool = False) -> None:
        """A channel count (<= NCCL's MAXCHANNELS) or a channel index (< MAXCHANNELS)."""
        if value is not None:
            top = MAX_CHANNELS - 1 if index else MAX_CHANNELS
            self.refuse(lineno, what, implausible_count(value, upper=top, what=what)
                        and f"{value} is outside [0, {top}] (NCCL has at most {MAX_CHANNELS} channels, MAXCHANNELS)")

    def bandwidth(self, lineno: int, what: str, value: float) -> None:
        """A bandwidth in GB/s: finite, >= 0, at most 1e6 (:func:`fastverify.bounds.implausible_bandwidth`)."""
        self.refuse(lineno, what, implausible_bandwidth(value))

    def count(self, lineno: int, what: str, value: int, *, lowest: int = 0) -> None:
        """A rank, a rank count or a hop count: in [lowest, 1e9]; -1 (none) allowed with ``lowest=-1``."""
        if not lowest <= value <= MAX_COUNT:
            self.refuse(lineno, what, f"{value} is outside [{lowest}, {MAX_COUNT:g}]")


def _dev(s: str, st: _State) -> Dev:
    """A transport bracket: a device index (NCCL >= 2.18), else the PCI bus id as lower-case hex."""
    if st.old_busid or not s.isdigit() or len(s) >= 4:
        return s.lower()
    return int(s)


def _msg(st: _State, lineno: int, key: tuple[str, str], dev: int, level: str, file: str | None, msg: str) -> None:
    """One message (the text after the prefix) to the first handler that takes it."""
    if level == "WARN":
        st.lists["warnings"].append(WarnLine(msg.strip(), file, dev, lineno))
        return
    s = msg.strip()
    if _tuning_line(st, key, s, lineno):
        return
    for handler in _HANDLERS:
        if handler(st, lineno, s):
            return
    if s.startswith(KNOWN_STARTS) and not _is_other_channel_line(s):
        st.problem(lineno, "line not understood (cut off?)", s)


def _is_other_channel_line(s: str) -> bool:
    # ``Channel 00/0 : 0[0] -> 1[1] [receive] via COLLNET…`` and NVLS/CollNet set-up lines start alike.
    return " via " in s and ("COLLNET" in s or "NVLS" in s)


def _h_version(st: _State, lineno: int, s: str) -> bool:
    m = VERSION.match(s)
    if not m:
        return False
    ver = f"{int(m.group(1))}.{int(m.group(2))}.{int(m.group(3))}"
    st.versions.append((ver, m.group(5), lineno))
    if (int(m.group(1)), int(m.group(2))) < (2, 18):
        st.old_busid = True
    return True


def _h_comm(st: _State, lineno: int, s: str) -> bool:
    m = COMM_NEW.match(s)
    if m:
        info = CommInfo(m.group(1), int(m.group(2)), int(m.group(3)), int(m.group(4)), int(m.group(5)),
                        int(m.group(6)), line=lineno)
    elif "Init " in s and (m := COMM_INIT.match(s)) is not None:
        info = CommInfo(m.group(1), int(m.group(2)), int(m.group(3)), cuda_dev=int(m.group(4)),
                        bus_id=m.group(5).lower(), line=lineno)
    else:
        return False
    seen = (info.comm, info.rank, info.n_ranks, info.n_nodes, info.cuda_dev, info.bus_id)
    if seen not in st.comm_seen:  # "Init START" and "Init COMPLETE" say the same
        st.comm_seen.add(seen)
        st.lists["comms"].append(info)
    return True


def _h_transport(st: _State, lineno: int, s: str) -> bool:
    m = TRANSPORT.match(s)
    if not m:
        return False
    via = m.group(8)
    kw: dict = {}
    if (p := P2P_VIA.match(via)) is not None:
        kind = "P2P"
        kw["read"] = bool(p.group("r1") or p.group("r2") or p.group("r3"))
        kw["ce"] = bool(p.group("ce"))
        if p.group("via") is not None:
            kw["via_rank"] = int(p.group("via"))
    elif SHM_VIA.match(via):
        kind = "SHM"
        kw["ce"] = "CE" in via
    elif NET_VIA.match(via):
        kind = "NET"
    else:
        if not _is_other_channel_line(s):
            st.problem(lineno, "unknown transport", s)
        return True
    channel, src, dst = int(m.group(1)), int(m.group(3)), int(m.group(5))
    st.channel(lineno, "transport channel", channel, index=True)
    st.count(lineno, "transport source rank", src)
    st.count(lineno, "transport destination rank", dst)
    if "via_rank" in kw:
        st.count(lineno, "transport intermediate rank", kw["via_rank"])
    st.lists["transports"].append(Transport(
        channel, int(m.group(2)) if m.group(2) is not None else None, src,
        _dev(m.group(4), st), dst, _dev(m.group(6), st), via, kind,
        direction=m.group(7), line=lineno, **kw))
    return True


def _h_ring(st: _State, lineno: int, s: str) -> bool:
    m = RING.match(s)
    if m:
        c, n = int(m.group(1)), int(m.group(2))
        st.channel(lineno, "ring channel", c, index=True)
        st.channel(lineno, "ring channel count", n)
        ranks = tuple(int(x) for x in m.group(3).split())
        for r in ranks:
            st.count(lineno, "ring rank", r)
        st.lists["rings"].append(Ring(c, n, ranks, lineno))
        return True
    m = RING_LINK.match(s)
    if m:
        c, *ranks = (int(g) for g in m.groups())
        st.channel(lineno, "ring channel", c, index=True)
        for r in ranks:
            st.count(lineno, "ring rank", r, lowest=-1)
        st.lists["ring_links"].append(RingLink(c, *ranks, line=lineno))
        return True
    return False


def _h_trees(st: _State, lineno: int, s: str) -> bool:
    if not s.startswith("Trees"):
        return False
    m = TREES.match(s)
    if not m:
        # NCCL cuts the line at 1023 characters; keep the whole entries
        st.problem(lineno, "Trees line cut off", s)
    for t in TREE_ITEM.finditer(s if m is None else m.group(1)):
        c, d0, d1, d2, r, up = (int(g) for g in t.groups())
        st.channel(lineno, "tree channel", c, index=True)
        for v in (d0, d1, d2, r, up):
            st.count(lineno, "tree rank", v, lowest=-1)
        st.lists["trees"].append(Tree(c, r, (d0, d1, d2), up, lineno))
    return True


def _h_channels(st: _State, lineno: int, s: str) -> bool:
    m = CHANNELS.match(s)
    if not m:
        return False
    g = [None if x is None else int(x) for x in m.groups()]
    for what, v in zip(("coll channels", "collnet channels", "nvls channels", "p2p channels",
                        "p2p channels per peer"), g):
        st.channel(lineno, what, v)
    st.lists["channel_counts"].append(ChannelCounts(g[0], g[1], g[2], g[3], g[4], lineno))
    return True


def _h_graph(st: _State, lineno: int, s: str) -> bool:
    m = GRAPH.match(s)
    if m:
        bw = _bandwidth_pair(st, lineno, s, m.group(4, 5), "bad graph bandwidth")
        if bw is None:
            return True
        bi, be = bw
        st.channel(lineno, "graph nChannels", int(m.group(3)))
        st.bandwidth(lineno, "graph intra bandwidth", bi)
        st.bandwidth(lineno, "graph inter bandwidth", be)
        st.lists["graphs"].append(GraphInfo(int(m.group(1)), int(m.group(2)), int(m.group(3)), bi, be,
                                            m.group(6), m.group(7), int(m.group(8)), lineno))
        return True
    m = FALLBACK.match(s)
    if m:
        st.lists["graph_fallbacks"].append(int(m.group(1)))
        return True
    return False


def _bandwidth_pair(st: _State, lineno: int, s: str, texts: tuple[str, str], what: str) -> tuple[float, float] | None:
    """The two GB/s figures of a GRAPH or System line; ``None``, and a ``problems`` entry ``what``,
    when one of them is not a number."""
    a, b = float_or_none(texts[0]), float_or_none(texts[1])
    if a is None or b is None:
        st.problem(lineno, what, s)
        return None
    return a, b


def _h_system(st: _State, lineno: int, s: str) -> bool:
    m = SYSTEM.match(s)
    if not m:
        return False
    bw = _bandwidth_pair(st, lineno, s, m.group(1, 2), "bad system bandwidth")
    if bw is None:
        return True
    st.bandwidth(lineno, "system maxBw", bw[0])
    st.bandwidth(lineno, "system totalBw", bw[1])
    if st.system is None:
        st.system = bw
    return True


def _h_paths(st: _State, lineno: int, s: str) -> bool:
    """One node's line of paths: every ``node (hops/bw/type)`` entry up to the first that does not parse."""
    m = PATHS.match(s)
    if m and "(" in m.group(2):
        rest = m.group(2)
        src = norm_node(m.group(1))
        row = st.paths.setdefault(src, {})
        pos = 0
        rest_s = rest.lstrip()
        offset = len(rest) - len(rest_s)
        for it in PATH_ITEM.finditer(rest_s):
            if it.start() != pos:
                break
            bw = float_or_none(it.group(3))
            if bw is None:
                break
            st.count(lineno, "path hops", int(it.group(2)))
            st.bandwidth(lineno, f"path bandwidth to {it.group(1)}", bw)
            row[norm_node(it.group(1))] = PathInfo(int(it.group(2)), bw, it.group(4))
            pos = it.end()
        if pos != len(rest_s):
            st.problem(lineno, f"paths line cut at column {offset + pos}", s)
        return True
    return False


def _h_topo_gpu(st: _State, lineno: int, s: str) -> bool:
    m = TOPO_GPU.match(s)
    if m:
        st.count(lineno, "topology GPU rank", int(m.group(2)))
        st.gpu_ranks[norm_node(m.group(1))] = int(m.group(2))
        return True
    return False


def _h_call(st: _State, lineno: int, s: str) -> bool:
    m = CALL.match(s)
    if not m:
        return False
    func, size, algo, proto, lo, hi, t = m.groups()
    if algo.isdigit():
        algo = ALGO_BY_ID.get(int(algo), algo)
    if proto.isdigit():
        proto = PROTO_BY_ID.get(int(proto), proto)
    size_b, lo_c, hi_c = int(size), int(lo) if lo is not None else None, int(hi) if hi is not None else None
    time_us = float_or_none(t) if t is not None else None
    st.refuse(lineno, "call size", implausible_count(size_b, upper=MAX_MSG_BYTES, what="size")
              and f"{size_b} bytes is over 1 TiB")
    st.channel(lineno, "call channel", lo_c, index=True)
    st.channel(lineno, "call channel", hi_c, index=True)
    if time_us is not None:
        st.refuse(lineno, "call time", implausible_time_us(time_us))
    st.lists["calls"].append(CallChoice(func, size_b, algo.upper(), proto.upper(), lo_c, hi_c, time_us, lineno))
    return True


def _h_env(st: _State, lineno: int, s: str) -> bool:
    m = ENV.match(s)
    if m:
        v = m.group(2).strip()
        if re.fullmatch(r"-?\d+\.", v, re.ASCII):  # misc/param.cc prints "%lld."
            v = v[:-1]
        st.env[m.group(1)] = v
        return True
    m = ENV_INVALID.match(s)
    if m:
        st.env_invalid[m.group(2)] = m.group(1)
        return True
    m = P2P_FAIL.match(s)
    if m:
        st.lists["p2p_unavailable"].append((int(m.group(1)), int(m.group(2))))
        return True
    return False


def _h_tuner(st: _State, lineno: int, s: str) -> bool:
    if not (s.startswith("TUNER/Plugin") or "tuner plugin" in s.lower()):
        return False
    st.lists["tuner_lines"].append(s)
    m = TUNER_NAME.match(s)
    if m:
        st.tuner = (m.group(1) or m.group(2)).strip()
    return True


# In this order: the first handler that takes a message reads it.
_HANDLERS = (_h_version, _h_transport, _h_ring, _h_trees, _h_comm, _h_channels, _h_graph, _h_system, _h_paths,
             _h_topo_gpu, _h_call, _h_env, _h_tuner)


def _tuning_line(st: _State, key: tuple[str, str], s: str, lineno: int = 0) -> bool:
    """The model table; its column layout lives in the thread's state between lines."""
    m = TUNE_HEAD.match(s)
    tab = st.tables.setdefault(key, {"algos": [], "cols": []})
    if m:
        head, cells = m.group(1), [c.strip() for c in m.group(2).split("|")]
        cells = [c for c in cells if c]
        if head == "Algorithm":
            tab["algos"], tab["cols"] = [TABLE_ALGO.get(c, c.upper()) for c in cells], []
        elif head == "Protocol":
            n = cells.index(cells[0], 1) if cells and cells[0] in cells[1:] else len(cells)
            tab["cols"] = [(tab["algos"][i // n], p.upper()) for i, p in enumerate(cells)
                           if n and i // n < len(tab["algos"])]
        elif head == "Latency/AlgBw":  # ≤2.17: one table, cells "Tree/LL"
            pairs = [[x.strip() for x in c.split("/", 1)] for c in cells if "/" in c]
            tab["cols"] = [(TABLE_ALGO.get(a, a.upper()), p.upper()) for a, p in pairs]
        elif head == "Max NThreads":
            for col, c in zip(tab["cols"], cells):
                if c.isascii() and c.isdigit() and len(c) <= 30:
                    st.count(lineno, f"TUNING Max NThreads {'/'.join(col)}", int(c))
                    st.max_nthreads.setdefault(col, int(c))
        return True
    if not tab["cols"]:
        return False
    m = TUNE_ROW.match(s)
    if not m:
        return False
    func = m.group(1)
    cells = [c for c in m.group(2).split("|") if c.strip()]
    row = st.tuning.setdefault(func, {})
    for col, c in zip(tab["cols"], cells):
        lb = LATBW.match(c)
        lat, bw = (float_or_none(lb.group(1)), float_or_none(lb.group(2))) if lb else (None, None)
        if lat is not None and bw is not None:
            st.refuse(lineno, f"TUNING {func} {'/'.join(col)} latency", implausible_time_us(lat))
            st.bandwidth(lineno, f"TUNING {func} {'/'.join(col)} bandwidth", bw)
            row.setdefault(col, (lat, bw))  # first communicator's table wins
    return True


def parse_nccl_log(text: str, *, source: str = "<text>") -> NcclLog:
    """Parse ``NCCL_DEBUG=INFO`` output (any subsystems, any number of ranks and communicators).

    Parameters
    ----------
    text
        The log as text; other program output may be mixed in and is skipped.
    source
        Name of the input used in messages (a file path).

    Returns
    -------
    NcclLog
        Records in file order, each with its 1-based ``line``. A text that does not end in a newline
        gets a ``problems`` entry (its last line may be cut off), as does any line that starts like a
        known form but does not parse.

    Raises
    ------
    UserError
        One line naming ``source`` when the text holds no NCCL line at all, or naming ``source``,
        the line, the field and its value when a number is past fastverify's plausibility bounds
        (see the module docstring: channels over 64, bandwidths over 1e6 GB/s or negative, times
        outside [0, 1 hour], sizes over 1 TiB, ranks over 1e9; nan and inf included).
    """
    if not isinstance(text, str):
        raise UserError(f"{source}: expected an NCCL log as text, got {type(text).__name__}")
    st = _State(source)
    lines = text.splitlines()
    n_nccl = _read_lines(st, lines)
    if n_nccl == 0:
        raise UserError(f"{source}: no NCCL log line found (expected lines like "
                        f"'host:pid:tid [0] NCCL INFO …'; run with NCCL_DEBUG=INFO)")
    if lines and not text.endswith(("\n", "\r")):
        st.problem(len(lines), "text ends without a newline; the last line may be cut off", lines[-1])
    return _freeze(st, n_nccl)


def _read_lines(st: _State, lines: list[str]) -> int:
    """Every NCCL line of ``lines`` read into ``st``; returns how many NCCL lines there were."""
    n_nccl = 0
    for lineno, raw in enumerate(lines, start=1):
        if "NCCL " not in raw:
            continue
        m = find_prefix(raw)
        if m is not None and len(raw) > MAX_LINE:
            # NCCL's own lines are at most ~2 KiB (debug.cc buffer); keeps the regexes linear
            n_nccl += 1
            st.problem(lineno, f"line longer than {MAX_LINE} characters skipped", raw[:100])
            continue
        if m is None:
            b = BARE_VERSION.search(raw)
            if b is None:
                continue
            n_nccl += 1
            _h_version(st, lineno, b.group(1))
            continue
        n_nccl += 1
        if int(m.group("dev")) >= 0:
            st.devices.add(int(m.group("dev")))
        key = (m.group("pid"), m.group("tid"))
        msg = raw[m.end():]
        msg = msg[1:] if msg[:1] == " " else msg
        _msg(st, lineno, key, int(m.group("dev")), m.group("level"), m.group("file"), msg)
    return n_nccl


def _freeze(st: _State, n_nccl: int) -> NcclLog:
    """The records of ``st`` as an :class:`NcclLog`; the first version line wins, others are a problem."""
    version = cuda = None
    if st.versions:
        version, cuda, _ = st.versions[0]
        others = sorted({v for v, _, _ in st.versions} - {version})
        if others:
            st.problem(st.versions[0][2], f"several NCCL versions in one log: {[version, *others]}", "")
    L = st.lists
    return NcclLog(
        source=st.source, version=version, cuda_version=cuda,
        comms=tuple(L["comms"]), transports=tuple(L["transports"]), rings=tuple(L["rings"]),
        ring_links=tuple(L["ring_links"]), trees=tuple(L["trees"]), channel_counts=tuple(L["channel_counts"]),
        graphs=tuple(L["graphs"]), graph_fallbacks=tuple(L["graph_fallbacks"]), paths=st.paths,
        gpu_ranks=st.gpu_ranks, max_bw_gbps=st.system[0] if st.system else None,
        total_bw_gbps=st.system[1] if st.system else None, tuning=st.tuning, max_nthreads=st.max_nthreads,
        calls=tuple(L["calls"]), env=st.env, env_invalid=st.env_invalid,
        p2p_unavailable=tuple(L["p2p_unavailable"]), tuner_plugin=st.tuner, tuner_lines=tuple(L["tuner_lines"]),
        warnings=tuple(L["warnings"]), n_nccl_lines=n_nccl, problems=tuple(L["problems"]),
        devices=tuple(sorted(st.devices)),
    )
