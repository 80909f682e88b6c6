"""The columnar trace reader and the batched statistics give exactly what the per-event code gave.

``ns_column`` is checked value for value against ``ns_from_text`` (the exact text rule) on
generated µs texts, across the float64 fast path's bound (2**41 µs), integers of epoch size and
texts the fast path must refuse. ``grouped_percentiles`` and ``median`` are checked bit for bit
against ``np.percentile`` / ``np.median`` on generated groups.
"""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from fastverify.analyze import grouped_percentiles, median
from fastverify.trace.columns import NS_EXACT_FLOAT_US, ns_column
from fastverify.trace.decode import ns_from_text

# µs texts as Kineto writes them: an integer part and 0-3 decimals
_int_part = st.one_of(st.integers(0, 10**6), st.integers(0, NS_EXACT_FLOAT_US + 10**9), st.integers(0, 2**52))
_decimals = st.one_of(
    st.just(""),
    st.integers(0, 9).map(lambda d: f".{d}"),
    st.integers(0, 99).map(lambda d: f".{d:02d}"),
    st.integers(0, 999).map(lambda d: f".{d:03d}"),
)


def _texts(draw_ints, draw_dec):
    return [f"{i}{d}".encode() for i, d in zip(draw_ints, draw_dec)]


def _raws(texts: list[bytes]) -> list:
    return [msgspec.Raw(t) for t in texts]


def _expected(texts: list[bytes]) -> tuple[list[int], list[bool]]:
    got = [ns_from_text(t) for t in texts]
    return [g or 0 for g in got], [g is not None for g in got]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(_int_part, _decimals), min_size=1, max_size=40))
def test_ns_column_matches_the_text_rule(pairs):
    texts = [f"{i}{d}".encode() for i, d in pairs]
    ns, ok = ns_column(_raws(texts))
    want_ns, want_ok = _expected(texts)
    assert ok.tolist() == want_ok
    assert ns.tolist() == want_ns


@pytest.mark.parametrize(
    "texts",
    [
        [b"1.5", b"null"],  # a missing value: text path, None there
        [b"2.0001", b"3"],  # four decimals: half-even on the exact decimal
        [b"1e3", b"7.25"],  # exponent
        [b'"12"', b"4"],  # a string
        [b"-0.5", b"0.5"],  # negatives
        [b"1665000000000000", b"1665000000000001"],  # old Kineto epoch µs (integers past 2**41)
        [b"4398046511104.123", b"1.0"],  # a float past 2**41 µs: text path
        [b"9223372036854775807"],  # past 2**62 ns
    ],
)
def test_ns_column_edge_texts(texts):
    ns, ok = ns_column(_raws(texts))
    want_ns, want_ok = _expected(texts)
    assert ok.tolist() == want_ok and ns.tolist() == want_ns


def test_ns_column_float_path_really_is_exact_at_its_bound():
    # just below 2**41 µs with every 3-decimal ending: 0.5 ns of slack is what the proof allows
    base = NS_EXACT_FLOAT_US - 1
    texts = [f"{base}.{d:03d}".encode() for d in range(1000)]
    ns, ok = ns_column(_raws(texts))
    assert ok.all() and ns.tolist() == [base * 1000 + d for d in range(1000)]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 5), st.integers(0, 10**9)), min_size=1, max_size=60),
    st.sampled_from([(50,), (90,), (50, 90), (0, 100, 33.3)]),
)
def test_grouped_percentiles_equal_numpy_bit_for_bit(rows, qs):
    groups = np.array([g for g, _ in rows], dtype=np.int64)
    values = np.array([v for _, v in rows], dtype=np.int64)
    got = grouped_percentiles(values, groups, qs)
    for j, g in enumerate(np.unique(groups)):
        for k, q in enumerate(qs):
            want = np.percentile(values[groups == g], q)
            assert got[k, j] == want, (g, q, got[k, j], want)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(-1e9, 1e9, allow_nan=False), min_size=1, max_size=30))
def test_median_equals_numpy(xs):
    assert median(xs) == float(np.median(xs))
