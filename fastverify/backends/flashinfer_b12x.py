"""FlashInfer 0.7.4's b12x one-shot PCIe all-reduce, fused with residual add + RMSNorm (SM120/121).

The only fused all-reduce + residual + RMSNorm a PCIe SM120 box (RTX PRO 6000) can run: the trtllm
kernel behind :mod:`fastverify.backends.flashinfer_fused` is reached by SGLang 0.5.23 only on
SM90/SM100. SGLang has no switch for b12x, so the patch calls this backend at the layer boundary's
add-norm (``fastverify.registry``: ``Reach.patch_add_norm``).

The library is ``flashinfer/experimental/b12x/`` of flashinfer-python 0.7.4, also importable as
top-level ``b12x`` (``b12x/__init__.py`` aliases it onto the same modules); the facts used are
noted at each name of the table below. Construction, ``prepare`` and ``close`` are collective, every
cross-rank step one round on a gloo CPU group (:class:`PreparationRounds`, at the end). The
all-reduce always happens: for a shape not prepared, above 36 rows, or after a failed preparation,
``all_reduce_residual_rmsnorm`` is ``all_reduce`` + the residual add + RMSNorm every backend's
unfused path uses (``base.residual_rmsnorm``), never the norm alone.
"""

from __future__ import annotations

import logging
import sys
import threading
from typing import Any, Sequence

import torch
import torch.distributed as dist

from fastverify.backends.base import (
    AllReduceBackend,
    BackendName,
    BackendUnavailable,
    Capability,
    ExternalCall,
    ProbeContext,
    Shape,
    Tensor,
    _check_norm_args,
    fail,
)
from fastverify.backends.ipc import (
    PACK_BYTES,
    element_size,
    flashinfer_status,
    ipc_requirements,
    new_gloo_group,
    torch_all_reduce,
    whole_packs,
)
from fastverify.registry import backend_info

logger = logging.getLogger(__name__)

INFO = backend_info(BackendName.b12x)
MIN_FLASHINFER = (0, 7, 4)  # the planned API below is the one read in 0.7.4
# Views of the registry entry, not facts of their own (the registry is the one source).
MAX_ROWS: int = INFO.max_rows or 0  # 36, from _oneshot_preparation.py
DTYPES = tuple(getattr(torch, name) for name in INFO.dtypes)

_B12X = "flashinfer.experimental.b12x"
_PCIE = f"{_B12X}.comm.pcie"
_ONESHOT = f"{_PCIE}.pcie_oneshot"
_ONESHOT_PREP = f"{_PCIE}._oneshot_preparation"
_PREP = f"{_B12X}.preparation"
_GATING = f"{_B12X}._lib.gating"

PLAIN_SURFACE = "OneshotAllReduce.all_reduce"
FUSED_SURFACE = "OneshotAllReduce.all_reduce_fused_add_rms_norm"

