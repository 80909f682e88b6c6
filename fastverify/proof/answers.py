"""The answer phase's records: fixed prompts, the greedy answers a running SGLang server gave them
(asked by :mod:`fastverify.proof.run`), and the verdict on two sets of answers (the same, the
same within reordering noise, or CHANGED).

Each prompt is one ``POST /generate`` (SGLang 0.5.23 ``srt/entrypoints/http_server.py``) with
``temperature`` 0, a fixed ``max_new_tokens`` and ``ignore_eos`` (every answer runs its full length),
``return_logprob`` and ``top_logprobs_num`` 2. SGLang answers ``output_ids`` and, in ``meta_info``,
``output_token_logprobs`` (``[logprob, token id, text]`` per output token), ``output_top_logprobs``
(the top 2 of each position, the same triples), ``completion_tokens`` and ``spec_verify_ct``
(``srt/managers/tokenizer_manager.py``). Logprobs are natural-log probabilities (nats).

The verdict's rule, one tolerance ``tol`` (nats) for both of its halves: a change of numerics only
(a reordered sum) moves every logprob by at most ``tol``, so (1) the chosen tokens' logprobs before
any divergence differ by at most ``tol``, and (2) a greedy answer can only diverge where the
baseline's top-1/top-2 margin is at most ``2 x tol`` (each of the two moves ``tol`` towards the
other): a near-tie; and (3) every top-1/top-2 margin before it moves by at most ``2 x tol``. The
margin is the sharper of the two witnesses: a chosen token near probability 1 has a logprob near
0 whatever its logits do, while the margin is a difference of logits. Anything else is CHANGED.
``tol`` defaults by the served dtype (:data:`DEFAULT_TOL`, said with its basis in every verdict).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

import msgspec
import orjson

from fastverify.errors import UserError, path_text
from fastverify.inputs import loads_json, read_text

MAX_PROMPTS = 10_000
MAX_PROMPT_CHARS = 1_000_000
MAX_NEW_TOKENS = 4096
DEFAULT_MAX_NEW_TOKENS = 64
TOP_LOGPROBS = 2
DEFAULT_PROMPTS = "fastverify/data/prompts.jsonl"
"""Where the default prompts come from, as said in a run's record (read from the package)."""

DEFAULT_TOL = {"float32": 1e-3, "float16": 0.05, "bfloat16": 0.25}
"""Default tolerance (nats) per served dtype: how far a numerics-only change may move one logprob.
fastverify's choice, not a measured bound: a sum reordered in float32 moves a logprob by about
1e-6 on the CPU test model, and bfloat16 keeps 8 significant bits (a relative step of 2^-8 per
rounding). ``--logprob-tol`` replaces it; two baseline runs measure the real noise of a box."""
UNKNOWN_DTYPE_TOL = "bfloat16"

SAME = "same answers"
NOISE = "same within reordering noise"
CHANGED = "CHANGED"


class Prompt(msgspec.Struct, frozen=True):
    """One prompt of the answer phase: its ``id`` (the file's, else ``line<N>``) and ``text``."""

    id: str
    text: str


class Answer(msgspec.Struct, frozen=True):
    """One greedy answer. ``output_ids`` are the generated token ids; ``logprobs`` the chosen
    token's logprob (nats) at each position and ``margins`` the top-1 minus top-2 logprob there
    (None where the server gave fewer than two); both None when the server returned no logprobs.
    ``completion_tokens`` and ``spec_verify_ct`` are SGLang's ``meta_info`` (verify steps this
    request took); ``latency_s`` the client's wall clock for the request (s)."""

    id: str
    output_ids: list[int]
    logprobs: list[float] | None
    margins: list[float | None] | None
    completion_tokens: int | None
    spec_verify_ct: int | None
    latency_s: float

    @property
    def accept_length(self) -> float | None:
        """Tokens per verify step of this request (``completion_tokens / spec_verify_ct``, SGLang's
        ``spec_accept_length``, bonus token included); None without speculative decoding."""
        if self.completion_tokens and self.spec_verify_ct:
            return self.completion_tokens / self.spec_verify_ct
        return None


