"""Plausibility bounds: values past these are broken or hand-edited input, never measurements.

Each bound is far above anything a real verify step, trace or sweep holds, so a real input never
meets it, and far below where arithmetic on it goes wrong (float overflow, 4.9e11 µs per step):

- ``MAX_MSG_BYTES`` = 1 TiB: one collective's payload lives in one GPU's memory, and the largest
  GPU today holds under 200 GB (B200: 180 GB HBM3e, NVIDIA B200 datasheet); a verify all-reduce is
  tokens × hidden × 2 B, ~14 KiB to ~1 MiB.
- ``MAX_EVENT_US`` = 1 hour: a profiler trace covers seconds, and a kernel or a step that runs for
  an hour is a hung or corrupt record (the trace loader already warns past 10 s).
- ``MAX_COUNT`` = 1e9: counts of events, calls per step or elements; a verify step has ~123
  all-reduces and a trace a few million events.
- ``MAX_BANDWIDTH_GBPS`` = 1e6 GB/s (1 PB/s): the fastest GPU link today moves 1.8 TB/s (NVLink 5,
  NVIDIA B200 datasheet) and NCCL's topology gives a GPU's path to itself ``LOC_BW`` = 5000 GB/s
  (``src/graph/topo.h``); a bandwidth 200x past that is a corrupt or hand-edited figure.
- ``MAX_CHANNELS`` = 64: NCCL's ``MAXCHANNELS`` (``src/include/device.h``; 32 before NCCL 2.25): no
  communicator, graph or collective has more channels, and fastverify's cost model takes 1..64.

Bounds of the verify step's shape, shared by every flag and record that carries one (``profile``,
``topo``, ``tune``, the deployment record, ``run_live``):

- ``MAX_BATCH`` = 4096 requests, ``MAX_DRAFT_TOKENS`` = 64 draft tokens per request: a verify step
  never has more;
- ``MAX_VERIFY_TOKENS`` = ``MAX_BATCH`` × ``MAX_DRAFT_TOKENS`` = 262144 rows the target verifies in
  one step (batch × draft tokens per request);
- ``MAX_HIDDEN`` = 65536: the widest released models have hidden 16384, and 4096 × 64 × 65536 keeps
  a workspace's element count at 2^34, inside SGLang's int and the env file's 18-digit rule;
- ``MAX_TIMEOUT_S`` = one day: beyond it ``timedelta(seconds=...)`` in torch's TCPStore overflows
  or waits for ever.
- ``MAX_ITERS`` = 100000 timed and ``MAX_WARMUP`` = 10000 untimed forwards of a live run
  (``profile --iters`` / ``--warmup``): the profile gives medians and percentiles of the timed
  forwards, and at n = 10^5 the median's 95 % interval spans 1.96 x sqrt(n) / 2 = 310 ranks, 0.3 %
  of the sample (the binomial order-statistic interval), so more forwards only cost time: 10^5
  take 100 s at 1 ms a forward on a GPU and 26 min at the 15.6 ms of the tiny model on CPU
  (``fastverify.live.preflight``), and 10^9 would take 12 days at 1 ms, past ``MAX_TIMEOUT_S``.
  Warm-up forwards only let the allocator, caches and CUDA graphs settle, which takes a few;
  a tenth of ``MAX_ITERS`` leaves room for any of that.

Bounds of a box and of the facts a server or a hand-written description states about it
(``collect --server``, ``--describe-box``):

- ``MAX_WORLD_SIZE`` = 640 ranks (a server's ``tp_size`` or ``pp_size``) or GPUs in one box: NCCL's
  topology holds at most ``NCCL_TOPO_MAX_NODES`` = 640 nodes of a kind, "up to 576 GPUs (e.g.
  NVLD144) with headroom" (``src/include/graph.h``, NCCL 2.30; earlier releases 256, then 576);
  fastverify's own ``--tp`` stops at 64.
- ``MAX_GPU_MEMORY_BYTES`` = 1 TiB, as ``MAX_MSG_BYTES``: the largest GPU today holds under 200 GB.
- ``MAX_NAME_CHARS`` = 256 characters of a GPU name, UUID, bus id, driver or version text: NVML's
  buffers for them hold 96 bytes at most (``NVML_DEVICE_NAME_V2_BUFFER_SIZE``,
  ``NVML_DEVICE_UUID_V2_BUFFER_SIZE``; ``nvml.h``).

Floors:

- ``MIN_TIME_US`` = 1 µs: the least time a measurement of work can take (a verify step, an
  all-reduce, a draft cycle, a sweep median); used wherever a time is a divisor. One kernel launch
  alone costs microseconds and CUDA events time at "a resolution of around 0.5 microseconds"
  (``cudaEventElapsedTime``, CUDA Runtime API), so a smaller time is a typo or a hand-made record
  (dividing by 1e-300 ms gives tok/s with 300 digits); it keeps every ratio of two plausible times
  under ``MAX_EVENT_US / MIN_TIME_US``.
- ``MIN_P2P_SIDE_S`` = 30 s: the least a P2P check side process is given to import torch, create
  its CUDA context and test its pair. ``import torch`` took 1.8-2.4 s warm on a 2-core test box
  (torch 2.14.1, measured for this bound) and 11-22 s cold in a container (a report on the
  openvinotoolkit/stable-diffusion-webui tracker, "Slow Torch import": "import torch: done in
  10.942s", "import torch: 22.0s"); less turns a slow start into a timeout of a healthy pair.
- ``MIN_TOK_S`` = 1/3600 tokens per second (one token per hour): a stream emits at least one token
  per verify step, and a step is at most ``MAX_EVENT_US`` (one hour), so a slower stream is a hung
  or hand-edited record, no measurement (1e-300 tok/s printed as 0.0 and a -100 % change).
"""

