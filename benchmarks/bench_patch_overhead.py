"""What the patch costs a serving server: the real SGLang 0.5.23 CPU server (TP 2 over gloo, NGRAM, the
tiny peaked Llama of the tests) under the same ``launch --load`` run twice per round, once with no
patch in the workers and once with the patch in counting-only mode (``--backend auto`` with no
deployment record: every all-reduce counted and every verify step timed, no all-reduce replaced).

Prints, per round and over all rounds, tok/s per stream of each (mean of the requests, the 95 %
bootstrap interval of ``fastverify compare``), their ratio, and the patch's host microseconds per
all-reduce call, derived from the two measured runs: (1 / tok/s with the patch - 1 / tok/s without)
per output token, over the all-reduce calls per output token (the counting run's verify records:
calls per verify step, over the server's accept length). Every figure is CPU wall clock.

Run it with the SGLang venv's Python (``.ci/sglang-venv.sh`` prints it)::

    $(.ci/sglang-venv.sh | tail -n 1) benchmarks/bench_patch_overhead.py --rounds 2 --requests 8
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fastverify.patch.handoff import ENV_FLAG  # noqa: E402
from fastverify.patch.launch import plan_launch  # noqa: E402
from fastverify.proof.compare import bootstrap_interval  # noqa: E402
from fastverify.proof.run import LoadOptions, supervise  # noqa: E402
from tests.sglang_server.harness import SERVER_FLAGS, free_port, server_env  # noqa: E402
from tests.sglang_server.tiny_model import PEAKED_LM_HEAD_SCALE, build  # noqa: E402


def _one(work: Path, model: Path, patched: bool, opts: LoadOptions) -> dict:
    """One load run; its load.json and the all-reduce calls per verify step of its records."""
    prof = work / "run"
    cmd = [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(model),
        "--tp-size",
        "2",
        "--host",
        "127.0.0.1",
        "--port",
        str(free_port()),
        *SERVER_FLAGS,
        "--dtype",
        "float32",
    ]
    env = server_env(work)
    plan = plan_launch(None, "auto" if patched else "off", str(prof), cmd, environ=env)
    if not patched:  # the same command and folder; the workers never load the patch
        plan = dataclasses.replace(plan, env={k: v for k, v in plan.env.items() if k != ENV_FLAG}, patch=False)
    rc = supervise(plan, opts, env)
    if rc != 0:
        raise SystemExit(f"the {'patched' if patched else 'unpatched'} run failed (exit {rc}); see {work}")
    doc = json.loads((prof / "load.json").read_text())
    calls = []
    for f in prof.glob("verify-rank0.jsonl"):
        for line in f.read_text().splitlines():
            paths = json.loads(line).get("allreduce_paths") or {}
            calls.append(sum(paths.get("verify", {}).values()))
    doc["calls_per_step"] = float(np.median(calls)) if calls else None
    return doc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=1, help="pairs of runs, the order swapped every other round")
    ap.add_argument("--requests", type=int, default=8, help="benchmark-client requests per run (concurrency 1)")
    ap.add_argument("--output-len", type=int, default=64, help="output tokens per request")
    args = ap.parse_args()
    if "sglang" not in sys.modules and os.system(f"{sys.executable} -c 'import sglang' 2>/dev/null") != 0:
        raise SystemExit("run this with the SGLang venv's Python: $(.ci/sglang-venv.sh | tail -n 1)")
    root = Path(tempfile.mkdtemp(prefix="fv-overhead-"))
    model = build(root / "model", PEAKED_LM_HEAD_SCALE)
    opts = LoadOptions(
        load=True,
        max_new_tokens=8,
        requests=args.requests,
        input_len=16,
        output_len=args.output_len,
        ready_timeout_s=600.0,
        force=True,
    )
    rng = np.random.default_rng(0)
    per = {True: [], False: []}
    for r in range(args.rounds):
        for patched in (False, True) if r % 2 == 0 else (True, False):
            doc = _one(root / f"r{r}-{'patched' if patched else 'plain'}", model, patched, opts)
            per[patched].append(doc)
    plain = [x for d in per[False] for x in d["throughput"][0]["per_stream_tok_s"]]
    patched = [x for d in per[True] for x in d["throughput"][0]["per_stream_tok_s"]]
    ip, iq = bootstrap_interval(plain, rng), bootstrap_interval(patched, rng)
    accept = np.mean([d["throughput"][0]["accept_length"] or 1.0 for d in per[True]])
    calls = np.mean([d["calls_per_step"] for d in per[True] if d["calls_per_step"]])
    per_call_us = (1 / iq.mean - 1 / ip.mean) * 1e6 / (calls / accept)
    print("CPU server (TP 2 over gloo, NGRAM), CPU wall clock, measured side by side in one run")
    print(f"tok/s per stream, no patch:            {ip.mean:.2f} [{ip.lo:.2f}, {ip.hi:.2f}] over {ip.n} requests")
    print(f"tok/s per stream, patch counting only: {iq.mean:.2f} [{iq.lo:.2f}, {iq.hi:.2f}] over {iq.n} requests")
    print(f"ratio patched / plain: {iq.mean / ip.mean:.3f}")
    print(
        f"patch host time per all-reduce call (derived): {per_call_us:+.1f} us "
        f"({calls:.0f} calls per verify step, accept length {accept:.2f})"
    )
    if iq.lo <= ip.hi and ip.lo <= iq.hi:
        print(
            "the two intervals overlap: the patch's cost is below what this many requests resolve "
            "(more --rounds / --requests narrow them)"
        )


if __name__ == "__main__":
    main()