# Every FlashInfer name this module touches, with the keywords it passes (checked against the
# wheel's source by the signature test), and what this module relies on of each.
# Kernels are CuTe DSL, compiled at preparation: they need nvidia-cutlass-dsl >= MIN_CUTLASS_DSL (4.6.0).
HAS_CUTLASS_DSL = ExternalCall(_GATING, "has_cutlass_dsl", _GATING)
MIN_CUTLASS_DSL = ExternalCall(_GATING, "MIN_CUTLASS_DSL", _GATING, (), "attribute")
# comm/pcie/api.py: SM120/SM121 (_lib/gating.py is_b12x) and at least 2 visible CUDA devices.
IS_SUPPORTED = ExternalCall(_PCIE, "is_supported", f"{_PCIE}.api", ("device",))
# pcie_oneshot.py PCIeOneshotAllReduce (exported as OneshotAllReduce): world sizes
# SUPPORTED_WORLD_SIZES = 2/4/6/8/10, fp16/bf16/fp32, inputs of at most max_size bytes in whole
# 16-byte packs (should_allreduce). from_exchange_group is collective: it exchanges CUDA IPC
# handles on the group and raises on every rank together when any rank fails
# (_run_collective_preallocation_setup). close() is collective too (_coordinated_close_channels).
FROM_EXCHANGE_GROUP = ExternalCall(
    _PCIE,
    "OneshotAllReduce.from_exchange_group",
    _ONESHOT,
    ("exchange_group", "device", "eager_buffer_bytes", "max_size", "stream_affine"),
    "method",
)
RT_SHOULD_ALLREDUCE = ExternalCall(_PCIE, "OneshotAllReduce.should_allreduce", _ONESHOT, ("inp",), "method")
# all_reduce is out of place. The fused call writes residual_out = residual + all_reduce(inp) and
# out = RMSNorm(residual_out) * weight, returns (out, residual_out) and writes neither inp nor
# residual; out and residual_out must not alias; weight is (hidden,) in the input dtype; epsilon >= 0.
RT_ALL_REDUCE = ExternalCall(_PCIE, "OneshotAllReduce.all_reduce", _ONESHOT, ("inp", "plan", "out"), "method")
RT_FUSED = ExternalCall(
    _PCIE,
    "OneshotAllReduce.all_reduce_fused_add_rms_norm",
    _ONESHOT,
    ("inp", "residual", "weight", "epsilon", "plan", "out", "residual_out"),
    "method",
)
RT_CLOSE = ExternalCall(_PCIE, "OneshotAllReduce.close", _ONESHOT, (), "method")
# The planned API (comm/pcie/__init__.py, _preparation.py, _oneshot_preparation.py,
# preparation/session.py): query_from_runtime then plan declare one exact shape; the session's
# prepare compiles and primes it through the request's prepare_call(state), a collective launch
# (hence the CollectiveRequirement and the coordinator that authorizes it). An unprepared plan is
# prepared lazily outside capture and refused under CUDA-graph capture (session.py
# prepare_default); this backend never runs one: a shape it did not prepare takes torch.distributed.
# The fused surface refuses more than 36 rows (query_from_runtime / query_from_metadata: "fused
# allreduce RMSNorm supports at most 36 rows"; at most _MAX_BLOCKS = 36 CTAs, at least one per row).
QUERY_FROM_RUNTIME = ExternalCall(_PCIE, "query_from_runtime", f"{_PCIE}._preparation", ("runtime", "surface", "call"))
PLAN = ExternalCall(_PCIE, "plan", f"{_PCIE}._preparation", ("query", "runtime"))
PLAN_REQUEST = ExternalCall(_PREP, "Plan.request", f"{_PREP}.types", ("name", "prepare_call", "collective"), "method")
COLLECTIVE = ExternalCall(_PREP, "CollectiveRequirement", f"{_PREP}.types", ("key", "ranks"), "class")
SESSION = ExternalCall(
    _PREP,
    "PreparationSession",
    f"{_PREP}.session",
    ("device", "autotune", "compile_workers", "collective_barrier"),
    "class",
)
SESSION_PREPARE = ExternalCall(
    _PREP, "PreparationSession.prepare", f"{_PREP}.session", ("requests", "coordinator"), "method"
)
SESSION_CLOSE = ExternalCall(_PREP, "PreparationSession.close", f"{_PREP}.session", (), "method")
# The library's own prepare-call builders (bind the input, then the primed run): private names,
# pinned by the signature test like the public ones.
PREPARE_PLAIN_CALL = ExternalCall(_ONESHOT_PREP, "_prepare_plain_call", _ONESHOT_PREP, ("state", "inp", "out"))
PREPARE_FUSED_CALL = ExternalCall(
    _ONESHOT_PREP,
    "_prepare_fused_call",
    _ONESHOT_PREP,
    ("state", "inp", "residual", "weight", "out", "residual_out", "epsilon"),
)
# The plan's own per-run input rule (exact shape/stride/dtype/device of the prepared input).
CHECK_INPUT = ExternalCall(_ONESHOT_PREP, "_OneshotExecutionState._check_input", _ONESHOT_PREP, ("inp",), "method")
GATING_CALLS = (HAS_CUTLASS_DSL, MIN_CUTLASS_DSL)
EXTERNAL_CALLS = (
    *GATING_CALLS,
    IS_SUPPORTED,
    FROM_EXCHANGE_GROUP,
    RT_SHOULD_ALLREDUCE,
    RT_ALL_REDUCE,
    RT_FUSED,
    RT_CLOSE,
    QUERY_FROM_RUNTIME,
    PLAN,
    PLAN_REQUEST,
    COLLECTIVE,
    SESSION,
    SESSION_PREPARE,
    SESSION_CLOSE,
    PREPARE_PLAIN_CALL,
    PREPARE_FUSED_CALL,
    CHECK_INPUT,
)