from __future__ import annotations

import json
import math

MAX_MSG_BYTES = 1 << 40
MAX_EVENT_US = 3600.0 * 1e6
MAX_EVENT_NS = 3600 * 10**9
MAX_COUNT = 10**9
MAX_BANDWIDTH_GBPS = 1e6
MAX_CHANNELS = 64
MAX_BATCH = 4096
MAX_DRAFT_TOKENS = 64
MAX_VERIFY_TOKENS = MAX_BATCH * MAX_DRAFT_TOKENS
MAX_HIDDEN = 65536
MAX_TIMEOUT_S = 86400.0
MAX_ITERS = 100_000
MAX_WARMUP = 10_000
MIN_P2P_SIDE_S = 30.0
MAX_WORLD_SIZE = 640
MAX_GPU_MEMORY_BYTES = 1 << 40
MAX_NAME_CHARS = 256
MIN_TIME_US = 1.0


def implausible_time_us(value) -> str | None:
    """Why ``value`` (µs) cannot be a measured time, or None when it can: a finite number in
    ``[0, MAX_EVENT_US]`` (bools are not numbers)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"{value!r} is not a number"
    if not math.isfinite(value) or value < 0 or value > MAX_EVENT_US:
        return f"{value!r} µs is outside [0, 1 hour = {MAX_EVENT_US:.0f} µs]"
    return None


def implausible_work_us(value) -> str | None:
    """Why ``value`` (µs) cannot be the time some work took, or None when it can: as
    :func:`implausible_time_us`, and at least :data:`MIN_TIME_US` (no zero, no 1e-300)."""
    why = implausible_time_us(value)
    if why is None and value < MIN_TIME_US:
        return f"{value!r} µs is below {MIN_TIME_US:g} µs, less than any measured work takes"
    return why


def implausible_count(value, *, upper: int = MAX_COUNT, what: str = "count", lower: int = 0) -> str | None:
    """Why ``value`` cannot be a ``what`` (an int in ``[lower, upper]``), or None when it can."""
    if isinstance(value, bool) or not isinstance(value, int):
        return f"{value!r} is not an integer {what}"
    if not lower <= value <= upper:
        return f"{value!r} is outside [{lower}, {upper:g}]"
    return None


def implausible_name(value, *, what: str = "name") -> str | None:
    """Why ``value`` cannot be a GPU name, UUID, bus id or version text (a str of at most
    :data:`MAX_NAME_CHARS` characters), or None when it can."""
    if not isinstance(value, str):
        return f"{type(value).__name__} is not a {what} (a string)"
    if len(value) > MAX_NAME_CHARS:
        return f"a {what} of {len(value):,} characters is over {MAX_NAME_CHARS}"
    return None


class _DuplicateKey(Exception):
    pass


def _pairs(pairs: list) -> dict:
    seen = set()
    for key, _ in pairs:
        if key in seen:
            raise _DuplicateKey(key)
        seen.add(key)
    return dict(pairs)


def duplicate_json_key(data: bytes | str) -> str | None:
    """The first key given twice in one JSON object of ``data`` (JSON parsers keep the last value
    silently), or None when there is none or ``data`` is not JSON (the caller's parser says that).
    Parse ``data`` with a depth-bounded parser first: this one uses the standard library."""
    try:
        json.loads(data, object_pairs_hook=_pairs)
    except _DuplicateKey as e:
        return str(e.args[0])
    except (ValueError, TypeError, RecursionError):
        return None
    return None


def implausible_bandwidth(value) -> str | None:
    """Why ``value`` (GB/s) cannot be a bandwidth, or None when it can: a finite number in
    ``[0, MAX_BANDWIDTH_GBPS]`` (bools are not numbers)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"{value!r} is not a number"
    if not math.isfinite(value) or value < 0 or value > MAX_BANDWIDTH_GBPS:
        return f"{value!r} GB/s is outside [0, {MAX_BANDWIDTH_GBPS:g} GB/s]"
    return None


MIN_TOK_S = 1e6 / MAX_EVENT_US
"""Least tokens per second one stream or a whole server can be credited with: one token per hour
(see the module docstring)."""
