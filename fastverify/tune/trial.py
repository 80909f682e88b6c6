"""Records of one tuning trial: what to measure (:class:`TrialSpec`) and what came out (:class:`TrialResult`).

A trial is one all-reduce backend with one set of environment settings (``NCCL_*`` and the like),
measured on ``world_size`` fresh rank processes over a list of message sizes. Both records are
frozen and round-trip through plain JSON dicts (:meth:`TrialSpec.to_dict` / :meth:`TrialSpec.from_dict`,
same for results), which is how they travel to workers and into the journal.

The trial id is a stable hash of everything that changes the measurement (not the display
``label``), so a resumed sweep recognises a trial it already ran whatever order the trials come in.

Which internal path a trial's backend took: its ``path_counts`` as the ranks report them
(:func:`path_counts`), and whether it fell back (to ``torch.distributed``) instead of running its
own kernel (:func:`fell_back`). A trial that fell back measured the fallback, not the backend, so
:mod:`fastverify.tune.ranking` never ranks it.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import orjson

from fastverify.registry import Role, backend_info

SCHEMA_VERSION = 1

_ENV_KEY = re.compile(r"[A-Z_][A-Z0-9_]*\Z")
DTYPES = ("bfloat16", "float16", "float32")
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
PROBE_FACTS = ("p2p_ok", "nvlink_full")
NORMS = ("auto", "flashinfer", "torch")
"""``TrialSpec.norm`` values (``fastverify.backends.base.NormKernel`` plus ``auto``), spelled here so
this module stays torch-free."""


class Device(StrEnum):
    CPU = "cpu"
    CUDA = "cuda"


class Op(StrEnum):
    """What each timed call does. ``all_reduce``: out-of-place sum. ``all_reduce_residual_rmsnorm``:
    sum, then ``residual += sum`` and RMSNorm (fused where the backend can, else composed)."""

    ALL_REDUCE = "all_reduce"
    ALL_REDUCE_RESIDUAL_RMSNORM = "all_reduce_residual_rmsnorm"


class TrialStatus(StrEnum):
    OK = "ok"
    FAILED = "failed"  # crashed, hung (killed at the timeout) or exited without a result
    SKIPPED = "skipped"  # the backend's capability check said no (BackendUnavailable), or no such device
    WRONG_RESULT = "wrong_result"  # ran, but the output differs from the torch reference


class Clock(StrEnum):
    CUDA_EVENTS = "cuda_events"  # GPU time between CUDA events around CUDA-graph replays
    CPU_WALL_CLOCK = "cpu_wall_clock"  # host perf_counter around eager gloo calls: NOT GPU time


Scalar = str | int | float | bool | None


def _canonical(obj: Any) -> bytes:
    return orjson.dumps(obj, option=orjson.OPT_SORT_KEYS)


def _check_int(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"TrialSpec.{name} must be an integer >= {low}, got {value!r}")


@dataclass(frozen=True)
class TrialSpec:
    """One backend + settings to measure.

    Parameters
    ----------
    backend : str
        Name passed to ``fastverify.backends.make_backend`` (e.g. ``"torch"``).
    env : Mapping[str, str]
        Set in every rank process before ``torch.distributed`` is imported (NCCL reads most of its
        settings once per process). Keys are upper-case env names; stored sorted as pairs.
    world_size : int
        Rank processes (one GPU each on CUDA).
    device : {"cpu", "cuda"}
        ``"cpu"`` runs gloo with wall-clock timing, ``"cuda"`` runs NCCL with CUDA graphs + events.
    dtype : {"bfloat16", "float16", "float32"}
    hidden : int
        Model hidden size: tensors are shaped ``(numel // hidden, hidden)`` when ``hidden`` divides
        ``numel``, else ``(numel,)``.
    sizes : sequence of (numel, count_per_step)
        Elements per all-reduce and how many such all-reduces one verify step does.
    warmup, iters : int
        Untimed and timed calls (CPU) or graph replays (CUDA) per size.
    options : Mapping[str, scalar]
        Backend options (``max_numel``, ``use_oneshot``…), passed to ``make_backend``; stored sorted.
        Not ``norm``: that is :attr:`norm`.
    norm : {"auto", "flashinfer", "torch"}
        The residual add + RMSNorm kernel after a plain all-reduce, passed to every backend as its
        ``norm`` option so all trials of a sweep compare all-reduces on one norm kernel.
        ``"auto"``: the worker resolves it with ``fastverify.backends.base.choose_norm``
        (FlashInfer's ``fused_add_rmsnorm`` on CUDA bf16/fp16 where it imports, else torch), the
        same answer for every backend on one box; the resolved kernel is in the result's
        ``worker_meta["norm"]``. :func:`fastverify.tune.sweep.run_sweep` refuses a sweep whose
        trials ask for different norms.
    op : Op
        The timed operation.
    probe_facts : Mapping[str, bool | None]
        Facts the backend's capability probe cannot measure safely in the worker, from the topology
        check: ``p2p_ok`` (every GPU pair passed P2P), ``nvlink_full``. Unknown (absent) means the
        probe treats it as a failure where the backend needs it.
    server_env : Mapping[str, str]
        What the SGLang server's start-up sets over the shell's environment plus ``env``
        (``fastverify.tune.server_env``): applied after ``env``, as SGLang applies it after the
        user's settings. Part of :attr:`trial_id`; stored sorted as pairs.
    label : str
        Display name only; not part of :attr:`trial_id`.
    baseline : bool
        The trial the report compares every other against (the current/default setting).
    """

    backend: str
    env: tuple[tuple[str, str], ...] | Mapping[str, str]
    world_size: int
    device: Device | str
    dtype: str
    hidden: int
    sizes: tuple[tuple[int, int], ...]
    warmup: int = 2
    iters: int = 10
    options: tuple[tuple[str, Scalar], ...] | Mapping[str, Scalar] = ()
    op: Op | str = Op.ALL_REDUCE
    norm: str = "auto"
    probe_facts: tuple[tuple[str, bool | None], ...] | Mapping[str, bool | None] = ()
    server_env: tuple[tuple[str, str], ...] | Mapping[str, str] = ()
    label: str = ""
    baseline: bool = False
    trial_id: str = field(init=False, compare=False)

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        if not isinstance(self.backend, str) or not self.backend:
            raise ValueError(f"TrialSpec.backend must be a non-empty backend name, got {self.backend!r}")
        for name in ("env", "server_env"):
            env = dict(getattr(self, name))
            for k, v in env.items():
                if not isinstance(k, str) or not _ENV_KEY.match(k):
                    raise ValueError(f"TrialSpec.{name} key {k!r} is not an environment variable name (A-Z, 0-9, _)")
                if not isinstance(v, str):
                    raise ValueError(f"TrialSpec.{name}[{k!r}] must be a string, got {v!r}; write numbers as text")
            set_(self, name, tuple(sorted(env.items())))
        _check_int("world_size", self.world_size, 1)
        try:
            set_(self, "device", Device(self.device))
        except ValueError:
            raise ValueError(f"TrialSpec.device must be 'cpu' or 'cuda', got {self.device!r}") from None
        if self.dtype not in DTYPES:
            raise ValueError(f"TrialSpec.dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        _check_int("hidden", self.hidden, 1)
        try:
            set_(self, "op", Op(self.op))
        except ValueError:
            raise ValueError(f"TrialSpec.op must be one of {', '.join(Op)}, got {self.op!r}") from None
        sizes = tuple((n, c) for n, c in self.sizes)
        if not sizes:
            raise ValueError("TrialSpec.sizes is empty: give at least one (numel, count_per_step)")
        for n, c in sizes:
            _check_int("sizes numel", n, 1)
            _check_int("sizes count_per_step", c, 1)
            if self.op is Op.ALL_REDUCE_RESIDUAL_RMSNORM and n % self.hidden:
                raise ValueError(
                    f"TrialSpec.sizes numel {n} is not a multiple of hidden {self.hidden}, "
                    f"which {self.op.value} needs (rows of hidden elements)"
                )
        if len({n for n, _ in sizes}) != len(sizes):
            raise ValueError(f"TrialSpec.sizes repeats a numel: {[n for n, _ in sizes]}; merge the counts")
        set_(self, "sizes", sizes)
        _check_int("warmup", self.warmup, 0)
        _check_int("iters", self.iters, 1)
        options = dict(self.options)
        for k, v in options.items():
            if not isinstance(k, str) or not isinstance(v, (str, int, float, bool, type(None))):
                raise ValueError(f"TrialSpec.options must map names to scalars, got {k!r}: {v!r}")
        if "norm" in options:
            raise ValueError(
                "TrialSpec.options must not hold 'norm'; set TrialSpec.norm, which every trial of a sweep shares"
            )
        set_(self, "options", tuple(sorted(options.items())))
        if self.norm not in NORMS:
            raise ValueError(f"TrialSpec.norm must be one of {', '.join(NORMS)}, got {self.norm!r}")
        facts = dict(self.probe_facts)
        for k, v in facts.items():
            if k not in PROBE_FACTS or not isinstance(v, (bool, type(None))):
                raise ValueError(
                    f"TrialSpec.probe_facts must map {' or '.join(PROBE_FACTS)} to True/False/None, got {k!r}: {v!r}"
                )
        set_(self, "probe_facts", tuple(sorted(facts.items())))
        if not isinstance(self.label, str):
            raise ValueError(f"TrialSpec.label must be a string, got {self.label!r}")
        set_(self, "baseline", bool(self.baseline))
        content = {k: v for k, v in self._fields().items() if k != "label"}
        set_(self, "trial_id", hashlib.sha256(_canonical(content)).hexdigest()[:16])

    def _fields(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "env": dict(self.env),
            "world_size": self.world_size,
            "device": self.device.value,
            "dtype": self.dtype,
            "hidden": self.hidden,
            "sizes": [list(s) for s in self.sizes],
            "warmup": self.warmup,
            "iters": self.iters,
            "options": dict(self.options),
            "op": self.op.value,
            "norm": self.norm,
            "probe_facts": dict(self.probe_facts),
            "server_env": dict(self.server_env),
            "label": self.label,
            "baseline": self.baseline,
        }

    @property
    def env_dict(self) -> dict[str, str]:
        return dict(self.env)

    @property
    def run_env(self) -> dict[str, str]:
        """What the trial sets over the shell's environment: ``env``, then ``server_env`` over it."""
        return {**dict(self.env), **dict(self.server_env)}

    @property
    def options_dict(self) -> dict[str, Scalar]:
        return dict(self.options)

    @property
    def name(self) -> str:
        """The label, else ``backend`` plus its settings (``torch NCCL_PROTO=LL``)."""
        if self.label:
            return self.label
        parts = [self.backend] + (["+residual+rmsnorm"] if self.op is Op.ALL_REDUCE_RESIDUAL_RMSNORM else [])
        parts += [f"{k}={v}" for k, v in self.env] + [f"{k}={v}" for k, v in self.options]
        return " ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {"trial_id": self.trial_id, **self._fields()}

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> TrialSpec:
        spec = cls(**{k: v for k, v in doc.items() if k != "trial_id"})
        if "trial_id" in doc and doc["trial_id"] != spec.trial_id:
            raise ValueError(f"trial id {doc['trial_id']!r} does not match its content (hash {spec.trial_id!r})")
        return spec


@dataclass(frozen=True)
class SizeResult:
    """One message size of a trial. Times are µs per all-reduce call: for each timed iteration the
    slowest rank's time (a collective ends when its last rank does), then median / 90th percentile
    over iterations. ``max_rel_err`` is the largest relative error against the torch reference on
    any rank (``None`` where the check never ran)."""

    numel: int
    msg_bytes: int
    count_per_step: int
    median_us: float | None
    p90_us: float | None
    max_rel_err: float | None


@dataclass(frozen=True)
class TrialResult:
    """The outcome of one trial.

    ``step_us`` is Σ over sizes of ``count_per_step × median_us``: the all-reduce time of one verify
    step (``None`` unless ``status`` is ok). ``clock`` says what was timed; CPU results are gloo
    wall-clock times and never stand for GPU times. ``reason`` is one line (empty when ok); ``note``
    carries caveats (on CPU: gloo ignores NCCL settings). Timestamps are Unix seconds.
    ``environment`` is the ranks' environment as far as it matters
    (``fastverify.tune.server_env.recorded_environment``: every ``NCCL_*`` and each variable
    SGLang's start-up sets), whoever set it: the shell, the trial or SGLang's rules.
    """

    trial_id: str
    status: TrialStatus
    reason: str
    sizes: tuple[SizeResult, ...]
    step_us: float | None
    clock: Clock | None
    started_unix_s: float
    finished_unix_s: float
    note: str = ""
    worker_meta: tuple[tuple[str, Scalar], ...] = ()
    environment: tuple[tuple[str, str], ...] | Mapping[str, str] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "status", TrialStatus(self.status))
        object.__setattr__(self, "environment", tuple(sorted(dict(self.environment).items())))
        if self.clock is not None:
            object.__setattr__(self, "clock", Clock(self.clock))
        object.__setattr__(
            self, "sizes", tuple(s if isinstance(s, SizeResult) else SizeResult(**s) for s in self.sizes)
        )
        object.__setattr__(self, "worker_meta", tuple(sorted(dict(self.worker_meta).items())))
        if "\n" in self.reason:
            object.__setattr__(self, "reason", " ".join(self.reason.split()))

    @property
    def ok(self) -> bool:
        return self.status is TrialStatus.OK

    @property
    def norm(self) -> str | None:
        """The norm kernel the ranks used after plain all-reduces (``"flashinfer"``/``"torch"``),
        None where no rank got that far (failed before the build, or an older journal)."""
        value = dict(self.worker_meta).get("norm")
        return value if isinstance(value, str) else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "trial_id": self.trial_id,
            "status": self.status.value,
            "reason": self.reason,
            "sizes": [vars(s).copy() for s in self.sizes],
            "step_us": self.step_us,
            "clock": None if self.clock is None else self.clock.value,
            "started_unix_s": self.started_unix_s,
            "finished_unix_s": self.finished_unix_s,
            "note": self.note,
            "worker_meta": dict(self.worker_meta),
            "environment": dict(self.environment),
        }

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> TrialResult:
        return cls(**doc)