def fused_fits(rows: int) -> bool:
    """Whether the b12x fused kernel takes ``rows`` tokens: ``1 <= rows <= MAX_ROWS`` (36). A
    verify step of batch x 4 draft tokens fits up to batch 9."""
    return 0 < rows <= MAX_ROWS


SM_WHY = "b12x kernels: flashinfer b12x is_supported"


def not_built_line(reason: str) -> str:
    """The one line every rank logs when b12x preparation failed on any rank."""
    return f"b12x not built: {reason}; all-reduces stay on NCCL"


def _describe(err: BaseException) -> str:
    """``Type: first line`` of the innermost cause (the library wraps a prime failure in
    ``"<request> failed to prepare with configuration ...: <error>"``, session.py ``_instantiate``)."""
    while err.__cause__ is not None:
        err = err.__cause__
    text = str(err).splitlines()[0] if str(err) else ""
    return f"{type(err).__name__}: {text}".rstrip(": ")


def plan_takes(plan: Any, x: Tensor) -> bool:
    """Whether prepared ``plan`` runs on ``x``, by the plan's own rule: its execution state's
    ``_check_input`` (``_oneshot_preparation.py``: ``(shape, stride, dtype, device index)`` equal
    to the prepared input's, else ``ValueError``), so a tensor it would refuse inside the forward
    takes the fallback instead. ``is_contiguous()`` is weaker (a ``(1, H)`` view with stride
    ``(2H, 1)`` passes it). A plan without a prepared state takes nothing."""
    prepared = getattr(plan, "prepared", None)
    state = getattr(prepared, "state", None)
    if state is None:
        return False
    try:
        state._check_input(**CHECK_INPUT.kwargs(inp=x))
    except ValueError:
        return False
    return True


