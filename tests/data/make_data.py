"""Write the small hand-made traces under tests/data/ (run: python tests/data/make_data.py).

Every trace is a tiny Kineto-style Chrome trace, written as gzip with mtime 0 so a rerun gives
the same bytes. Times are written as decimal text exactly as given here (µs with 3 decimals, as
Kineto prints them): a value such as "9500000000000.001" is not rounded through a Python float.
The expected numbers that the tests check are worked out by hand from the event lists below and
are written out next to each scenario, so a change here must be followed by the tests.
"""

from __future__ import annotations

import gzip
import json
from decimal import Decimal
from pathlib import Path

HERE = Path(__file__).resolve().parent

AR_NCCL = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
FILL = "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<c10::BFloat16>, std::array<char*, 1ul> >(int, at::native::FillFunctor<c10::BFloat16>, std::array<char*, 1ul>)"
GEMM = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas"
CUSTOM_AR = "void vllm::cross_device_reduce_1stage<__nv_bfloat16, 2>(vllm::RankData*, vllm::Signal*, vllm::Signal**, __nv_bfloat16*, int, int)"
RMSNORM = "void vllm::fused_add_rms_norm_kernel<c10::BFloat16, 8>(c10::BFloat16*, c10::BFloat16*, c10::BFloat16 const*, float, int, int)"
RCCL_GENERIC = "ncclDevKernel_Generic(ncclDevKernelArgsStorage<4096ul>)"


class Num:
    """A number written verbatim into the JSON text (a decimal string, or a big int)."""

    def __init__(self, text: str | int) -> None:
        self.text = str(text)


def _dump(doc: dict) -> bytes:
    marks: dict[str, str] = {}

    def default(o):
        if isinstance(o, Num):
            key = f"@@NUM{len(marks)}@@"
            marks[key] = o.text
            return key
        if isinstance(o, Decimal):
            return default(Num(str(o)))
        raise TypeError(type(o))

    text = json.dumps(doc, default=default, separators=(",", ":"))
    for key, value in marks.items():
        text = text.replace(f'"{key}"', value)
    json.loads(text)  # still valid JSON
    return text.encode()


def _write(rel: str, doc: dict) -> None:
    path = HERE / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, filename="") as f:
        f.write(_dump(doc))


def T(x: str) -> Num:
    return Num(x)


def kernel(name, ts, dur, corr, *, pid=0, stream=7, **extra):
    args = {"device": 0, "stream": stream, "correlation": corr, **extra}
    return {
        "ph": "X",
        "cat": "kernel",
        "name": name,
        "pid": pid,
        "tid": stream,
        "ts": T(ts),
        "dur": T(dur),
        "args": args,
    }


def runtime(name, ts, dur, corr, *, pid=100, tid=100, ext=None):
    args = {"cbid": 311, "correlation": corr}
    if ext is not None:
        args["External id"] = ext
    return {
        "ph": "X",
        "cat": "cuda_runtime",
        "name": name,
        "pid": pid,
        "tid": tid,
        "ts": T(ts),
        "dur": T(dur),
        "args": args,
    }


