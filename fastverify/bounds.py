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

A floor, not a ceiling:

- ``MIN_P2P_SIDE_S`` = 30 s: the least a P2P check side process is given to import torch, create
  its CUDA context and test its pair. ``import torch`` took 1.8-2.4 s warm on a 2-core test box
  (torch 2.14.1, measured for this bound) and 11-22 s cold in a container (a report on the
  openvinotoolkit/stable-diffusion-webui tracker, "Slow Torch import": "import torch: done in
  10.942s", "import torch: 22.0s"); less turns a slow start into a timeout of a healthy pair.
"""

from __future__ import annotations

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
MIN_P2P_SIDE_S = 30.0


def implausible_time_us(value) -> str | None:
    """Why ``value`` (µs) cannot be a measured time, or None when it can: a finite number in
    ``[0, MAX_EVENT_US]`` (bools are not numbers)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"{value!r} is not a number"
    if not math.isfinite(value) or value < 0 or value > MAX_EVENT_US:
        return f"{value!r} µs is outside [0, 1 hour = {MAX_EVENT_US:.0f} µs]"
    return None


def implausible_count(value, *, upper: int = MAX_COUNT, what: str = "count") -> str | None:
    """Why ``value`` cannot be a ``what`` (an int in ``[0, upper]``), or None when it can."""
    if isinstance(value, bool) or not isinstance(value, int):
        return f"{value!r} is not an integer {what}"
    if not 0 <= value <= upper:
        return f"{value!r} is outside [0, {upper:g}]"
    return None


def implausible_bandwidth(value) -> str | None:
    """Why ``value`` (GB/s) cannot be a bandwidth, or None when it can: a finite number in
    ``[0, MAX_BANDWIDTH_GBPS]`` (bools are not numbers)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"{value!r} is not a number"
    if not math.isfinite(value) or value < 0 or value > MAX_BANDWIDTH_GBPS:
        return f"{value!r} GB/s is outside [0, {MAX_BANDWIDTH_GBPS:g} GB/s]"
    return None
