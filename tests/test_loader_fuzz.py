"""Property tests: whatever the file holds, `load_trace` returns rank tables or raises UserError
(the one-line error of the command line), never any other exception. When it returns, the rest
of the pipeline (analysis + profile document) must not crash either."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from fastverify.errors import UserError
from fastverify.events import RankEvents
from fastverify.profile.build import build_profile
from fastverify.profile.record import decode_profile, encode_profile
from fastverify.trace.load import load_trace

SETTINGS = dict(
    deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


# --- JSON-ish values, biased towards what a trace holds --------------------------------------
scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=6)
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=5,
)

names = (
    st.sampled_from(
        [
            "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
            "ncclDevKernel_Generic(ncclDevKernelArgsStorage<4096ul>)",
            "void (anonymous namespace)::multimem_all_reduce_kernel<c10::BFloat16, 16>(c10::BFloat16*)",
            "void allreduce_kernel<float>(float*)",
            "my_allgather_thing",
            "gemm",
            "Memcpy DtoD (Device -> Device)",
            "ProfilerStep#3",
            "step[DECODE bs=1]",
            "execute_context_1",
            "cudaGraphLaunch",
            "hipGraphLaunch",
            "cudaLaunchKernel",
            "record_param_comms",
            "c10d::allreduce_",
            "symm_mem::multimem_all_reduce_",
            "process_name",
        ]
    )
    | values
)
cats = (
    st.sampled_from(
        [
            "kernel",
            "Kernel",
            "gpu_memcpy",
            "gpu_memset",
            "Memcpy",
            "cuda_runtime",
            "cuda_driver",
            "Runtime",
            "cpu_op",
            "user_annotation",
            "python_function",
            "gpu_user_annotation",
            "ac2g",
            "Trace",
        ]
    )
    | values
)
times = (
    st.integers(min_value=-5, max_value=2_000)
    | st.integers(min_value=-(2**64), max_value=2**64)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.floats(min_value=0, max_value=1e13)
    | values
)
small_ids = st.integers(min_value=0, max_value=4)
args = (
    st.fixed_dictionaries(
        {},
        optional={
            "correlation": small_ids | values,
            "External id": small_ids | values,
            "stream": small_ids | values,
            "Collective name": st.sampled_from(["allreduce", "_allgather_base", "send"]) | values,
            "In msg nelems": st.integers(min_value=-(2**70), max_value=2**70) | values,
            "dtype": st.sampled_from(["Float", "BFloat16", "c10::Half", "weird"]) | values,
            "Input Dims": st.lists(
                st.lists(st.integers(min_value=-(2**40), max_value=2**40) | values, max_size=3), max_size=2
            )
            | values,
            "Input type": st.lists(st.sampled_from(["float", "c10::BFloat16", ""]) | values, max_size=2) | values,
            "name": values,
        },
    )
    | values
)
events = st.fixed_dictionaries(
    {},
    optional={
        "ph": st.sampled_from(["X", "M", "i", "s", "f"]) | values,
        "cat": cats,
        "name": names,
        "ts": times,
        "dur": times,
        "pid": st.sampled_from(["[TP00] 1", "[TP01] 1", "[TP01-DP00] 7", 0, 1]) | values,
        "tid": small_ids | values,
        "args": args,
    },
)
good_times = st.integers(min_value=0, max_value=400) | st.decimals(min_value=0, max_value=400, places=3).map(float)


def _good(cats_):
    return st.fixed_dictionaries(
        {
            "ph": st.just("X"),
            "cat": st.sampled_from(cats_),
            "name": names,
            "ts": good_times,
            "dur": good_times,
            "pid": st.sampled_from([0, 0, "[TP00] 1", "[TP01] 1"]),
            "args": args,
        }
    )


good_gpu = _good(["kernel", "gpu_memcpy", "gpu_memset"])
good_host = _good(["cuda_runtime", "cpu_op", "user_annotation"])
# At least one well-formed GPU event, then a mix (most of a real trace is well formed), so that
# many documents get past the loader and through the analysis.
good_lists = st.tuples(good_gpu, st.lists(good_gpu | good_host | events, max_size=12)).map(lambda t: [t[0], *t[1]])
trace_docs = st.fixed_dictionaries(
    {
        "traceEvents": st.integers(min_value=0, max_value=9).flatmap(
            lambda i: good_lists if i < 7 else st.lists(events, max_size=10) if i < 9 else values
        )
    },
    optional={
        "distributedInfo": st.fixed_dictionaries(
            {},
            optional={
                "rank": st.integers(min_value=-3, max_value=2**70) | values,
                "world_size": values,
                "nccl_version": values,
            },
        )
        | values,
        "deviceProperties": st.lists(st.fixed_dictionaries({"name": values}), max_size=2) | values,
        "baseTimeNanoseconds": values,
    },
)
docs = st.integers(min_value=0, max_value=9).flatmap(lambda i: trace_docs if i < 9 else values)


def _check(folder: Path, data: bytes, suffix: str = ".json") -> list[RankEvents] | None:
    path = folder / f"trace{suffix}"
    path.write_bytes(data)
    try:
        ranks = load_trace(path)
    except UserError as e:
        assert str(e).strip() and "\n" not in str(e).strip()
        return None
    assert isinstance(ranks, list) and ranks
    for r in ranks:
        assert isinstance(r, RankEvents)
        assert len(r) > 0
        assert (r.dur_ns >= 0).all()
    return ranks


@settings(max_examples=150, **SETTINGS)
@given(
    st.one_of(
        st.binary(max_size=200),
        st.binary(max_size=200).map(lambda b: b"\x1f\x8b" + b),
        st.binary(max_size=200).map(lambda b: gzip.compress(b, mtime=0)),
        st.binary(max_size=200).map(lambda b: gzip.compress(b, mtime=0)[: max(2, len(b) // 2)]),
        st.text(max_size=100).map(str.encode),
    )
)
def test_arbitrary_bytes(fuzz_dir, data):
    _check(fuzz_dir, data, ".json.gz")


def _dump(doc) -> bytes:
    return json.dumps(doc).encode()


@settings(max_examples=200, **SETTINGS)
@given(docs, st.booleans())
def test_arbitrary_trace_documents(fuzz_dir, doc, gz):
    data = _dump(doc)
    ranks = _check(fuzz_dir, gzip.compress(data, mtime=0) if gz else data, ".json.gz" if gz else ".json")
    if ranks is None:
        return
    profile = build_profile(ranks, {"kind": "trace", "files": ["fuzz"]})
    decode_profile(encode_profile(profile))  # the one encoder, and the typed decoder tune uses


@settings(max_examples=80, **SETTINGS)
@given(docs, st.integers(min_value=0, max_value=10_000))
def test_truncated_documents(fuzz_dir, doc, cut):
    data = _dump(doc)
    _check(fuzz_dir, data[: cut % (len(data) + 1)])


def test_nan_and_infinity_tokens(fuzz_dir):
    """Python's json (the loader's fallback parser) accepts NaN/Infinity; such events are unusable
    but must not break the good ones."""
    text = (
        b'{"traceEvents": [{"ph": "X", "cat": "kernel", "name": "g", "ts": NaN, "dur": 1},'
        b'{"ph": "X", "cat": "kernel", "name": "g", "ts": 1, "dur": Infinity},'
        b'{"ph": "X", "cat": "kernel", "name": "g", "ts": -Infinity, "dur": 2},'
        b'{"ph": "X", "cat": "kernel", "name": "gemm", "ts": 10, "dur": 5}]}'
    )
    ranks = _check(fuzz_dir, text)
    assert ranks is not None and ranks[0].start_ns.tolist() == [10_000] and ranks[0].dur_ns.tolist() == [5_000]
