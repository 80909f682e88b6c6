"""The server parts of ``fastverify collect``: a running SGLang server's arguments and a profiler
trace of its forwards, over its HTTP API (``urllib``).

Endpoints and fields, as SGLang 0.5.23 defines them (``sglang/srt/entrypoints/http_server.py``):
``GET /server_info`` (older releases, and 0.5.23 as a deprecated alias: ``/get_server_info``) is the
resolved server arguments (``tp_size``, ``pp_size``, ``device``, ``speculative_num_draft_tokens``,
``model_path``...) plus ``version``; ``POST /start_profile`` takes a ``ProfileReq``
(``sglang/srt/managers/io_struct.py``), of which collect sends ``output_dir``, ``num_steps``,
``activities`` (``"CPU"``, ``"GPU"``), ``profile_by_stage`` and ``merge_profiles``. With
``num_steps`` the profiler stops by itself after that many forwards and each TP rank writes
``<profile id>-TP-<rank>.trace.json.gz`` into ``output_dir`` (``utils/profile_utils.py``);
``POST /stop_profile`` stops it early. The traces are written by the server, on its own machine.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import orjson

from fastverify.bounds import MAX_DRAFT_TOKENS, MAX_HIDDEN, MAX_WORLD_SIZE, duplicate_json_key, implausible_count
from fastverify.bundle import ARCNAMES, MAX_MEMBER_BYTES
from fastverify.collect.client import ReplyError, http, shown_reply
from fastverify.collect.core import (
    LEFT_OUT_KEYS,
    NOT_REGULAR,
    Context,
    Outcome,
    ServerInfo,
    failed,
    left_out_text,
    ok,
    scan_folder,
    take_regular,
    unfit_name,
)
from fastverify.errors import UserError, one_line, shown
from fastverify.inputs import loads_json, read_bytes
from fastverify.progress import say

INFO_ENDPOINTS = ("/server_info", "/get_server_info")
REACH_TIMEOUT_S = 10.0
POLL_S = 0.5
STABLE_S = 1.0  # a trace file counts as written once its size has not changed for this long
STOP_WAIT_S = 30.0  # after /stop_profile: the ranks export their traces
REQUEST_PROMPT = "fastverify collect: a short request so that the profiler sees forwards."
REQUEST_NEW_TOKENS = 16
SAY_EVERY_S = 10.0
TRACE_GLOB = "*.trace.json*"


def profiler_steps(cycles: int) -> int:
    """SGLang's ``num_steps`` (scheduler steps; one speculative cycle each) for ``cycles`` complete
    cycles: one more, since a cycle runs to the next cycle's start, and one for a prefill step."""
    return cycles + 2


SERVER_INTS = {
    "tp_size": (1, MAX_WORLD_SIZE),
    "pp_size": (1, MAX_WORLD_SIZE),
    "speculative_num_draft_tokens": (1, MAX_DRAFT_TOKENS),
}
"""The integer facts collect takes from a server, and their bounds (:mod:`fastverify.bounds`)."""
SERVER_TEXTS = ("version", "device", "model_path", "speculative_algorithm")
"""The text facts collect takes from a server."""
MAX_FACT_CHARS = 4096  # PATH_MAX: the longest model path, and far past any version or device name


def _shown_value(value: object) -> str:
    return one_line(repr(value), 80) if not isinstance(value, str) else shown_reply(value)


