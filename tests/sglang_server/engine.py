"""Test-only engine script that ``fastverify launch`` runs in the CPU server tests (not product code).

Why: the tests need a real SGLang 0.5.23 ``Engine`` on CPU (TP over gloo, NGRAM speculative decoding,
the tiny model) whose answers, including SGLang's own count of verify steps (``meta_info
["spec_verify_ct"]``), come back in a form a test can read. SGLang spawns its TP workers
(``mp.set_start_method("spawn")``), so everything runs under the ``__main__`` guard.

    python engine.py CONFIG.json

``CONFIG.json``: ``{"model": DIR, "tp": 2, "prompts": [...], "max_new_tokens": N,
"engine": {extra Engine kwargs}, "engine_drop": [CPU_ENGINE_ARGS keys to leave out], "linger_s": S,
"loop_s": L}``
(``linger_s``: seconds to wait after the last answer before ``shutdown``; ``loop_s``: go on
answering the prompts again and again until ``L`` seconds after start-up, so that a test can kill a
TP worker mid-run; each answer then prints one ``FVTEST_ANSWER {json}`` line). Prints one line
``FVTEST_RESULT {json}`` on stdout: ``startup_s`` (Engine construction, seconds), ``requests``
(per prompt: ``text``, ``latency_s`` and the ``meta_info`` fields ``completion_tokens``,
``spec_verify_ct``, ``spec_accept_length``, ``spec_accept_token_num``), ``verify_ct_total``.
"""

from __future__ import annotations

import json
import sys
import time

# The CPU settings issue 10 found necessary for SGLang 0.5.23 (each was checked by running it).
CPU_ENGINE_ARGS = dict(
    device="cpu",
    attention_backend="torch_native",
    disable_cuda_graph=True,
    skip_server_warmup=True,
    mem_fraction_static=0.4,
    max_total_tokens=4096,
    speculative_algorithm="NGRAM",
    speculative_num_draft_tokens=4,
    speculative_ngram_max_bfs_breadth=1,
    max_running_requests=4,
    log_level="warning",
)
META = (
    "completion_tokens",
    "spec_verify_ct",
    "spec_accept_length",
    "spec_accept_token_num",
    "spec_accept_rate",
    "spec_num_correct_drafts",
    "spec_num_proposed_drafts",
    "spec_correct_drafts_histogram",
)


def main(config_path: str) -> None:
    cfg = json.loads(open(config_path, encoding="utf-8").read())
    import sglang

    kwargs = dict(CPU_ENGINE_ARGS, model_path=cfg["model"], tp_size=int(cfg.get("tp", 2)))
    for key in cfg.get("engine_drop", []):  # e.g. the NGRAM-only settings, for an EAGLE engine
        kwargs.pop(key, None)
    kwargs.update(cfg.get("engine", {}))
    t0 = time.perf_counter()
    engine = sglang.Engine(**kwargs)
    startup = time.perf_counter() - t0
    params = {"temperature": 0.0, "max_new_tokens": int(cfg.get("max_new_tokens", 24)), "ignore_eos": True}
    out = []
    loop_until = time.perf_counter() + float(cfg.get("loop_s", 0))
    try:
        while True:
            for prompt in cfg["prompts"]:
                t = time.perf_counter()
                r = engine.generate(prompt, params)
                meta = r.get("meta_info", {})
                out.append(
                    {
                        "text": r.get("text"),
                        "latency_s": round(time.perf_counter() - t, 3),
                        **{k: meta.get(k) for k in META},
                    }
                )
                if "loop_s" in cfg:
                    print("FVTEST_ANSWER " + json.dumps(out[-1]), flush=True)
            if time.perf_counter() >= loop_until:
                break
    finally:
        result = {
            "startup_s": round(startup, 3),
            "requests": out,
            "verify_ct_total": sum(int(x.get("spec_verify_ct") or 0) for x in out),
        }
        print("FVTEST_RESULT " + json.dumps(result), flush=True)
        # SGLang ends its workers with SIGKILL (kill_process_tree, srt/utils/common.py): give the
        # verify timer's writer (flushes at least every second) time to write the last records.
        time.sleep(float(cfg.get("linger_s", 0)))
        engine.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