class AnswerBaseline(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The answers of a ``launch --load`` run of the server without the swap (``tune --write-env
    --baseline DIR``), which ``launch --env`` asks again of the patched server before it serves:
    the run folder (``source``), its ``prompts``, ``max_new_tokens`` and ``answers``, the server
    shapes it ran (``server``, launch's reading of the command) and the served ``dtype``."""

    source: str
    prompts: list[Prompt]
    max_new_tokens: int
    answers: list[Answer]
    server: dict = {}
    dtype: str | None = None


class PromptVerdict(msgspec.Struct, frozen=True):
    """One prompt judged: ``status`` ``same`` / ``near_tie`` / ``changed``; the first divergent
    position (None: identical ids), the baseline's margin there (nats), and the largest |Δ logprob|
    of the chosen tokens before it (nats; None without logprobs on both sides)."""

    id: str
    status: str
    position: int | None
    margin: float | None
    max_dlogprob: float | None
    why: str
    max_dmargin: float | None = None


class AnswersVerdict(msgspec.Struct, frozen=True):
    """The answers of AFTER against BEFORE: ``identical`` of ``total`` prompts gave the same ids;
    ``verdict`` is :data:`SAME`, :data:`NOISE` or :data:`CHANGED`; ``tol`` (nats) and its ``basis``."""

    verdict: str
    identical: int
    total: int
    tol: float
    basis: str
    prompts: list[PromptVerdict]

    def first_changed(self) -> PromptVerdict | None:
        return next((p for p in self.prompts if p.status == "changed"), None)

    def line(self) -> str:
        """``same answers (16/16)``, ``same within reordering noise (15/16; ...)`` or ``CHANGED: ...``."""
        if self.verdict == CHANGED:
            c = self.first_changed()
            return f"CHANGED: prompt {c.id}: {c.why}; do not deploy"
        if self.verdict == NOISE:
            ties = [p for p in self.prompts if p.status == "near_tie"]
            where = ", ".join(f"{p.id} at token {p.position} (margin {p.margin:.2g})" for p in ties[:3])
            return (
                f"{NOISE} ({self.identical}/{self.total} identical; diverged only at near-ties: {where}; "
                f"a near-tie is a margin <= 2 x {self.tol:g} nats, {self.basis})"
            )
        unchecked = sum(p.max_dlogprob is None for p in self.prompts)
        note = f"; {unchecked} without logprobs: tokens compared only" if unchecked else ""
        return f"{SAME} ({self.identical}/{self.total}{note})"


def prompt_digest(prompts: Sequence[Prompt]) -> str:
    """SHA-256 (hex) of the prompts' ids and texts in order: equal digests, the same prompts."""
    h = hashlib.sha256()
    for p in prompts:
        h.update(orjson.dumps([p.id, p.text]))
    return h.hexdigest()


def _prompt_of(line: str, n: int, where: str) -> Prompt:
    obj = loads_json(line, f"{where} line {n}", what='a prompt line (one object a line, e.g. {"prompt": "..."})')
    if not isinstance(obj, dict):
        raise UserError(f'{where} line {n}: expected an object with "prompt", got {type(obj).__name__}')
    text = obj.get("prompt", obj.get("text"))
    if not isinstance(text, str):
        raise UserError(f'{where} line {n}: "prompt" must be a string, e.g. {{"prompt": "Hello"}}')
    if not text.strip():
        raise UserError(f"{where} line {n}: an empty prompt")
    if len(text) > MAX_PROMPT_CHARS:
        raise UserError(f"{where} line {n}: a prompt of {len(text):,} characters, over {MAX_PROMPT_CHARS:,}")
    pid = obj.get("id", f"line{n}")
    if not isinstance(pid, (str, int)) or isinstance(pid, bool):
        raise UserError(f'{where} line {n}: "id" must be a string or an integer')
    return Prompt(str(pid), text)


def parse_prompts(text: str, where: str) -> list[Prompt]:
    """Prompts of a JSONL text (``{"prompt": str, "id": optional}`` a line; blank lines skipped).

    Raises
    ------
    UserError
        A line that is not a JSON object, an empty or missing prompt, an id twice, no prompt, or
        more than :data:`MAX_PROMPTS`; the line is named.
    """
    out: list[Prompt] = []
    seen: dict[str, int] = {}
    for n, line in enumerate(text.removeprefix("\ufeff").splitlines(), 1):  # a byte-order mark is not a prompt
        if not line.strip():
            continue
        p = _prompt_of(line, n, where)
        if p.id in seen:
            raise UserError(f"{where} line {n}: id {p.id!r} again (first on line {seen[p.id]})")
        seen[p.id] = n
        out.append(p)
        if len(out) > MAX_PROMPTS:
            raise UserError(f"{where}: more than {MAX_PROMPTS:,} prompts")
    if not out:
        raise UserError(f'{where}: no prompt (one JSON object a line, e.g. {{"prompt": "Hello"}})')
    return out


def read_prompts(path: str | Path | None) -> tuple[list[Prompt], str]:
    """The prompts of ``path`` (JSONL, :func:`parse_prompts`), else fastverify's own 16; and where
    they came from (the path, or :data:`DEFAULT_PROMPTS`). Raises :class:`UserError` as
    :func:`parse_prompts`, or for a file that cannot be read."""
    if path is None:
        text = resources.files("fastverify.data").joinpath("prompts.jsonl").read_text(encoding="utf-8")
        return parse_prompts(text, DEFAULT_PROMPTS), DEFAULT_PROMPTS
    return parse_prompts(read_text(path, flag="--load"), path_text(path)), path_text(path)


def request_body(prompt: Prompt, max_new_tokens: int) -> dict:
    """The ``/generate`` body of one greedy answer with its logprobs."""
    return {
        "text": prompt.text,
        "return_logprob": True,
        "top_logprobs_num": TOP_LOGPROBS,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": True},
    }


def _int_or_none(v) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def _logprobs(meta: dict, n: int) -> tuple[list[float] | None, list[float | None] | None]:
    """The chosen logprobs and top-1/top-2 margins of ``n`` output tokens, or (None, None) when the
    reply lacks them or they do not match the ids one for one."""
    chosen, top = meta.get("output_token_logprobs"), meta.get("output_top_logprobs")
    if not isinstance(chosen, list) or len(chosen) != n:
        return None, None
    try:
        lps = [float(t[0]) for t in chosen]
    except (TypeError, ValueError, IndexError):
        return None, None
    margins: list[float | None] = [None] * n
    if isinstance(top, list) and len(top) == n:
        for i, pos in enumerate(top):
            try:
                vals = sorted((float(t[0]) for t in pos), reverse=True)
            except (TypeError, ValueError, IndexError):
                continue
            if len(vals) >= 2:
                margins[i] = vals[0] - vals[1]
    return lps, margins


def answer_of(prompt: Prompt, reply: dict, latency_s: float) -> Answer:
    """The :class:`Answer` in one ``/generate`` reply.

    Raises
    ------
    ValueError
        The reply has no ``output_ids`` list of ints (not an SGLang answer).
    """
    ids = reply.get("output_ids")
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError("the reply has no output_ids")
    meta = reply.get("meta_info") if isinstance(reply.get("meta_info"), dict) else {}
    lps, margins = _logprobs(meta, len(ids))
    return Answer(
        prompt.id,
        ids,
        lps,
        margins,
        _int_or_none(meta.get("completion_tokens")),
        _int_or_none(meta.get("spec_verify_ct")),
        round(latency_s, 6),
    )


def tolerance(dtype: str | None, given: float | None) -> tuple[float, str]:
    """The tolerance (nats) and its basis: ``given`` (``--logprob-tol``), else :data:`DEFAULT_TOL`
    of the served ``dtype`` (an unknown dtype takes bfloat16's, the widest, and says so)."""
    if given is not None:
        return given, "--logprob-tol"
    if dtype in DEFAULT_TOL:
        return DEFAULT_TOL[dtype], f"fastverify's default for {dtype}"
    return DEFAULT_TOL[UNKNOWN_DTYPE_TOL], f"fastverify's default for {UNKNOWN_DTYPE_TOL} (served dtype unknown)"


def _judge(before: Answer, after: Answer, tol: float) -> PromptVerdict:
    a, b = before.output_ids, after.output_ids
    pos = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if pos is None and len(a) != len(b):
        pos = min(len(a), len(b))
    upto = len(a) if pos is None else pos
    dl = dm = None
    if before.logprobs is not None and after.logprobs is not None:
        dl = max((abs(x - y) for x, y in zip(before.logprobs[:upto], after.logprobs[:upto])), default=0.0)
    if before.margins is not None and after.margins is not None:
        dm = max(
            (
                abs(x - y)
                for x, y in zip(before.margins[:upto], after.margins[:upto])
                if x is not None and y is not None
            ),
            default=0.0,
        )
    margin = None
    if pos is not None and before.margins is not None and pos < len(before.margins):
        margin = before.margins[pos]
    at = "" if pos is None else f", then diverged at token {pos}"
    if dl is not None and dl > tol:
        return PromptVerdict(
            before.id, "changed", pos, margin, dl, f"a chosen token's logprob moved {dl:.3g} nats (> {tol:g}){at}", dm
        )
    if dm is not None and dm > 2 * tol:
        return PromptVerdict(
            before.id, "changed", pos, margin, dl, f"a top-1/top-2 margin moved {dm:.3g} nats (> 2 x {tol:g}){at}", dm
        )
    if pos is None:
        return PromptVerdict(before.id, "same", None, None, dl, "identical", dm)
    if margin is not None and margin <= 2 * tol:
        return PromptVerdict(
            before.id,
            "near_tie",
            pos,
            margin,
            dl,
            f"diverged at token {pos}, a near-tie (baseline margin {margin:.3g} nats)",
            dm,
        )
    said = "no margin known" if margin is None else f"baseline margin {margin:.3g} nats > 2 x {tol:g}"
    return PromptVerdict(before.id, "changed", pos, margin, dl, f"diverged at token {pos} ({said})", dm)


def judge(before: Sequence[Answer], after: Sequence[Answer], tol: float, basis: str) -> AnswersVerdict:
    """AFTER's answers against BEFORE's, prompt by prompt (the rule: the module docstring).

    Raises
    ------
    UserError
        The two sets are of different prompts (ids or order).
    """
    if [x.id for x in before] != [x.id for x in after]:
        raise UserError("the two runs answered different prompts: not comparable")
    verdicts = [_judge(x, y, tol) for x, y in zip(before, after)]
    identical = sum(x.output_ids == y.output_ids for x, y in zip(before, after))
    statuses = {v.status for v in verdicts}
    verdict = CHANGED if "changed" in statuses else NOISE if "near_tie" in statuses else SAME
    return AnswersVerdict(verdict, identical, len(verdicts), tol, basis, verdicts)
