"""``NCCL_BUFFSIZE``, ``NCCL_LL_BUFFSIZE``, ``NCCL_LL128_BUFFSIZE``: per-peer FIFO sizes in bytes.

A buffer too small for its protocol's chunk (``NCCL_BUFFSIZE`` < 4096, ``NCCL_LL_BUFFSIZE`` < 256,
``NCCL_LL128_BUFFSIZE`` < 16384 since NCCL 2.22) is an error: NCCL takes it unchecked and
divides by a 0-byte chunk (:func:`buffsize_minimum`; the comment above ``_BUFF_CHUNK`` says how).
"""

from __future__ import annotations

from collections.abc import Callable

from fastverify.nccl.findings import V, Ctx, Setting, Severity, Verdict, merge
from fastverify.nccl.intparse import INT32_MAX, param_int
from fastverify.nccl.version import NcclVersion

# The smallest buffer each protocol can run a collective with. NCCL takes the value unchecked
# (src/init.cc computeBuffSizes: anything but -2 is the size). calcCollChunking (src/enqueue.cc)
# makes a chunk of one step, buffSize / NCCL_STEPS (8), for every protocol but Ring/Simple (whose
# chunk is 4 steps): LL halves it (a 16-B line carries 8 B), LL128 keeps 15 of 16 words of each
# 128-B line; since 2.22 the chunk is then rounded down to the protocol's grain
# (ncclProtoGrainSize, src/include/device.h: LL 16 B, LL128 32 x 8 / 16 x 15 x 8 = 1920 B, Simple
# 512 B) and divided into the bytes (DIVUP(nBytes, nChannels x nchunksPerLoop x chunkSize)). A
# buffer that leaves a chunk of 0 B is an integer division by zero on the host: the process dies
# with SIGFPE at the first collective that picks the protocol (Tree/Simple for NCCL_BUFFSIZE).
_NCCL_STEPS = 8  # src/include/device.h
GRAIN_2_22 = V(2, 22)  # chunk rounded down to ncclProtoGrainSize (v2.22.3-1 src/enqueue.cc; not in v2.21.5-1)
# setting -> (protocol, grain B, what a chunk is, chunk bytes of a buffer of n bytes)
_BUFF_CHUNK: dict[str, tuple[str, int, str, Callable[[int], int]]] = {
    "NCCL_BUFFSIZE": ("one-step Simple (Tree/Simple, a Ring broadcast)", 512,
                      "a one-step Simple chunk is BUFFSIZE/8", lambda n: n // _NCCL_STEPS),
    "NCCL_LL_BUFFSIZE": ("LL", 16, "an LL chunk is half a step (8 data bytes per 16-B line), LL_BUFFSIZE/8/2",
                         lambda n: n // _NCCL_STEPS // 2),
    "NCCL_LL128_BUFFSIZE": ("LL128", 1920, "an LL128 chunk is 15/16 of a step (15 data words per 128-B line), "
                            "LL128_BUFFSIZE/8/16*15", lambda n: n // _NCCL_STEPS // 16 * 15),
}


def buffsize_minimum(name: str, version: NcclVersion | None = None) -> int:
    """The smallest ``name`` (``NCCL_BUFFSIZE``, ``NCCL_LL_BUFFSIZE``, ``NCCL_LL128_BUFFSIZE``) whose
    chunk is not 0 B for NCCL ``version`` (``None``: the newest): 4096 / 256 / 16384 bytes since 2.22
    (the chunk must hold one grain), 8 / 16 / 128 bytes before."""
    _, grain, _, chunk = _BUFF_CHUNK[name]
    least = grain if version is None or version >= GRAIN_2_22 else 1
    n = 1
    while chunk(n) < least:
        n *= 2
    while n > 1 and chunk(n - 1) >= least:  # the smallest, not only the smallest power of 2
        n -= 1
    return n


def _buffsize_floor(n: int, ctx: Ctx, s: Setting) -> Verdict | None:
    """An error when ``n`` bytes leave the protocol a chunk of 0 B (see the comment above)."""
    proto, grain, how, chunk = _BUFF_CHUNK[s.name]
    new = ctx.at_least(GRAIN_2_22)
    least = buffsize_minimum(s.name, ctx.version if new else V(2, 21))
    if n >= least:
        if not new and n < buffsize_minimum(s.name):
            return Verdict(Severity.WARNING, f"{n} bytes: {how} = {chunk(n)} B, under the {grain}-B grain that NCCL >= "
                           f"2.22 rounds it down to (0 B: a division by zero there); older releases run it untested",
                           f"use at least {buffsize_minimum(s.name)} bytes; NCCL's default is {s.default}")
        return None
    rounded = f", below the {grain}-B grain NCCL rounds it down to, so 0 B" if new and chunk(n) else ""
    size = "1 byte" if n == 1 else f"{n} bytes"
    return Verdict(Severity.ERROR, f"{size}: {how} = {chunk(n)} B{rounded}; NCCL takes the value unchecked "
                   f"(src/init.cc computeBuffSizes) and divides by that chunk (src/enqueue.cc calcCollChunking): "
                   f"the first {proto} collective kills the process (SIGFPE)" + ctx.assumed("NCCL >= 2.22"),
                   f"use at least {least} bytes, a power of 2; NCCL's default is {s.default}")


def check_buffsize(value: str, ctx: Ctx, s: Setting) -> Verdict:
    """A buffer size: positive, fits an int, leaves every chunk > 0 B, a power of 2."""
    n, note = param_int(value, s.default)  # src/init.cc computeBuffSizes: used as is unless -2
    if n is None:
        return note  # type: ignore[return-value]
    if n == -2:
        return merge(note, Verdict(Severity.OK, "-2 is NCCL's 'unset' marker: the default applies"))
    if n <= 0:
        return merge(note, Verdict(Severity.ERROR, f"{n} bytes: NCCL uses it as the buffer size unchecked",
                                   f"use a positive power of 2 (default {s.default})"))
    if n > INT32_MAX:
        return merge(note, Verdict(Severity.ERROR, f"{n} does not fit NCCL's int buffer size", "use at most 1 GiB"))
    floor = _buffsize_floor(n, ctx, s)
    if floor is not None and floor.severity is Severity.ERROR:
        return merge(note, floor)
    if floor is not None:
        note = merge(note, floor)
    if n & (n - 1) and s.name == "NCCL_BUFFSIZE":  # the LL/LL128 defaults are not powers of 2 themselves
        return merge(note, Verdict(Severity.WARNING, f"{n} bytes is not a power of 2 (NCCL docs recommend one)",
                                   "use a power of 2"))
    return merge(note, Verdict(Severity.OK, f"{n} bytes"))
