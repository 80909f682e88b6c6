"""Hostile input against launch, profile, tune, doctor and the README, the leftovers of a hostile
trial: a ``launch --dry-run`` that says "blocked by: nothing" while the real launch refuses its
proof inputs; a live profile asked for 10^9 forwards; a "per-size choice" said of one message
size; a binary env file reported as a failed check; README commands reading files a clone lacks.

Each refusal is one line, exit 2, and nothing is started or written.
"""

from __future__ import annotations

import io
import re
import shlex
from pathlib import Path

import msgspec
import pytest
from conftest import cli, one_line_error
from rich.console import Console

from fastverify.bounds import MAX_ITERS, MAX_WARMUP
from fastverify.proof.answers import answer_of, prompt_digest, read_prompts
from fastverify.proof.record import LoadRun
from fastverify.tune.ranking import print_report, rank_candidates
from fastverify.tune.trial import SizeResult, TrialResult, TrialSpec

REPO = Path(__file__).resolve().parent.parent


# --- launch --dry-run: every refusal of the proof inputs is a blocker -------------------------------


@pytest.fixture
def fake_sglang(tmp_path, monkeypatch):
    """Make ``sglang`` importable from a folder of ours, first on ``sys.path``; ``client(True)``
    gives it SGLang's benchmark client file (``sglang/benchmark/serving.py``), ``client(False)``
    leaves it out: SGLang without the client launch --load runs."""
    root = tmp_path / "site"
    (root / "sglang").mkdir(parents=True)
    (root / "sglang" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(root))

    def client(present: bool) -> None:
        if present:
            (root / "sglang" / "benchmark").mkdir()
            (root / "sglang" / "benchmark" / "serving.py").write_text("")

    return client


def _baseline(folder: Path) -> Path:
    """A complete run of 4-token answers to fastverify's own prompts (a valid --baseline)."""
    prompts, source = read_prompts(None)
    reply = {
        "text": "abcd",
        "output_ids": [1, 2, 3, 4],
        "meta_info": {
            "output_token_logprobs": [[-0.1, t, None] for t in (1, 2, 3, 4)],
            "output_top_logprobs": [[[-0.1, t, None], [-3.0, t + 10, None]] for t in (1, 2, 3, 4)],
        },
    }
    run = LoadRun(
        complete=True,
        prompts=prompts,
        prompts_source=source,
        prompts_digest=prompt_digest(prompts),
        max_new_tokens=4,
        answers=[answer_of(p, reply, 0.01) for p in prompts],
        server={},
        server_info={"dtype": "float32"},
        clock="cpu_server_wall_clock",
    )
    folder.mkdir(parents=True)
    (folder / "load.json").write_bytes(msgspec.json.encode(run))
    return folder


def _prompts(folder: Path) -> Path:
    """A valid ``--load FILE``: two prompts, JSONL."""
    path = folder / "prompts.jsonl"
    path.write_text('{"prompt": "Say hello."}\n{"prompt": "Count to three."}\n')
    return path


def _blocked(out: str) -> list[str]:
    """The dry run's ``blocked by:`` lines (without the ``  - `` mark)."""
    tail = out.split("blocked by:", 1)[1]
    return [line[4:] for line in tail.splitlines() if line.startswith("  - ")]