def host(cat, name, ts, dur, *, pid=100, tid=100, **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": T(ts), "dur": T(dur), "args": args}


# --------------------------------------------------------------------------------------------
# cuda_graph_replay: three cudaGraphLaunch calls; every kernel of a replay carries the launch's
# correlation and nothing else (no External id, no Collective name), as under CUDA-graph replay.
# Replay k (k = 0, 1, 2): host launch at L = 1000 + 100k (dur 10), GPU start G = L + 20:
#   FILL   [G, G+5)                      compute
#   AR     [G+5, G+5+d_k)                d = 12.5, 13.0, 14.25 (NCCL all-reduce, no args)
#   GEMM   [G+5+d_k+1, G+5+d_k+9)        compute (8 µs) after a 1 µs gap
# Per step: window 14+d, compute 13, all-reduce d, idle 1, exposed comm d, overlap 0 %.
# Whole rank: window 1020 -> 1220+14+14.25 = 1248.25, i.e. 228.25; all-reduce 39.75,
# compute 39, idle 228.25 - 39 - 39.75 = 149.5.
# --------------------------------------------------------------------------------------------
GRAPH_AR_DURS = ("12.5", "13.0", "14.25")


def cuda_graph_replay() -> dict:
    events = [{"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "GPU 0"}}]
    # a python_function event over the whole run: must be skipped, not mistaken for anything
    events.append(
        host("python_function", "sglang/srt/model_executor/cuda_graph_runner.py(700): replay", "990.0", "400.0")
    )
    for k, d in enumerate(GRAPH_AR_DURS):
        L = Decimal(1000 + 100 * k)
        G = L + 20
        d = Decimal(d)
        corr = 50 + k
        events.append(host("cpu_op", "aten::copy_", str(L - 5), "2.0", **{"External id": 900 + k}))
        events.append(runtime("cudaGraphLaunch", str(L), "10.0", corr, ext=990 + k))
        events.append(kernel(FILL, str(G), "5.0", corr))
        events.append(kernel(AR_NCCL, str(G + 5), str(d), corr))
        events.append(kernel(GEMM, str(G + 5 + d + 1), "8.0", corr))
    return {
        "schemaVersion": 1,
        "distributedInfo": {"backend": "nccl", "rank": 0, "world_size": 2},
        "baseTimeNanoseconds": 1767189312000000000,
        "traceEvents": events,
    }


# --------------------------------------------------------------------------------------------
# merged_sglang: SGLang profile_merger output; every event's pid is "[TP0r] <pid>".
# Both ranks: one step[DECODE bs=1] annotation per step, 3 custom all-reduces each launched by
# _C_custom_ar::all_reduce on a [1, 4096] bf16 tensor (8192 bytes), between RMSNorm kernels.
#   all-reduce durations  rank 0: 10, 4, 6     rank 1: 3, 9, 2
#   transfer (min)        3, 4, 2   -> 9 in all
#   wait                  rank 0: 7+0+4 = 11   rank 1: 0+5+0 = 5
#   shortest (straggler)  rank 1, rank 0, rank 1 -> straggler rank 1 (2 of 3)
# merged-distinct-ids: correlation / External ids differ between the ranks.
# merged-shared-ids: both ranks use the same correlation and External ids (two processes count
# from the same start), and rank 1's host clock runs 80 µs after rank 0's, so its step windows
# overlap rank 0's and its launch times (same correlation ids) fall outside rank 0's windows. Each rank must keep its own steps and its own launch times.
# --------------------------------------------------------------------------------------------
MERGED_AR = {0: ("10.0", "4.0", "6.0"), 1: ("3.0", "9.0", "2.0")}


def merged(shared_ids: bool) -> dict:
    events = []
    for rank in (0, 1):
        hpid = f"[TP{rank:02d}] {4000 + rank}"
        gpid = f"[TP{rank:02d}] {rank}"
        events.append({"ph": "M", "name": "process_name", "pid": gpid, "args": {"name": f"[TP{rank:02d}] GPU {rank}"}})
        shift = Decimal(80 * rank) if shared_ids else Decimal(0)
        base_id = 0 if shared_ids else 1000 * rank
        for s, d in enumerate(MERGED_AR[rank]):
            h0 = Decimal(100 + 200 * s) + shift  # step window [h0, h0 + 100) on the host
            g0 = Decimal(1000 + 200 * s)  # GPU start of this step's kernels
            d = Decimal(d)
            events.append(host("user_annotation", "step[DECODE bs=1]", str(h0), "100.0", pid=hpid, tid=hpid))
            c1, c2, c3 = base_id + 3 * s + 1, base_id + 3 * s + 2, base_id + 3 * s + 3
            e2 = base_id + 10 + s
            events.append(runtime("cudaLaunchKernel", str(h0 + 10), "3.0", c1, pid=hpid, tid=hpid))
            events.append(
                host(
                    "cpu_op",
                    "_C_custom_ar::all_reduce",
                    str(h0 + 20),
                    "8.0",
                    pid=hpid,
                    tid=hpid,
                    **{
                        "External id": e2,
                        "Input Dims": [[1, 4096], [1, 4096], [], []],
                        "Input type": ["c10::BFloat16", "c10::BFloat16", "", ""],
                    },
                )
            )
            events.append(runtime("cudaLaunchKernel", str(h0 + 22), "3.0", c2, pid=hpid, tid=hpid, ext=e2))
            events.append(runtime("cudaLaunchKernel", str(h0 + 40), "3.0", c3, pid=hpid, tid=hpid))
            events.append(kernel(RMSNORM, str(g0), "5.0", c1, pid=gpid))
            events.append(kernel(CUSTOM_AR, str(g0 + 5), str(d), c2, pid=gpid, **{"External id": e2}))
            events.append(kernel(RMSNORM, str(g0 + 5 + d), "5.0", c3, pid=gpid))
    return {
        "schemaVersion": 1,
        "distributedInfo": {"backend": "nccl", "rank": 0, "world_size": 2},
        "traceEvents": events,
    }


# --------------------------------------------------------------------------------------------
# bigint: integers wider than 64 bits in args (NCCL `Comms Id`), as in HTA PR #324.
# One NCCL all-reduce kernel [100, 130) (30 µs) and one GEMM [130, 150) (20 µs).
# --------------------------------------------------------------------------------------------
def bigint() -> dict:
    big = 2**80 + 12345
    events = [
        host(
            "cpu_op",
            "record_param_comms",
            "90.0",
            "5.0",
            **{
                "External id": 7,
                "Collective name": "allreduce",
                "In msg nelems": 1024,
                "dtype": "Float",
                "Comms Id": Num(big),
                "Rank": 0,
            },
        ),
        runtime("cudaLaunchKernel", "91.0", "2.0", 1, ext=7),
        kernel(
            "ncclKernel_AllReduce_RING_LL_Sum_float(ncclDevComm*, unsigned long, ncclWork*)",
            "100.0",
            "30.0",
            1,
            **{"External id": 7, "Comms Id": Num(big), "Seq": Num(-(2**70))},
        ),
        runtime("cudaLaunchKernel", "95.0", "2.0", 2),
        kernel(GEMM, "130.0", "20.0", 2),
    ]
    return {
        "schemaVersion": 1,
        "distributedInfo": {"backend": "nccl", "rank": 3, "world_size": 4},
        "traceEvents": events,
    }


# --------------------------------------------------------------------------------------------
# ns_timestamps: modern Kineto, `ts` relative to baseTimeNanoseconds, ns-fractional µs.
# T = 4909913692278.281 (the size of ts in the SGLang MI300X trace):
#   GEMM   [T,       T+1.001)    compute
#   FILL   [T+1.002, T+2.001)    compute, 1 ns after the GEMM
#   AR     [T+2.001, T+2.004)    all-reduce, 3 ns, touching the FILL
#   FILL   [T+2.004, T+2.005)    1 ns
# window 2.005, busy 2.004, idle 0.001, compute 1.001+0.999+0.001 = 2.001, all-reduce 0.003.
# The _uptime_102d file is the same at T = 9500000000000.281 (ts > 2**43 µs, a machine up
# more than 102 days: a float64 no longer holds such a ts to the ns).
# --------------------------------------------------------------------------------------------
def ns_timestamps(t0: str) -> dict:
    T0 = Decimal(t0)
    rows = [(GEMM, "0", "1.001"), (FILL, "1.002", "0.999"), (AR_NCCL, "2.001", "0.003"), (FILL, "2.004", "0.001")]
    events = []
    for i, (name, off, dur) in enumerate(rows):
        events.append(runtime("cudaLaunchKernel", str(T0 - 10 + i), "0.500", 10 + i))
        events.append(kernel(name, str(T0 + Decimal(off)), dur, 10 + i))
    return {
        "schemaVersion": 1,
        "baseTimeNanoseconds": 1775078550000000000,
        "distributedInfo": {"backend": "nccl", "rank": 0, "world_size": 1},
        "traceEvents": events,
    }


# --------------------------------------------------------------------------------------------
# rccl_generic: RCCL's ncclDevKernel_Generic, whose collective is known only from context.
#   k0 [100, 110)  args 'Collective name': 'allreduce' (Kineto copies c10d metadata)  -> allreduce
#   k1 [120, 125)  External id -> record_param_comms with 'Collective name': '_allgather_base' -> other_comm
#   k2 [130, 137)  External id -> cpu_op 'c10d::allreduce_' (no Collective name)        -> allreduce
#   k3 [140, 142)  no op, no args (as under graph replay)                              -> unknown_comm
#   GEMM [110, 140) compute, overlapping k1 and k2 fully.
# allreduce time 10 + 7 = 17, other comm 5, unknown comm 2, compute 30.
# --------------------------------------------------------------------------------------------
def rccl_generic() -> dict:
    events = [
        host(
            "cpu_op",
            "record_param_comms",
            "10.0",
            "5.0",
            **{"External id": 1, "Collective name": "allreduce", "In msg nelems": 4096, "dtype": "BFloat16"},
        ),
        runtime("hipLaunchKernel", "11.0", "1.0", 1, ext=1),
        kernel(
            RCCL_GENERIC,
            "100.0",
            "10.0",
            1,
            **{"External id": 1, "Collective name": "allreduce", "In msg nelems": 4096, "dtype": "BFloat16"},
        ),
        host(
            "cpu_op",
            "record_param_comms",
            "20.0",
            "5.0",
            **{"External id": 2, "Collective name": "_allgather_base", "In msg nelems": 512, "dtype": "Float"},
        ),
        runtime("hipLaunchKernel", "21.0", "1.0", 2, ext=2),
        kernel(RCCL_GENERIC, "120.0", "5.0", 2, **{"External id": 2}),
        host(
            "cpu_op",
            "c10d::allreduce_",
            "30.0",
            "5.0",
            **{"External id": 3, "Input Dims": [[256, 64]], "Input type": ["float"]},
        ),
        runtime("hipLaunchKernel", "31.0", "1.0", 3, ext=3),
        kernel(RCCL_GENERIC, "130.0", "7.0", 3, **{"External id": 3}),
        runtime("hipLaunchKernel", "41.0", "1.0", 4),
        kernel(RCCL_GENERIC, "140.0", "2.0", 4),
        runtime("hipLaunchKernel", "15.0", "1.0", 5),
        kernel(
            "Cijk_Alik_Bljk_BBS_BH_Bias_HA_S_SAV_UserArgs_MT128x256x32_MI16x16x1_SN_LDSB1_AFC1_AFEM1",
            "110.0",
            "30.0",
            5,
        ),
    ]
    return {
        "schemaVersion": 1,
        "distributedInfo": {"backend": "nccl", "rank": 0, "world_size": 8},
        "traceEvents": events,
    }


def main() -> None:
    _write("cuda_graph_replay/graph_replay-TP-0.trace.json.gz", cuda_graph_replay())
    _write("merged_sglang/merged-distinct-ids.trace.json.gz", merged(shared_ids=False))
    _write("merged_sglang/merged-shared-ids.trace.json.gz", merged(shared_ids=True))
    _write("bigint/comms_id_over_64_bits.trace.json.gz", bigint())
    _write("ns_timestamps/ns_fractions.trace.json.gz", ns_timestamps("4909913692278.281"))
    _write("ns_timestamps/ns_fractions_uptime_102d.trace.json.gz", ns_timestamps("9500000000000.281"))
    _write("rccl_generic/rccl_generic_eager.trace.json.gz", rccl_generic())


if __name__ == "__main__":
    main()