def check_server_facts(info: ServerInfo, raw: bytes) -> None:
    """Refuse a server whose facts no SGLang server states: an integer fact
    (:data:`SERVER_INTS`) that is no int (a bool, a float, a string) or out of bounds, a text fact
    (:data:`SERVER_TEXTS`) that is no string, longer than :data:`MAX_FACT_CHARS` or holds a NUL,
    or a key given twice in one JSON object. A fact that is absent or null is not refused.

    Raises
    ------
    UserError
        One line naming the URL, the field and the value.
    """
    where = f"{info.url}{info.endpoint}"
    if (key := duplicate_json_key(raw)) is not None:
        raise UserError(
            f"{where}: the key {shown_reply(key)} is given twice in one JSON object; which one holds is not known"
        )
    for key, (lower, upper) in SERVER_INTS.items():
        value = info.fact(key)
        if value is not None and implausible_count(value, lower=lower, upper=upper) is not None:
            what = "is outside " if isinstance(value, int) and not isinstance(value, bool) else "is not an integer in "
            raise UserError(f"{where}: {key} {_shown_value(value)} {what}[{lower}, {upper}] (fastverify/bounds.py)")
    for key in SERVER_TEXTS:
        value = info.fact(key)
        if value is not None and (not isinstance(value, str) or len(value) > MAX_FACT_CHARS or "\0" in value):
            what = (
                f"a {type(value).__name__}, not a string"
                if not isinstance(value, str)
                else "holds a NUL"
                if "\0" in value
                else f"{len(value):,} characters, over {MAX_FACT_CHARS}"
            )
            raise UserError(f"{where}: {key} {_shown_value(value)}: {what}")


def fetch_server_info(url: str, timeout_s: float = REACH_TIMEOUT_S) -> ServerInfo:
    """The server's arguments from ``/server_info``, else ``/get_server_info`` (older SGLang),
    their facts checked (:func:`check_server_facts`).

    Raises
    ------
    UserError
        ``cannot reach <url>: <reason>``; one line naming the endpoint and what came back when the
        reply is not HTTP, never ends, is too large or redirects nowhere (:func:`http`); it
        answers, but neither endpoint with a JSON object, or one holding none of the facts
        (:data:`SERVER_INTS`, :data:`SERVER_TEXTS`); a fact out of bounds.
    """
    answers = []
    for endpoint in INFO_ENDPOINTS:
        try:
            status, raw = http("GET", url + endpoint, timeout_s=timeout_s)
        except ReplyError as e:
            raise UserError(str(e) if e.reached else f"cannot reach {url}: {e.reason}") from None
        if status == 200:
            try:
                info = orjson.loads(raw)
            except orjson.JSONDecodeError:
                info = None
            if isinstance(info, dict):
                server = ServerInfo(url, endpoint, raw, info)
                check_server_facts(server, raw)
                if not [k for k in (*SERVER_INTS, *SERVER_TEXTS) if server.fact(k) is not None]:
                    raise UserError(
                        f"{url}{endpoint}: a JSON object with none of the facts collect reads "
                        f"({', '.join((*SERVER_INTS, *SERVER_TEXTS))} all missing): not an SGLang server"
                    )
                return server
            answers.append(f"{endpoint}: not a JSON object")
        else:
            answers.append(f"{endpoint}: HTTP {status}")
    raise UserError(f"{url} answers but is not an SGLang server ({'; '.join(answers)})")


def model_hidden_size(server: ServerInfo) -> int | None:
    """``hidden_size`` of the served model from ``<model_path>/config.json`` when that folder is on
    this machine (``text_config.hidden_size`` for Kimi-K2.5-style configs); else None.

    Raises
    ------
    UserError
        The config states a ``hidden_size`` that is no int or outside ``[1, MAX_HIDDEN]``, or
        gives a key twice.
    """
    path = server.fact("model_path")
    try:
        config = Path(path) / "config.json" if isinstance(path, str) else None
        if config is None or not config.is_file():
            return None
        raw = read_bytes(config, kind="text")
    except (UserError, OSError, ValueError):  # unreadable, a NUL or an over-long name
        return None
    try:
        doc = loads_json(raw, config, unique_keys=False)
    except (UserError, OSError, ValueError):  # not JSON: no hidden size read from it
        return None
    if (key := duplicate_json_key(raw)) is not None:
        raise UserError(f"{config}: the key {shown_reply(key)} is given twice in one JSON object")
    if isinstance(doc, dict) and isinstance(doc.get("text_config"), dict):
        doc = doc["text_config"]
    value = doc.get("hidden_size") if isinstance(doc, dict) else None
    if value is None:
        return None
    if why := implausible_count(value, lower=1, upper=MAX_HIDDEN, what="hidden_size"):
        raise UserError(f"{config}: hidden_size {why} (fastverify/bounds.py MAX_HIDDEN)")
    return value