# --- which path a trial's backend took ------------------------------------------------------------------


class NotRankedStatus(StrEnum):
    """Why an ``ok`` trial is left out of the ranking (:func:`fastverify.tune.ranking.rank_candidates`)."""

    FELL_BACK = "fell_back"  # its path counts show calls off the backend's own path (:func:`fell_back`)
    UNVERIFIED = "unverified"  # no path counts to show it took its own path (an older journal)


PATH_COUNT_PREFIX = "path_count:"
"""``TrialResult.worker_meta`` keys ``path_count:<path>``: how many calls took each internal path
of the trial's backend (its ``path_counts``: build, warm-up, check and timed calls together), as
one rank counted them (:data:`PATH_COUNTS_RANK`)."""
PATH_COUNTS_RANK = "path_counts_rank"
"""``worker_meta`` key: the rank whose counts are recorded, the first that fell back, else 0."""
_FUSED_PATH = "fused"
_FUSED_OFF_PATHS = ("fallback", "unfused")
_PLAIN_PATHS = ("all_reduce", "fused_all_reduce")
_PLAIN_FALLBACK = "fallback_all_reduce"


def backend_paths(spec: TrialSpec, counts: Mapping[str, int]) -> tuple[str, int, int]:
    """``(own path, calls on it, calls of the timed operation)`` from a backend's ``path_counts``.

    The path names are the backends' own labels (``fastverify/backends``): a fused residual +
    RMSNorm backend timed on that operation must take ``"fused"``; its others are ``"fallback"``
    (``torch.distributed`` + norm) and the base class's ``"unfused"``. Any other trial counts
    plain all-reduces: ``"all_reduce"`` (``"fused_all_reduce"`` for the trtllm kernel), against
    ``"fallback_all_reduce"``. An unknown backend name counts as a plain backend.
    """
    try:
        fused = backend_info(spec.backend).role is Role.fused_norm
    except ValueError:
        fused = False
    if fused and spec.op is Op.ALL_REDUCE_RESIDUAL_RMSNORM:
        own = counts.get(_FUSED_PATH, 0)
        return _FUSED_PATH, own, own + sum(counts.get(k, 0) for k in _FUSED_OFF_PATHS)
    own_key = next((k for k in _PLAIN_PATHS if counts.get(k)), _PLAIN_PATHS[0])
    own = sum(counts.get(k, 0) for k in _PLAIN_PATHS)
    return own_key, own, own + counts.get(_PLAIN_FALLBACK, 0)