class B12xFusedBackend(AllReduceBackend):
    """FlashInfer b12x one-shot all-reduce (+ residual + RMSNorm up to 36 rows); collective.

    Parameters are those of :class:`~fastverify.backends.base.AllReduceBackend`. The workspace
    (``max_size`` bytes of CUDA IPC eager buffers per rank) holds ``max_numel`` elements; without
    ``max_numel`` it holds ``MAX_ROWS * hidden``; with neither construction raises
    :class:`BackendUnavailable` before any collective call.

    Construction, :meth:`prepare` and :meth:`close` are collective: every rank calls them with the
    same arguments. Every vote is an exchange on a gloo CPU group
    (:func:`cpu_group_for`: SGLang's ``GroupCoordinator.cpu_group``
    in a worker), never on the NCCL ``group``: construction votes
    each rank's ``is_supported`` before FlashInfer's collective constructor (which exchanges IPC
    handles on ``group``), so every rank raises together.

    Options
    -------
    cpu_group : ProcessGroup
        gloo group over the ranks of ``group``; found or built when omitted (``cpu_group_for``).
    fused_only : bool
        Default False: :meth:`prepare` plans the plain all-reduce too (the ``tune`` and ``live``
        workers call :meth:`all_reduce`: above 36 rows, and where no residual follows). True:
        the fused kernel's plans only, for a caller that calls nothing else (the patch's add-norm
        slot), which would otherwise CuTe-compile every plain plan at start-up for nothing;
        :meth:`all_reduce` then always takes torch.distributed.

    Attributes
    ----------
    disabled_reason : str or None
        Set on every rank, to :func:`not_built_line`, when preparation failed on any rank; every
        call then takes the torch.distributed path.
    fused_only : bool
        The ``fused_only`` option.
    prepared_shapes : dict[str, set[tuple[int, int]]]
        ``{"plain": {...}, "fused": {...}}``: the ``(rows, hidden)`` shapes with a prepared plan.
    """

    name = BackendName.b12x
    option_names = frozenset({"cpu_group", "fused_only"})

    @classmethod
    def probe(cls, ctx: ProbeContext) -> Capability:
        bad = ipc_requirements(ctx, INFO, SM_WHY)
        if bad is not None:
            return bad
        gating = flashinfer_status(MIN_FLASHINFER, GATING_CALLS)
        if not gating.ok:
            return gating
        if not HAS_CUTLASS_DSL.resolve()():
            return fail(
                f"b12x compiles its kernels with CuTe DSL; pip install "
                f"'nvidia-cutlass-dsl>={MIN_CUTLASS_DSL.resolve()}'"
            )
        return flashinfer_status(MIN_FLASHINFER, EXTERNAL_CALLS)

    def _setup(self) -> None:
        """Size the workspace, vote ``is_supported`` on the CPU group, then build FlashInfer's
        runtime (collective).

        Raises
        ------
        BackendUnavailable
            Neither ``max_numel`` nor ``hidden``, no usable CPU group, a rank that refuses, or a
            failed FlashInfer setup (every rank raises together).
        """
        group, max_numel, hidden = self.group, self.max_numel, self.hidden
        self._closed = True  # until the runtime exists: nothing collective to close
        if max_numel is None and hidden is None:
            raise BackendUnavailable(self.name, "needs max_numel or hidden to size its IPC workspace")
        numel = max_numel if max_numel is not None else MAX_ROWS * int(hidden)  # type: ignore[arg-type]
        self.max_bytes = whole_packs(numel * element_size(self.dtype))
        self.world_size = dist.get_world_size(group)
        ranks = tuple(sorted(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)))
        self.disabled_reason: str | None = None
        self.fused_only = bool(self.options.get("fused_only", False))
        self.prepared_shapes: dict[str, set[tuple[int, int]]] = {"plain": set(), "fused": set()}
        self._plans: dict[tuple[str, tuple[int, int]], Any] = {}
        try:
            cpu_group, owned = cpu_group_for(group, self.options.get("cpu_group"))
        except ValueError as err:
            raise BackendUnavailable(self.name, str(err)) from err
        self._rounds = PreparationRounds(cpu_group, owned, self.world_size, ranks)
        self._query = QUERY_FROM_RUNTIME.resolve()
        self._plan = PLAN.resolve()
        self._collective = COLLECTIVE.resolve()
        self._prepare_plain = PREPARE_PLAIN_CALL.resolve()
        self._prepare_fused = PREPARE_FUSED_CALL.resolve()
        self._is_supported = IS_SUPPORTED.resolve()
        self._vote_supported()
        self._runtime = self._open_runtime()
        self._closed = False

    def _vote_supported(self) -> None:
        """Every rank's ``is_supported`` (and its local session), voted on the CPU group first:
        FlashInfer's constructor is collective, so a rank that would refuse must not leave the
        others waiting in it. Raises :class:`BackendUnavailable` on every rank when any refuses."""
        local = ""
        try:
            if not self._is_supported(**IS_SUPPORTED.kwargs(device=self.device)):
                local = "is_supported() is False (needs SM120/SM121 and >= 2 visible GPUs)"
            else:  # the session is local: it compiles in this process
                self._session = SESSION.resolve()(
                    **SESSION.kwargs(
                        device=self.device, autotune=False, compile_workers=0, collective_barrier=self._rounds.barrier
                    )
                )
        except Exception as err:
            local = _describe(err)
        bad = [f"rank {r}: {why}" for r, why in enumerate(self._rounds.exchange(local)) if why]
        if bad:
            self._rounds.release()
            raise BackendUnavailable(self.name, "; ".join(bad))

    def _open_runtime(self) -> Any:
        """FlashInfer's ``OneshotAllReduce`` over the group (collective; FlashInfer exchanges every
        rank's setup failure first, so it raises on every rank together).

        ``stream_affine=False``: the default binds the channel to the first CUDA stream that uses
        it and raises on any other, and fastverify warms graphs up on a side stream ordered by
        ``wait_stream`` (:mod:`fastverify.cudagraph`); calls never overlap on two streams."""
        try:
            return FROM_EXCHANGE_GROUP.resolve()(
                **FROM_EXCHANGE_GROUP.kwargs(
                    exchange_group=self.group if self.group is not None else dist.group.WORLD,
                    device=self.device,
                    eager_buffer_bytes=self.max_bytes,
                    max_size=self.max_bytes,
                    stream_affine=False,
                )
            )
        except Exception as err:
            self._rounds.release()
            text = str(err).splitlines()[0] if str(err) else ""
            raise BackendUnavailable(self.name, f"OneshotAllReduce setup failed: {type(err).__name__}: {text}") from err

    @property
    def cpu_group(self) -> Any:
        """The gloo group the rounds run on (None once closed)."""
        return self._rounds.cpu_group

    @property
    def barrier_calls(self) -> list[tuple[str, tuple[int, ...]]]:
        """``(key, ranks)`` of every call the library's barrier hook got."""
        return self._rounds.barrier_calls

    # -- preparation ----------------------------------------------------------------------------

    def _wanted(self, shapes: Sequence[Shape]) -> list[tuple[str, tuple[int, int]]]:
        """The ``(kind, shape)`` plans to prepare: every 2-D shape of this hidden size within
        ``max_bytes`` in whole 16-byte packs (``pcie_oneshot.py`` ``should_allreduce``), plain
        unless ``fused_only``, fused where :func:`fused_fits`; none already prepared."""
        itemsize = element_size(self.dtype)
        wanted = []
        for shape in sorted({tuple(int(d) for d in s) for s in shapes if len(s) == 2}):
            rows, hidden = shape
            nbytes = rows * hidden * itemsize
            if rows <= 0 or (self.hidden is not None and hidden != self.hidden):
                continue
            if nbytes > self.max_bytes or nbytes % PACK_BYTES:
                continue
            if not self.fused_only:
                wanted.append(("plain", shape))
            if fused_fits(rows) and hidden * itemsize % PACK_BYTES == 0:
                wanted.append(("fused", shape))
        return [w for w in wanted if w[1] not in self.prepared_shapes[w[0]]]

    def _request(self, kind: str, shape: tuple[int, int]) -> tuple[Any, Any]:
        """``(plan, request)`` for one ``(kind, shape)``: the plan of the exact shape and the
        session request whose ``prepare_call`` binds the input with the library's own builder
        (``_prepare_plain_call`` / ``_prepare_fused_call``), then votes before the launch."""
        name = self._rounds.step = f"fastverify.b12x.{kind}.{shape[0]}x{shape[1]}"
        x = torch.zeros(shape, dtype=self.dtype, device=self.device)
        surface = FUSED_SURFACE if kind == "fused" else PLAIN_SURFACE
        query = self._query(**QUERY_FROM_RUNTIME.kwargs(runtime=self._runtime, surface=surface, call={"inp": x}))
        plan = self._plan(**PLAN.kwargs(query=query, runtime=self._runtime))
        out = torch.empty_like(x)
        if kind == "fused":
            residual, residual_out = torch.zeros_like(x), torch.empty_like(x)
            weight = torch.ones(shape[1], dtype=self.dtype, device=self.device)

            def bind(state: Any) -> Any:
                return self._prepare_fused(
                    **PREPARE_FUSED_CALL.kwargs(
                        state=state,
                        inp=x,
                        residual=residual,
                        weight=weight,
                        out=out,
                        residual_out=residual_out,
                        epsilon=1e-6,
                    )
                )
        else:

            def bind(state: Any) -> Any:
                return self._prepare_plain(**PREPARE_PLAIN_CALL.kwargs(state=state, inp=x, out=out))

        def prepare_call(state: Any) -> Any:
            # Called after this rank compiled (_materialize) and before the priming launch
            # (_prime): the last point at which a failing rank can still stop every rank.
            call = bind(state)
            self._rounds.round(("bound", name))
            return call

        collective = self._collective(**COLLECTIVE.kwargs(key=name, ranks=self._rounds.ranks))
        return plan, plan.request(**PLAN_REQUEST.kwargs(name=name, prepare_call=prepare_call, collective=collective))

    def prepare(self, shapes: Sequence[Shape]) -> None:
        """Plan, compile and prime a b12x plan for every shape in ``shapes`` that fits: the plain
        all-reduce up to ``max_numel`` (not with ``fused_only``), the fused kernel up to 36 rows.
        Collective; must run before CUDA-graph capture (raises ``RuntimeError`` under capture, as
        FlashInfer would).
        A failure on any rank disables b12x on every rank (``disabled_reason``, one logged line
        per rank, ``b12x not built: <why>; all-reduces stay on NCCL``) before any rank launches
        the failing request's kernel; nothing raises."""
        if self._closed or self.disabled_reason is not None:
            return
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("b12x preparation must complete before CUDA-graph capture (prepare() earlier)")
        rounds = self._rounds
        rounds.start()
        plans: dict[tuple[str, tuple[int, int]], Any] = {}
        try:
            try:
                requests = []
                for kind, shape in self._wanted(shapes):
                    plan, request = self._request(kind, shape)
                    plans[(kind, shape)] = plan
                    requests.append(request)
                if requests:
                    self._session.prepare(**SESSION_PREPARE.kwargs(requests=requests, coordinator=rounds.coordinate))
            except Exception as err:
                rounds.fail(_describe(err))
            rounds.round(("done",))
        except RoundsEnded:
            self.disabled_reason = not_built_line(rounds.ended or "preparation rounds ended")
            logger.warning("%s", self.disabled_reason)
            return
        self._plans.update(plans)
        for kind, shape in plans:
            self.prepared_shapes[kind].add(shape)

    # -- per call ---------------------------------------------------------------------------------

    def _ready(self, kind: str, x: Tensor) -> Any:
        """The prepared plan for ``x``, else None: a plan of ``x``'s shape whose own input rule
        takes ``x`` (:func:`plan_takes`: exact shape, stride, dtype and device of the prepared
        input) and which the runtime takes (``should_allreduce``)."""
        if self._closed or self.disabled_reason is not None or not super().supports(x):
            return None
        plan = self._plans.get((kind, tuple(x.shape)))
        if (
            plan is None
            or not plan_takes(plan, x)
            or not self._runtime.should_allreduce(**RT_SHOULD_ALLREDUCE.kwargs(inp=x))
        ):
            return None
        return plan

    def supports(self, x: Tensor) -> bool:
        """True for a shape :meth:`prepare` planned a b12x kernel for: the plain one, or with
        ``fused_only`` the fused one (whose only caller asks this before the fused call). A
        chain sends every other shape, and every shape after a failed preparation, on."""
        return self._ready("fused" if self.fused_only else "plain", x) is not None

    def all_reduce(self, x: Tensor) -> Tensor:
        """Sum over the group, out of place: b12x for a prepared shape, torch.distributed else."""
        plan = self._ready("plain", x)
        if plan is None:
            self.path_counts["fallback_all_reduce"] += 1
            return torch_all_reduce(x, self.group)
        out = torch.empty_like(x)
        self._runtime.all_reduce(**RT_ALL_REDUCE.kwargs(inp=x, plan=plan, out=out))
        self.path_counts["all_reduce"] += 1
        return out

    def all_reduce_residual_rmsnorm(
        self, x: Tensor, residual: Tensor, weight: Tensor, eps: float
    ) -> tuple[Tensor, Tensor]:
        """The fused kernel for a prepared shape of at most 36 rows; otherwise :meth:`all_reduce`
        + :meth:`residual_rmsnorm` (the all-reduce always happens). See the base class for shapes.
        ``residual`` is never written, on either path."""
        _check_norm_args(x, residual, weight)
        plan = self._ready("fused", x) if fused_fits(x.shape[0]) else None
        if plan is None:
            self.path_counts["fallback"] += 1
            return self._residual_rmsnorm_copy(self.all_reduce(x), residual, weight, eps)
        out, residual_out = torch.empty_like(x), torch.empty_like(x)
        self._runtime.all_reduce_fused_add_rms_norm(
            **RT_FUSED.kwargs(
                inp=x,
                residual=residual.contiguous(),
                weight=weight.contiguous(),
                epsilon=float(eps),
                plan=plan,
                out=out,
                residual_out=residual_out,
            )
        )
        self.path_counts["fused"] += 1
        return out, residual_out

    # -- lifetime -----------------------------------------------------------------------------------

    def _release(self) -> None:
        """Release the prepared plans, then close the IPC channel (collective: every rank)."""
        try:
            self._plans.clear()
            self._session.close(**SESSION_CLOSE.kwargs())
        finally:
            try:
                self._runtime.close(**RT_CLOSE.kwargs())
            finally:
                # Drop the runtime and groups (the runtime holds the process group): a group
                # object outliving destroy_process_group aborts the process at exit.
                self._runtime = self._session = None
                self._rounds.release()