def server_args(ctx: Context, limit_s: float) -> Outcome:
    """The server-info JSON read before the run (the reachability check), as received; its meta
    has the key facts and the verify shapes collect took from them."""
    s = ctx.server
    return ok(
        {ARCNAMES["server_args"]: s.raw},
        url=s.url,
        endpoint=s.endpoint,
        sglang_version=s.fact("version"),
        tp_size=s.fact("tp_size"),
        pp_size=s.fact("pp_size"),
        device=s.fact("device"),
        speculative_algorithm=s.fact("speculative_algorithm"),
        speculative_num_draft_tokens=s.fact("speculative_num_draft_tokens"),
        model_path=s.fact("model_path"),
        verify_shapes=ctx.shapes.as_meta(),
        missing_facts=[k for k in (*SERVER_INTS, *SERVER_TEXTS) if s.fact(k) is None],
    )


def activities(server: ServerInfo) -> tuple[list[str], str]:
    """Profiler activities for the server and why: GPU kernels too on a CUDA server."""
    device = server.fact("device")
    if isinstance(device, str) and device:
        return (
            (["CPU", "GPU"], f"server device {device}")
            if device.startswith("cuda")
            else (["CPU"], f"server device {device}")
        )
    import torch

    cuda = torch.cuda.is_available()
    return (
        ["CPU", "GPU"] if cuda else ["CPU"]
    ), f"server names no device; CUDA {'is' if cuda else 'is not'} available here"


def _send_requests(url: str, n: int, deadline: float, statuses: list) -> None:
    body = {"text": REQUEST_PROMPT, "sampling_params": {"max_new_tokens": REQUEST_NEW_TOKENS, "temperature": 0}}
    for _ in range(n):
        left = deadline - time.monotonic()
        if left <= 1:
            return
        try:
            statuses.append(http("POST", url + "/generate", body, timeout_s=left)[0])
        except OSError as e:
            statuses.append(f"no answer: {e.reason if isinstance(e, ReplyError) else e}")


def _written(folder: Path, expected: int, sizes: dict) -> list[str] | None:
    """The names of the trace entries once at least ``expected`` exist and none has changed size
    for :data:`STABLE_S`; else None. Sizes are ``lstat``'s (a link is never followed); ``sizes``:
    name -> (size, since when), kept between calls."""
    now = time.monotonic()
    regular, other = scan_folder(folder, (TRACE_GLOB,))
    for name in (*regular, *other):
        try:
            size = os.lstat(folder / name).st_size
        except OSError:
            size = None
        if sizes.get(name, (None,))[0] != size:
            sizes[name] = (size, now)
    names = [*regular, *other]
    if len(names) >= expected and all(now - sizes[n][1] >= STABLE_S for n in names):
        return names
    return None


def _wait(folder: Path, expected: int, deadline: float, quiet: bool, what: str) -> list[str] | None:
    sizes: dict = {}
    next_say = time.monotonic() + SAY_EVERY_S
    while time.monotonic() < deadline:
        files = _written(folder, expected, sizes)
        if files is not None:
            return files
        if not quiet and time.monotonic() >= next_say:
            next_say += SAY_EVERY_S
            say(
                f"collect: server_trace: {what} ({len(sizes)} of {expected} trace files so far, "
                f"{deadline - time.monotonic():.0f} s left)"
            )
        time.sleep(POLL_S)
    return None


def _stop_profile(url: str) -> None:
    try:
        http("POST", url + "/stop_profile", timeout_s=10.0)
    except OSError:
        pass


def _take(folder: Path, taken: Path) -> tuple[dict, dict]:
    """The regular trace files of ``folder`` (the server writes there) moved into ``taken`` (a
    folder only this process writes), as arcname -> Path; and the meta of those left out: not
    regular (a symbolic link, a FIFO: never read through), or over the member cap."""
    regular, other = scan_folder(folder, (TRACE_GLOB,))
    taken.mkdir(mode=0o700)
    out, too_big = {}, []
    for name in regular:
        dest = taken / name
        if not take_regular(folder, name, dest, move=True):
            other.append(name)
        elif dest.stat().st_size > MAX_MEMBER_BYTES:
            too_big.append(name)
        else:
            out[ARCNAMES["server_trace"] + name] = dest
    meta: dict = {}
    if other:
        meta[LEFT_OUT_KEYS[NOT_REGULAR]] = [shown(n) for n in sorted(other, key=shown)]
    if too_big:
        meta["left_out_over_2_GiB"] = too_big
    return out, meta


