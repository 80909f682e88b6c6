"""A load run's record, ``load.json`` (:class:`LoadRun`, schema ``fastverify.load_run``), read and
checked: what ``launch --load`` measured, what ``compare`` and ``launch --baseline`` read back.

Every field has bounds a real run keeps (:func:`check_run`): tokens per answer 1..4096, as many
answers as prompts in a complete run and in the prompts' order, logprobs finite and <= 0, margins
finite and >= 0, tok/s finite in [one token per hour, 1e7]; a record past them is hand-edited or broken, and is
refused in one line naming the file and the field.
"""

from __future__ import annotations

import math
from pathlib import Path

import msgspec

from fastverify import __version__
from fastverify.bounds import MIN_TOK_S
from fastverify.errors import UserError, path_text, schema_error
from fastverify.inputs import decode_json, read_bytes
from fastverify.proof.answers import MAX_NEW_TOKENS, Answer, Prompt
from fastverify.proof.throughput import ThroughputRun

SCHEMA = "fastverify.load_run"
SCHEMA_VERSION = 1
RECORD = "load.json"
ANSWERS = "answers.jsonl"
COMPARABLE = ("tp", "algorithm", "draft_tokens", "topk", "steps", "dtype", "model")
"""Server-shape fields two runs must share to be compared (``launch``'s reading of the command)."""
MAX_TOK_S = 1e7
"""Most tokens per second one stream or a whole server can be credited with: far above any GPU's."""


class LoadRun(msgspec.Struct, kw_only=True):
    """One fixed-load run against one server.

    ``complete`` false with ``incomplete`` saying why when the run was cut short. ``server`` is the
    command as launch read it (SGLang's own parser: :class:`fastverify.patch.server_cmd.ServerShapes`),
    ``server_info`` what the server said of itself (:data:`SERVER_FACTS`). ``clock`` names the
    clock of every time here: the client's wall clock (``cpu_server_wall_clock`` when the server ran
    on CPU: never a GPU timing). ``answers`` follow ``prompts``; ``throughput`` one per concurrency.
    """

    schema: str = SCHEMA
    schema_version: int = SCHEMA_VERSION
    fastverify_version: str = __version__
    created_utc: str = ""
    complete: bool = False
    incomplete: str | None = None
    url: str = ""
    command: list[str] = []
    server: dict = {}
    server_info: dict = {}
    backend: str = ""
    env_file: str | None = None
    deployment: str | None = None
    clock: str = "wall_clock"
    prompts_source: str = ""
    prompts_digest: str = ""
    prompts: list[Prompt] = []
    max_new_tokens: int = 0
    answers: list[Answer] = []
    throughput: list[ThroughputRun] = []
    ready_s: float | None = None
    baseline: str | None = None
    answers_verdict: str | None = None

    @property
    def dtype(self) -> str | None:
        """The served dtype: the server's own ``dtype`` unless ``auto``, else the command's."""
        for d in (self.server_info.get("dtype"), self.server.get("dtype")):
            if isinstance(d, str) and d not in ("auto", ""):
                return d
        return None


def read_run(folder: str | Path, *, flag: str, allow_incomplete: bool = False) -> LoadRun:
    """The :class:`LoadRun` of ``folder/load.json``.

    Raises
    ------
    UserError
        No ``load.json`` (an unfinished or killed run: said), not a run record, or an incomplete run
        unless ``allow_incomplete``.
    """
    path = Path(folder) / RECORD
    try:
        present = path.exists()
    except OSError as err:  # a name too long, a loop
        raise UserError(f"{flag} {path_text(folder)}: {err.strerror or err}") from None
    if not present:
        what = "a run that never finished (launch killed?)" if (Path(folder) / ANSWERS).exists() else "no run"
        raise UserError(
            f"{flag} {path_text(folder)}: no {RECORD} ({what}; `fastverify launch --load "
            "--profile-verify DIR -- ...` writes one)"
        )
    raw = read_bytes(path, kind="json", flag=flag)
    try:
        run = decode_json(raw, path_text(path), LoadRun)
    except msgspec.ValidationError as err:
        raise schema_error(f"{path_text(path)}", err, {"schema": f'"{SCHEMA}"', "complete": "true"}) from None
    check_run(run, path_text(path))
    if not run.complete and not allow_incomplete:
        raise UserError(
            f"{flag} {path_text(folder)}: an incomplete run ({run.incomplete}); "
            "--allow-incomplete compares what it holds"
        )
    return run


def server_difference(a: dict, b: dict) -> tuple[str, object, object] | None:
    """The first :data:`COMPARABLE` field in which two readings of a server command differ, with
    both values; None when they agree."""
    return next(((k, a.get(k), b.get(k)) for k in COMPARABLE if a.get(k) != b.get(k)), None)


def _bad_answer(a: Answer, max_new: int) -> str | None:
    if not 0 < len(a.output_ids) <= max_new:
        return f"{len(a.output_ids)} output ids (expected 1..{max_new})"
    if a.logprobs is not None and (
        len(a.logprobs) != len(a.output_ids) or not all(math.isfinite(x) and x <= 0 for x in a.logprobs)
    ):
        return "logprobs must be finite, <= 0, one per output id"
    if a.margins is not None and (
        len(a.margins) != len(a.output_ids) or not all(m is None or (math.isfinite(m) and m >= 0) for m in a.margins)
    ):
        return "margins must be finite, >= 0, one per output id"
    return None


def _bad_throughput(t: ThroughputRun) -> str | None:
    rates = [*t.per_stream_tok_s, t.output_tok_s]
    if not all(isinstance(x, (int, float)) and math.isfinite(x) and MIN_TOK_S <= x <= MAX_TOK_S for x in rates):
        return f"tok/s must be finite in [{MIN_TOK_S:.3g} (one token per hour), {MAX_TOK_S:g}]"
    if not 1 <= t.concurrency <= 4096 or not 0 <= t.completed <= t.requests:
        return "concurrency 1..4096 and completed <= requests"
    return None


def check_run(run: LoadRun, where: str) -> None:
    """Refuse a record no run writes (see the module docstring); one line naming ``where`` and the field."""
    if run.schema != SCHEMA or run.schema_version != SCHEMA_VERSION:
        raise UserError(
            f"{where}: not a fastverify load run of this version (schema {run.schema!r} "
            f"{run.schema_version}; expected {SCHEMA!r} {SCHEMA_VERSION})"
        )
    if not 1 <= run.max_new_tokens <= MAX_NEW_TOKENS:
        raise UserError(f"{where}: max_new_tokens {run.max_new_tokens}: expected 1..{MAX_NEW_TOKENS}")
    ids = [p.id for p in run.prompts]
    if not ids or len(set(ids)) != len(ids):
        raise UserError(f"{where}: prompts must be one or more, each id once")
    if [a.id for a in run.answers] != ids[: len(run.answers)] or (run.complete and len(run.answers) != len(ids)):
        raise UserError(
            f"{where}: answers must follow the prompts one for one ({len(run.answers)} answers, {len(ids)} prompts)"
        )
    for a in run.answers:
        if (why := _bad_answer(a, run.max_new_tokens)) is not None:
            raise UserError(f"{where}: answer {a.id!r}: {why}")
    for t in run.throughput:
        if (why := _bad_throughput(t)) is not None:
            raise UserError(f"{where}: throughput at concurrency {t.concurrency}: {why}")