# The b12x preparation's cross-rank agreement: one exchange round per step on a gloo CPU group.
#
# FlashInfer 0.7.4's ``PreparationSession`` (``flashinfer/experimental/b12x/preparation/session.py``)
# with autotune off (``_warmup_only``) authorizes each request (``yield item.collective`` ->
# ``coordinator``), runs the embedder's ``collective_barrier`` hook (``PreparationJob._collective_barrier``:
# a daemon thread, bounded by ``B12X_COLLECTIVE_BARRIER_TIMEOUT``, 120 s), and only then compiles the
# plan (``_instantiate(..., compile_directly=True)``: ``_materialize``), binds it (``prepare_call(state)``)
# and launches it (``_prime``). A compile that fails on one rank after its peers launched leaves them
# spinning in the priming kernel; so every cross-rank step (the construction vote, the coordinator,
# the barrier hook, a vote after the bind and before the launch, the final "done") is one round of
# :class:`PreparationRounds` on SGLang's gloo CPU group (``GroupCoordinator.cpu_group``,
# ``sglang/srt/distributed/parallel_state.py``), never on the NCCL device group, and a failing rank's
# next round is its ``("fail", why)``: every rank stops at the same round, before any launch of that
# request.

MOD_PARALLEL_STATE = "sglang.srt.distributed.parallel_state"  # _groups: unique_name -> weakref(GroupCoordinator)


