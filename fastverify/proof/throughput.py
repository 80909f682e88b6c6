"""The throughput phase: SGLang's own benchmark client against the server's URL, one run per
concurrency, with fixed lengths and a fixed seed, read back into a :class:`ThroughputRun`.

The client is ``python -m sglang.benchmark.serving`` (SGLang 0.5.23 ``benchmark/serving.py``; the
old name ``sglang.bench_serving`` re-exports it) with ``--dataset-name random-ids`` (token ids drawn
with ``--seed``; no dataset download), ``--random-range-ratio 1`` (every request exactly
``--random-input-len`` / ``--random-output-len`` tokens), ``--max-concurrency C`` and
``--output-details``, which adds per request ``output_lens``, ``ttfts`` (s) and ``itls`` (s, one
per streamed chunk after the first) to its JSONL line; its ``output_throughput`` is output tokens
per second over the run, ``accept_length`` the server's ``avg_spec_accept_length``.

Per request, fastverify's tok/s per stream is the output tokens after the first over the decode
time, ``(output_len - 1) / sum(itls)``: the speed one user of a stream sees, the team's metric.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import msgspec

from fastverify.errors import UserError

CLIENT = "sglang.benchmark.serving"
SEED = 1
DEFAULT_INPUT_LEN = 128
DEFAULT_OUTPUT_LEN = 256
MAX_CONCURRENCY = 4096


class ThroughputRun(msgspec.Struct, frozen=True):
    """One benchmark run at ``concurrency`` parallel streams: ``requests`` sent, ``completed``,
    each of ``input_len`` / ``output_len`` tokens (``seed``); ``duration_s`` (s), ``output_tok_s``
    (aggregate output tokens per second), ``per_stream_tok_s`` (one per completed request with a
    decode time, :func:`per_stream`), ``ttft_ms`` per request, the server's ``accept_length``
    (None without speculative decoding), ``errors`` (requests that failed), and the ``client``."""

    concurrency: int
    requests: int
    completed: int
    input_len: int
    output_len: int
    seed: int
    duration_s: float
    output_tok_s: float
    per_stream_tok_s: list[float]
    ttft_ms: list[float]
    accept_length: float | None
    errors: int
    client: str = CLIENT


def parse_concurrency(text: str) -> list[int]:
    """``"1,4,16"`` → ``[1, 4, 16]`` (each 1..:data:`MAX_CONCURRENCY`, no repeats).

    Raises
    ------
    UserError
        A value that is not a positive int, or repeated.
    """
    out: list[int] = []
    for part in text.split(","):
        try:
            c = int(part.strip())
        except ValueError:
            raise UserError(f"--concurrency {text!r}: {part.strip()!r} is not an integer (e.g. 1,4,16)") from None
        if not 1 <= c <= MAX_CONCURRENCY:
            raise UserError(f"--concurrency {text!r}: {c} is outside 1..{MAX_CONCURRENCY}")
        if c in out:
            raise UserError(f"--concurrency {text!r}: {c} given twice")
        out.append(c)
    return out


def client_command(
    url: str,
    concurrency: int,
    requests: int,
    input_len: int,
    output_len: int,
    out: Path,
    tokenizer: str | None,
    python: str | None = None,
) -> list[str]:
    """The benchmark client's command line for one run."""
    cmd = [
        python or sys.executable,
        "-m",
        CLIENT,
        "--backend",
        "sglang",
        "--base-url",
        url,
        "--dataset-name",
        "random-ids",
        "--random-input-len",
        str(input_len),
        "--random-output-len",
        str(output_len),
        "--random-range-ratio",
        "1",
        "--num-prompts",
        str(requests),
        "--max-concurrency",
        str(concurrency),
        "--seed",
        str(SEED),
        "--output-file",
        str(out),
        "--output-details",
        "--disable-tqdm",
    ]
    if tokenizer:
        cmd += ["--tokenizer", tokenizer]
    return cmd


def per_stream(output_lens: list, itls: list) -> list[float]:
    """tok/s of each request that decoded: ``(output_len - 1) / sum(itls)``; a request of one token
    or no decode time has none."""
    out = []
    for n, gaps in zip(output_lens, itls):
        if not isinstance(n, int) or not isinstance(gaps, list):
            continue
        t = sum(g for g in gaps if isinstance(g, (int, float)))
        if n > 1 and t > 0:
            out.append((n - 1) / t)
    return out


def read_result(path: Path, concurrency: int, requests: int, input_len: int, output_len: int) -> ThroughputRun:
    """The :class:`ThroughputRun` of the client's JSONL line (its last one).

    Raises
    ------
    OSError
        No result line, or not the client's fields.
    """
    lines = [ln for ln in path.read_bytes().splitlines() if ln.strip()] if path.exists() else []
    if not lines:
        raise OSError(f"{path}: the benchmark client wrote no result")
    try:
        d = json.loads(lines[-1])  # the stdlib reader: the client writes "request_rate": Infinity
        errors = [e for e in d.get("errors") or [] if e]
        return ThroughputRun(
            concurrency=concurrency,
            requests=requests,
            completed=int(d["completed"]),
            input_len=input_len,
            output_len=output_len,
            seed=SEED,
            duration_s=float(d["duration"]),
            output_tok_s=float(d["output_throughput"]),
            per_stream_tok_s=[round(x, 4) for x in per_stream(d.get("output_lens") or [], d.get("itls") or [])],
            ttft_ms=[round(float(t) * 1000, 3) for t in d.get("ttfts") or [] if isinstance(t, (int, float)) and t > 0],
            accept_length=float(d["accept_length"]) if isinstance(d.get("accept_length"), (int, float)) else None,
            errors=len(errors),
        )
    except (ValueError, KeyError, TypeError) as err:
        raise OSError(f"{path}: not the benchmark client's result ({type(err).__name__}: {err})") from None


def run_client(
    url: str,
    concurrency: int,
    requests: int,
    input_len: int,
    output_len: int,
    out: Path,
    tokenizer: str | None,
    timeout_s: float,
) -> ThroughputRun:
    """Run the client once (its output to ``out``, its log to ``out`` with ``.log``) and read it.

    Raises
    ------
    OSError
        The client is not importable, failed, ran past ``timeout_s`` (killed), or wrote no result;
        the last line of its log said.
    """
    log = out.with_suffix(".log")
    cmd = client_command(url, concurrency, requests, input_len, output_len, out, tokenizer)
    with open(log, "wb") as f:
        try:
            cp = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise OSError(f"the benchmark client ran past {timeout_s:g} s (killed); its log: {log}") from None
    if cp.returncode != 0:
        last = (log.read_text(errors="replace").strip().splitlines() or ["no output"])[-1][:300]
        raise OSError(f"the benchmark client ({CLIENT}) exited {cp.returncode}: {last} (log: {log})")
    return read_result(out, concurrency, requests, input_len, output_len)