def fell_back(spec: TrialSpec, counts: Mapping[str, int]) -> str | None:
    """None when the trial's backend took its own path (:func:`backend_paths`) on every call it
    counted, else one line with the counts: ``fell back: fused 0 of 40 calls, fallback 40``.
    Every call of a size takes the same path, so this holds for the timed calls too."""
    own_key, own, total = backend_paths(spec, counts)
    if total and own == total:
        return None
    others = "".join(f", {k} {v}" for k, v in sorted(counts.items()) if k != own_key and v)
    return f"fell back: {own_key} {own} of {total} calls{others}"


def path_meta(spec: TrialSpec, docs: list[dict]) -> dict[str, int]:
    """The ``worker_meta`` entries of the ranks' path counts (:data:`PATH_COUNT_PREFIX`): those of
    the first rank that fell back, else rank 0's; nothing where a rank sent none (a skipped trial)."""
    per_rank = [d.get("meta", {}).get("path_counts") for d in docs]
    if not per_rank or not all(isinstance(c, dict) for c in per_rank):
        return {}
    rank = next((r for r, c in enumerate(per_rank) if fell_back(spec, c) is not None), 0)
    out = {PATH_COUNT_PREFIX + str(k): v for k, v in per_rank[rank].items()}
    out[PATH_COUNTS_RANK] = rank
    return out


def path_counts(result: TrialResult) -> dict[str, int] | None:
    """A result's path counts (:data:`PATH_COUNT_PREFIX` entries of ``worker_meta``); None where it
    has none (a trial that never ran its backend, or an older journal) or one is not a count >= 0."""
    counts = {k[len(PATH_COUNT_PREFIX) :]: v for k, v in result.worker_meta if k.startswith(PATH_COUNT_PREFIX)}
    if not counts or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in counts.values()):
        return None
    return counts