def _backend_of(group: Any) -> str:
    return str(dist.get_backend(group)).lower()


def sglang_cpu_group(group: Any) -> Any:
    """The ``cpu_group`` (gloo) of the SGLang ``GroupCoordinator`` whose ``device_group`` is
    ``group``, found in ``parallel_state._groups`` (name -> weakref, ``_register_group``; SGLang
    0.5.23 ``sglang/srt/distributed/parallel_state.py``); None outside an SGLang worker."""
    groups = getattr(sys.modules.get(MOD_PARALLEL_STATE), "_groups", None)
    if not isinstance(groups, dict):
        return None
    for ref in list(groups.values()):
        coordinator = ref() if callable(ref) else None
        if coordinator is not None and getattr(coordinator, "device_group", None) is group:
            return getattr(coordinator, "cpu_group", None)
    return None


def cpu_group_for(group: Any, option: Any) -> tuple[Any, bool]:
    """``(gloo group over the ranks of group, owned)``: the ``cpu_group`` option, else SGLang's
    coordinator's, else ``group`` itself when it is gloo, else a new gloo group when ``group``
    spans the default group (``new_group`` is collective over it). Decided from facts every rank
    shares, so every rank takes the same branch. Raises ``ValueError`` when none fits."""
    world = group if group is not None else dist.group.WORLD
    cpu = option if option is not None else sglang_cpu_group(world)
    if cpu is not None:
        if _backend_of(cpu) != "gloo":
            raise ValueError(f"the CPU group must be gloo, got {_backend_of(cpu)}")
        return cpu, False
    if _backend_of(world) == "gloo":
        return world, False
    subgroup = "no gloo CPU group for this subgroup: pass options={'cpu_group': <gloo group>}"
    return new_gloo_group(world, subgroup), True