CASES = {
    "--load FILE that does not exist": (
        True,
        ["--load", "{tmp}/no-prompts.jsonl", "--profile-verify", "{tmp}/run"],
        "load: --load {tmp}/no-prompts.jsonl: cannot read (No such file or directory)",
    ),
    "--baseline DIR that does not exist": (
        True,
        ["--baseline", "{tmp}/no-run"],
        "baseline: --baseline {tmp}/no-run: no load.json",
    ),
    "--concurrency that is not integers": (
        True,
        ["--load", "{prompts}", "--profile-verify", "{tmp}/run", "--concurrency", "4,x"],
        "load: --concurrency '4,x': 'x' is not an integer",
    ),
    "--url that is not a URL": (
        True,
        ["--baseline", "{base}", "--url", "http://[::1"],
        "URL: --url 'http://[::1': Invalid IPv6 URL",
    ),
    "SGLang without its benchmark client": (
        False,
        ["--load", "{prompts}", "--profile-verify", "{tmp}/run"],
        "load: --load runs SGLang's benchmark client (sglang.benchmark.serving), which this Python cannot import",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_dry_run_names_the_proof_refusal_and_the_real_launch_refuses_with_it_starting_nothing(
    tmp_path, capsys, fake_sglang, case
):
    """Before: the dry run printed ``blocked by: nothing``, then the refusal on stderr alone."""
    client, args, expected = CASES[case]
    fake_sglang(client)
    base = _baseline(tmp_path / "base")
    fill = {"tmp": str(tmp_path), "base": str(base), "prompts": str(_prompts(tmp_path))}
    args = [a.format(**fill) for a in args]
    expected = expected.format(**fill)
    url = [] if "--url" in args else ["--url", "http://127.0.0.1:9"]
    marker = tmp_path / "started"
    argv = ["launch", "--backend", "off", *args, *url, "--", "touch", str(marker)]

    rc, out, err = cli([*argv[:1], "--dry-run", *argv[1:]], capsys)
    assert rc == 2 and "blocked by: nothing" not in out, out
    (blocker,) = _blocked(out)
    assert blocker.startswith(expected), (blocker, expected)
    message = blocker.split(": ", 1)[1]
    summary = one_line_error(rc, out, err, "launch is blocked by 1 check (listed above); first: ")
    assert summary == f"fastverify: error: launch is blocked by 1 check (listed above); first: {message}"

    rc, out, err = cli(argv, capsys)
    assert one_line_error(rc, out, err) == f"fastverify: error: {message}"
    assert not marker.exists() and not (tmp_path / "run").exists()


def test_dry_run_collects_every_proof_refusal_at_once_in_the_real_launch_order(tmp_path, capsys, fake_sglang):
    """All at once: a bad --concurrency, a bad --url, a --baseline that is no run, a --load FILE
    beside it, and SGLang without its client: five blockers; the real launch refuses with the first."""
    fake_sglang(False)
    marker = tmp_path / "started"
    argv = [
        "launch",
        "--backend",
        "off",
        "--load",
        str(tmp_path / "p.jsonl"),
        "--profile-verify",
        str(tmp_path / "run"),
        "--baseline",
        str(tmp_path / "no-run"),
        "--concurrency",
        "0",
        "--url",
        "ftp://x",
        "--",
        "touch",
        str(marker),
    ]
    rc, out, err = cli([*argv[:1], "--dry-run", *argv[1:]], capsys)
    checks = [b.split(": ", 1)[0] for b in _blocked(out)]
    assert checks == ["load", "URL", "baseline", "load", "load"], out
    one_line_error(rc, out, err, "launch is blocked by 5 checks (listed above); first: --concurrency")
    first = _blocked(out)[0].split(": ", 1)[1]
    rc, out, err = cli(argv, capsys)
    assert one_line_error(rc, out, err) == f"fastverify: error: {first}"
    assert not marker.exists() and not (tmp_path / "run").exists()


def test_a_clean_proof_dry_run_says_nothing_blocks_and_makes_no_folder(tmp_path, capsys, fake_sglang):
    fake_sglang(True)
    rc, out, err = cli(
        [
            "launch",
            "--backend",
            "off",
            "--dry-run",
            "--load",
            _prompts(tmp_path),
            "--profile-verify",
            tmp_path / "run",
            "--url",
            "http://127.0.0.1:9",
            "--",
            "true",
        ],
        capsys,
    )
    assert rc == 0 and out.splitlines()[-1] == "blocked by: nothing" and err == "", (out, err)
    assert not (tmp_path / "run").exists()


# --- profile: live run counts are bounded -----------------------------------------------------------


@pytest.mark.parametrize(
    "flag, value, bound",
    [
        ("--iters", 10**9, MAX_ITERS),
        ("--iters", MAX_ITERS + 1, MAX_ITERS),
        ("--warmup", 10**9, MAX_WARMUP),
        ("--warmup", MAX_WARMUP + 1, MAX_WARMUP),
    ],
)
def test_profile_refuses_a_live_count_past_its_bound_at_parsing(capsys, flag, value, bound):
    """Before: ``--iters 1000000000`` started the ranks and ran until --timeout."""
    with pytest.raises(SystemExit) as e:
        cli(["profile", "--device", "cpu", "--timeout", "5", flag, str(value), "--no-png"], capsys)
    err = capsys.readouterr().err
    low = 1 if flag == "--iters" else 0
    assert e.value.code == 2 and err == (
        f"fastverify: error: argument {flag}: expected an integer in [{low}, {bound}], got {value}\n"
    ), err


def test_run_live_checks_refuse_the_same_counts_before_any_rank():
    from fastverify.errors import UserError
    from fastverify.live.config import load_model_config
    from fastverify.live.preflight import check_run_args

    tiny = load_model_config("tiny")
    check_run_args(tiny, tp=2, draft_tokens=4, batch=1, iters=MAX_ITERS, warmup=MAX_WARMUP, timeout_s=300)
    with pytest.raises(UserError, match=rf"^--iters 1000000000: expected at most {MAX_ITERS}$"):
        check_run_args(tiny, tp=2, draft_tokens=4, batch=1, iters=10**9, warmup=2, timeout_s=300)
    with pytest.raises(UserError, match=rf"^--warmup {MAX_WARMUP + 1}: expected at most {MAX_WARMUP}$"):
        check_run_args(tiny, tp=2, draft_tokens=4, batch=1, iters=5, warmup=MAX_WARMUP + 1, timeout_s=300)


def test_the_iteration_bound_is_where_its_reason_puts_it():
    # bounds.py: the median's 95 % interval at n = MAX_ITERS is 1.96 x sqrt(n) / 2 ranks, 0.3 % of n
    assert MAX_ITERS == 100_000 and MAX_WARMUP == MAX_ITERS // 10
    assert round(1.96 * MAX_ITERS**0.5 / 2 / MAX_ITERS * 100, 1) == 0.3


# --- tune: a per-size choice needs two sizes with different winners -------------------------------


def _spec(**kw) -> TrialSpec:
    base = dict(
        backend="gloo",
        env={},
        world_size=2,
        device="cpu",
        dtype="bfloat16",
        hidden=64,
        sizes=((64, 9),),
        warmup=1,
        iters=3,
    )
    return TrialSpec(**{**base, **kw})


def _result(spec: TrialSpec, medians: dict[int, float]) -> TrialResult:
    sizes = tuple(SizeResult(n // 2, n, 9, m, m, 0.0) for n, m in medians.items())
    return TrialResult(spec.trial_id, "ok", "", sizes, sum(9 * m for m in medians.values()), "cpu_wall_clock", 1.0, 2.0)


def _report(specs, results) -> str:
    out = io.StringIO()
    print_report(rank_candidates(specs, results), Console(file=out, width=250))
    return out.getvalue()


def test_one_swept_size_says_no_per_size_choice():
    """Before: ``best per size combined: ...; needs a per-size choice`` with one size (a CPU tune of
    the tiny model sweeps 2 KiB only)."""
    base, other = _spec(baseline=True), _spec(env={"NCCL_PROTO": "LL"})
    text = _report([base, other], [_result(base, {2048: 3.0}), _result(other, {2048: 2.0})])
    assert "2 KiB" in text and "per-size choice" not in text and "per size combined" not in text, text


def test_two_sizes_need_a_per_size_choice_only_when_their_winners_differ():
    base, other = _spec(baseline=True), _spec(env={"NCCL_PROTO": "LL"})
    same = _report([base, other], [_result(base, {2048: 3.0, 65536: 9.0}), _result(other, {2048: 2.0, 65536: 8.0})])
    assert "per-size choice" not in same, same
    mixed = _report([base, other], [_result(base, {2048: 3.0, 65536: 7.0}), _result(other, {2048: 2.0, 65536: 8.0})])
    # the best per size: other at 2 KiB (2.0 µs), the baseline at 64 KiB (7.0 µs): 9 x 2.0 + 9 x 7.0 = 81 µs,
    # printed in ms for a CPU clock
    line = next(ln for ln in mixed.splitlines() if "per size combined" in ln)
    assert line.startswith("best per size combined: 0.081 ms per step") and "per-size choice" in line, line


# --- a binary env file is a bad argument -----------------------------------------------------------


@pytest.mark.parametrize(
    "data, why",
    [
        (b"NCCL_ALGO=Ring\x00\n", "a binary file (NUL byte at offset 14), not text"),
        (b"NCCL_ALGO=Ring\xff\xfe\n", "not UTF-8 text (byte 14)"),
    ],
)
@pytest.mark.parametrize(
    "command",
    [
        ["doctor", "--quick", "--env-file"],
        ["doctor", "--quick", "--json", "--env-file"],
        ["launch", "--dry-run", "--env"],
    ],
)
def test_a_binary_env_file_is_one_line_naming_it(tmp_path, capsys, data, why, command):
    """Before: ``doctor --env-file`` reported it as a failed ``env_file`` check (exit 1)."""
    path = tmp_path / "box.env"
    path.write_bytes(data)
    tail = ["--", "true"] if command[0] == "launch" else []
    rc, out, err = cli([*command, path, *tail], capsys)
    line = one_line_error(rc, "", err, str(path), why)
    assert "cannot read env file" in line and out == ""


# --- README: every command works from a fresh clone ------------------------------------------------


def test_readme_commands_read_only_files_a_clone_has():
    """Before: the "Without the box" commands read ``../shared/inputs/...``, beside the repository,
    which a ``git clone`` does not have."""
    text = (REPO / "README.md").read_text()
    blocks = "\n".join(re.findall(r"```bash\n(.*?)```", text, re.S))
    outside = sorted(
        {w for line in blocks.splitlines() for w in shlex.split(line.split(" # ")[0]) if w.startswith("../")}
    )
    assert outside == [], outside
    inputs = re.findall(r"--(?:topology|nccl-log|perf-table) (\S+)", blocks)  # read away from the box
    assert inputs and all((REPO / p).is_file() for p in inputs), inputs