def server_trace(ctx: Context, limit_s: float) -> Outcome:
    """Start the server's profiler for ``ctx.cycles`` forwards, wait (at most ``limit_s``) for one
    trace per rank, copy them under ``server/traces/``. With ``ctx.send_requests`` collect drives
    the traffic itself (small ``/generate`` requests); by default it sends none."""
    s = ctx.server
    t0 = time.monotonic()
    deadline = t0 + limit_s - min(STOP_WAIT_S, 0.15 * limit_s)  # the rest: the export after /stop_profile
    folder = ctx.workdir / "server-traces"
    folder.mkdir()
    acts, why_acts = activities(s)
    steps = profiler_steps(ctx.cycles)
    body = {
        "output_dir": str(folder),
        "num_steps": steps,
        "activities": acts,
        "profile_by_stage": False,
        "merge_profiles": False,
    }
    tp, pp = s.fact("tp_size"), s.fact("pp_size")
    expected = (tp if isinstance(tp, int) and tp > 0 else 1) * (pp if isinstance(pp, int) and pp > 0 else 1)
    meta = {
        "output_dir": str(folder),
        "num_steps": steps,
        "cycles_asked": ctx.cycles,
        "activities": acts,
        "activities_why": why_acts,
        "expected_files": expected,
        "traffic": "collect sent requests" if ctx.send_requests else "the server's own",
    }
    try:
        status, text = http("POST", s.url + "/start_profile", body, timeout_s=min(30.0, limit_s))
    except OSError as e:  # ReplyError: one line naming the URL and what came back
        return failed(str(e), **meta)
    if status != 200:
        return failed(
            f"POST {s.url}/start_profile: HTTP {status}: {shown_reply(text.decode(errors='replace'))}", **meta
        )
    sent: list = []
    sender = None
    if ctx.send_requests:
        sender = threading.Thread(target=_send_requests, args=(s.url, ctx.send_requests, deadline, sent), daemon=True)
        sender.start()
    try:
        files = _wait(folder, expected, deadline, ctx.quiet, f"waiting for {steps} scheduler steps")
    except BaseException:  # Ctrl-C: the server's profiler is not left running
        _stop_profile(s.url)
        raise
    complete = files is not None
    if not complete:  # free the server's profiler; its ranks export what they recorded
        _stop_profile(s.url)
        files = _wait(folder, expected, t0 + limit_s, ctx.quiet, "stopped early; waiting for the export")
    if sender is not None:
        sender.join(timeout=5.0)
        meta["requests_sent"] = [str(x) for x in sent]
    waited = time.monotonic() - t0
    taken, left = _take(folder, ctx.workdir / "server-traces-taken")
    meta.update(left)
    out = {}
    for arc, path in taken.items():
        why = unfit_name(arc)
        if why is None:
            out[arc] = path
        else:
            meta.setdefault(LEFT_OUT_KEYS[why], []).append(shown(path.name))
    meta.update(trace_files=len(out), complete=complete, waited_s=round(waited, 1))
    said = "; ".join(x for x in (left_out_text(meta), _too_big_text(meta)) if x)
    if not complete:
        return failed(
            f"no complete profile: fewer than {steps} scheduler steps ran in {waited:.0f} s (maybe none): "
            "send traffic to the server while collect runs, or lower --cycles (the server writes the "
            f"traces into {folder}: run collect on the server's machine)",
            out,
            **meta,
        )
    if not out:
        return failed(f"no usable trace file: {said or 'the server wrote none'}", **meta)
    if said and not ctx.quiet:
        say(f"collect: server_trace: {said}")
    return ok(out, **meta)


def _too_big_text(meta: dict) -> str | None:
    big = meta.get("left_out_over_2_GiB")
    return f"{len(big)} file(s) left out over {MAX_MEMBER_BYTES >> 30} GiB: {', '.join(big[:3])}" if big else None