class RoundsEnded(Exception):
    """Every rank saw the same failed exchange round; no rank sends another message."""


class PreparationRounds:
    """The exchange rounds of one backend on ``cpu_group``, a gloo group over ``ranks``.

    Parameters
    ----------
    cpu_group : ProcessGroup
        gloo, over the ranks of the backend's group (:func:`cpu_group_for`).
    owned : bool
        Whether it was built for these rounds: :meth:`release` destroys it then.
    world_size : int
        Ranks in the group. ranks : tuple[int, ...] : their global ranks, sorted.

    Attributes
    ----------
    ended : str or None
        Why the rounds since :meth:`start` ended, the same on every rank; None while they run.
    step : str or None
        The request being planned or authorized, named in a failure.
    barrier_calls : list[tuple[str, tuple[int, ...]]]
        ``(key, ranks)`` of every call the library's barrier hook got.
    """

    def __init__(self, cpu_group: Any, owned: bool, world_size: int, ranks: tuple[int, ...]) -> None:
        self.cpu_group = cpu_group
        self.world_size = world_size
        self.ranks = ranks
        self.ended: str | None = None
        self.step: str | None = None
        self.barrier_calls: list[tuple[str, tuple[int, ...]]] = []
        self._owned = owned
        self._lock = threading.Lock()  # the barrier hook's round runs on a library thread

    def start(self) -> None:
        """Begin the rounds of one preparation."""
        self.ended = self.step = None

    def exchange(self, message: Any) -> list[Any]:
        """All-gather one picklable object per rank on the CPU group; every rank gets the same list."""
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, message, group=self.cpu_group)
        return out

    def round(self, message: tuple) -> None:
        """One round of the preparation protocol: every rank sends one message. Unless all are
        the same ``(step, key)`` / ``("done",)``, every rank records the same reason in ``ended``
        and raises :class:`RoundsEnded`, so every rank stops sending at the same round. Once the
        rounds ended (on any thread) it sends nothing and raises again."""
        with self._lock:  # the barrier thread's round and a main-thread round never overlap
            if self.ended is None:
                got = self.exchange(message)
                if message[0] != "fail" and all(m == message for m in got):
                    return
                fails = [f"rank {r}: {m[1]}" for r, m in enumerate(got) if m[0] == "fail"]
                self.ended = "; ".join(fails) if fails else f"ranks disagree on the preparation step: {got}"
            raise RoundsEnded(self.ended)

    def fail(self, why: str) -> None:
        """This rank's local failure, told the others in the round they are in (nothing is sent
        when the rounds already ended, e.g. in the barrier hook). Always raises :class:`RoundsEnded`."""
        self.round(("fail", f"{self.step}: {why}" if self.step else why))

    def coordinate(self, progress: Any) -> str | None:
        """``PreparationSession.prepare``'s coordinator: authorize a collective (priming) launch
        once every rank reached the same one; returns its key. Nothing to authorize: None, no
        communication (ranks reach this a different number of times while compiling)."""
        if getattr(progress, "ready_tuning", ()) or getattr(progress, "ready_cache", None) is not None:
            raise RuntimeError("b12x asked for a tuning agreement with autotune=False")
        ready = tuple(progress.ready_collectives)
        if not ready:
            return None
        key = self.step = ready[0].key
        self.round(("key", key))
        return key

    def barrier(self, key: str, ranks: tuple[int, ...]) -> None:
        """The session's ``collective_barrier(key, ranks)`` hook (session.py
        ``PreparationJob._collective_barrier``, on its daemon thread): one round on the CPU group
        after the authorization and before this request compiles and launches."""
        self.barrier_calls.append((key, tuple(ranks)))
        if tuple(ranks) != self.ranks:
            raise ValueError(f"collective {key!r} is over ranks {tuple(ranks)}, this group is {self.ranks}")
        self.round(("barrier", key))

    def release(self) -> None:
        """Drop the CPU group, destroying it when it was built here (every rank does, at the same
        point): a group object outliving ``destroy_process_group`` aborts the process at exit."""
        cpu, self.cpu_group = self.cpu_group, None
        if self._owned and cpu is not None:
            self._owned = False
            dist.destroy_process_group(cpu)
