"""The all-reduce backend registry: every fact about a backend that more than one stage needs.

``tune`` (which trials to build), ``launch`` (what to refuse on a box), the in-rank patch (which
slot to fill and how to size it), ``doctor`` and the signature tests all iterate :data:`BACKENDS`.
Backend names appear here and nowhere else in the product; every other module spells a backend
as ``BackendName.x`` or reads it from a record. Adding a backend means: its module under
``fastverify/backends/``, one :class:`BackendInfo` entry here, and its tests.

This module imports neither torch nor any GPU library, so the launcher and the trace analyzer can
read it for free.

Sources of the facts (read in the released packages):

* FlashInfer 0.7.4 ``flashinfer/comm/pcie_ipc_ar.py``: PCIe IPC all-reduce, world sizes 2/4/8,
  bf16/fp16 kernels, no architecture limit (plain PTX loads/stores), CUDA IPC needs P2P between
  every pair.
* FlashInfer 0.7.4 ``flashinfer/comm/trtllm_ar.py`` / ``flashinfer/jit/comm.py``: the fused
  all-reduce + residual + RMSNorm (``trtllm_comm``) is built for SM majors 9, 10, 12 only.
* SGLang 0.5.23 ``sglang/srt/layers/layer_boundary/residual/add_norm.py``
  (``flashinfer_ar_fusion_applies``): SGLang calls ``RMSNorm.forward_with_allreduce_fusion`` only on
  SM90 or SM100 (``get_platform().is_sm90 / is_sm100``, ``sglang/srt/utils/common.py``), so the
  trtllm kernel is reachable from SGLang on those majors only, whatever the kernel supports.
* FlashInfer 0.7.4 ``flashinfer/experimental/b12x/comm/pcie/`` (``_oneshot_preparation.py``): the
  b12x one-shot all-reduce + residual + RMSNorm runs on SM120/SM121 only, at most 36 rows.
* SGLang 0.5.23 ``sglang/srt/distributed/device_communicators/pcie_ipc_ar.py``: switched on by
  ``SGLANG_ENABLE_PCIE_IPC_ALLREDUCE``, workspace bound ``SGLANG_PCIE_IPC_MAX_NUMEL`` elements.
  SGLang builds that workspace with ``dtype=torch.bfloat16`` and ``should_pcie_ipc_ar`` returns
  False when ``inp.dtype is not torch.bfloat16``: pcie_ipc reaches SGLang only through that switch,
  so on an fp16 model it is a no-op there, and the registry admits bf16 only (FlashInfer's fp16
  kernel is never what SGLang runs).
* SGLang 0.5.23 ``sglang/srt/distributed/device_communicators/custom_all_reduce.py``
  (``CustomAllreduce._SUPPORTED_WORLD_SIZES = [2, 4, 6, 8]``) and ``custom_all_reduce_utils.py``
  (``can_use_custom_all_reduce_with_nvlink``: ``if world_size > 2 and not full_nvlink:`` it logs
  "disabled because it's not supported on more than two PCIe-only GPUs" and returns None, which
  the constructor reads as "stay disabled"; ``full_nvlink`` from ``is_full_nvlink``:
  ``nvmlDeviceGetP2PStatus(..., NVML_P2P_CAPS_INDEX_NVLINK)`` OK for every pair, False when NVML
  cannot tell). The JIT ``CustomAllReduceV2`` that ``dispatch_custom_allreduce`` prefers on CUDA
  calls the same function and is admitted only when it returns ``True`` (``custom_all_reduce_v2.py``
  ``can_use_custom_all_reduce_v2``), so neither class runs on more than 2 PCIe-only GPUs: SGLang's
  custom all-reduce runs on 2 PCIe GPUs, or on 4/6/8 fully NVLinked. The entry's
  ``world_sizes_without_nvlink = (2,)`` keeps it gated off there (unknown NVLink counts as none),
  so ``tune`` never measures or recommends it on such a box: fastverify's worker builds the class
  itself and could time a kernel SGLang will never call in the server, and a deployment of it
  would silently run NCCL.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum


class BackendName(StrEnum):
    """All-reduce backends fastverify knows. The value is the one spelling used everywhere: CLI
    flags, env vars, records, journals."""

    nccl = "nccl"  # torch.distributed on an NCCL group
    gloo = "gloo"  # torch.distributed on a gloo group (CPU; tests and GPU-less sweeps)
    pcie_ipc = "pcie_ipc"  # flashinfer.comm.PcieIpcAllReduceWorkspace
    fused = "fused"  # flashinfer.comm allreduce_fusion (trtllm kernel), residual + RMSNorm pattern
    b12x = "b12x"  # flashinfer.experimental.b12x one-shot all-reduce + residual + RMSNorm (SM120)
    custom_ar = "custom_ar"  # SGLang's custom all-reduce (2 PCIe GPUs or full NVLink)


class Role(StrEnum):
    """What a backend replaces in the verify forward."""

    baseline = "baseline"  # torch.distributed: supports every shape, the end of every chain
    all_reduce = "all_reduce"  # the plain tensor-parallel all-reduce
    fused_norm = "fused_norm"  # all-reduce + residual add + RMSNorm in one kernel


class Reach(StrEnum):
    """How a backend gets into a running SGLang server."""

    native = "native"  # SGLang's own default path (NCCL)
    sglang_switch = "sglang_switch"  # SGLang has the code; an env var turns it on
    patch_fused_norm = "patch_fused_norm"  # fastverify replaces RMSNorm.forward_with_allreduce_fusion
    patch_add_norm = "patch_add_norm"  # fastverify wraps the layer boundary's residual add + RMSNorm
    patch_dispatch = "patch_dispatch"  # fastverify routes GroupCoordinator.all_reduce
    none = "none"  # not deployable into SGLang (CPU stand-in, or SGLang already owns it)


LOSSLESS_TOLERANCE: dict[str, float] = {
    "bfloat16": 4 * 2.0**-7,  # 0.03125
    "float16": 4 * 2.0**-10,  # 0.00391
    "float32": 1e-5,
    "float64": 1e-12,
}
"""Normwise relative tolerance of a lossless all-reduce's result per torch dtype name:
``max|got - want| / max|want|`` must not exceed it. Normwise, not elementwise: a near-zero element
produced by cancellation has no meaningful elementwise relative error. The bound is 4 machine
epsilons (bf16 2**-7, fp16 2**-10), enough for an 8-rank reduction in a different order plus the
rounding of the inputs and of the output, and still far below the error of a dropped rank
(~1/sqrt(world_size)) or a skipped all-reduce (~1). fp32 gets 1e-5 because different summation
orders of thousands of terms exceed 4 eps (4.8e-7). A lossy backend derives its own
(:attr:`BackendInfo.tolerance`)."""


@dataclass(frozen=True)
class KernelPattern:
    """A GPU kernel-name rule of one backend, read by trace classification
    (:data:`fastverify.trace.classify.RULES`).

    ``pattern`` is a regex searched in the event name; ``event`` the
    :class:`fastverify.events.EventClass` value it means (``"allreduce"``, ``"fused_allreduce"``,
    ``"other_comm"``); ``family`` names the implementation; ``source`` where the name was seen.
    """

    pattern: str
    event: str
    family: str
    source: str


@dataclass(frozen=True)
class JitModule:
    """A FlashInfer JIT module a backend needs, built ahead by ``doctor``
    (:mod:`fastverify.doctor.jit`): ``function()`` of module ``module`` returns its ``JitSpec``;
    ``label`` names it in reports."""

    label: str
    module: str
    function: str


@dataclass(frozen=True)
class BackendInfo:
    """One backend's facts.

    Attributes
    ----------
    name : BackendName
    module, qualname : str
        Where the :class:`fastverify.backends.AllReduceBackend` subclass lives (imported lazily).
    role : Role
    reach : Reach
        How SGLang gets it (see :class:`Reach`).
    device : str
        ``"cuda"`` or ``"cpu"``: where its tensors must live.
    kernel_sm_majors : tuple[int, ...] or None
        GPU compute-capability majors the kernel itself runs on; None: any CUDA GPU.
    kernel_sm : tuple[tuple[int, int], ...] or None
        Exact (major, minor) pairs, where the rule is stricter than the major (b12x: SM120/121).
    sglang_sm_majors : tuple[int, ...] or None
        Majors on which SGLang calls the code path the patch replaces; None: every major.
    needs_p2p : bool
        CUDA peer access between every GPU pair is required; such kernels spin without timeouts,
        so an unproven P2P status counts as "no".
    world_sizes : tuple[int, ...] or None
        Tensor-parallel sizes the kernels dispatch; None: any.
    world_sizes_without_nvlink : tuple[int, ...] or None
        The subset of ``world_sizes`` that runs without full NVLink (every GPU pair on NVLink);
        the others need it. None: NVLink is never needed.
    nvlink_gate : str
        The source of ``world_sizes_without_nvlink`` (for error messages).
    dtypes : tuple[str, ...]
        torch dtype names (``"bfloat16"``) it takes, where SGLang runs it (stricter than the kernel
        where SGLang is: pcie_ipc).
    dtype_gate : str
        The source of a ``dtypes`` limit (for error messages); empty: the kernel's own.
    max_rows : int or None
        Most rows (tokens) per call; larger calls fall back to all-reduce + norm.
    sglang_switch : str or None
        Env var that turns SGLang's own copy on (``Reach.sglang_switch``).
    sglang_switch_module : str or None
        SGLang module whose presence means the switch exists.
    size_env : str or None
        Env var through which SGLang sizes the workspace, in elements.
    tunable : bool
        ``tune`` measures it on GPUs.
    title : str
        What it is, in words, for advice lines (``"FlashInfer PCIe IPC all-reduce"``).
    tolerance : callable or None
        ``tolerance(dtype, world_size)`` → the normwise relative tolerance of its result (dtype a
        torch dtype name), for a lossy (quantized) backend; None: lossless,
        :data:`LOSSLESS_TOLERANCE` of the dtype.
    wire_bytes : float or None
        Bytes each element puts on the wire (scales included, averaged per element) where that
        differs from the element's own size (a quantized backend); None: the element size.
    kernel_patterns : tuple[KernelPattern, ...]
        The names of its GPU kernels, as trace classification reads them (in this order, after
        NCCL's and before the other families).
    sglang_methods : tuple[str, ...]
        SGLang's own names for it in ``GroupCoordinator``'s dispatch (SGLang 0.5.23
        ``distributed/parallel_state.py``: ``"pcie_ipc"``, ``"ca"``, ``"pynccl"``), read by the
        patch's path counts (:data:`fastverify.patch.paths.SGLANG_TO_REGISTRY`).
    sglang_switch_label : str
        The switch's name in ``fastverify patch --check`` and launch reports (``sglang_switch``'s
        module is looked for on disk).
    jit_modules : tuple[JitModule, ...]
        FlashInfer JIT modules its kernels need, built ahead by ``doctor``; the entry's kernel SM
        gate applies to them.
    """

    name: BackendName
    module: str
    qualname: str
    role: Role
    reach: Reach
    device: str = "cuda"
    kernel_sm_majors: tuple[int, ...] | None = None
    kernel_sm: tuple[tuple[int, int], ...] | None = None
    sglang_sm_majors: tuple[int, ...] | None = None
    needs_p2p: bool = False
    world_sizes: tuple[int, ...] | None = None
    world_sizes_without_nvlink: tuple[int, ...] | None = None
    nvlink_gate: str = ""
    dtypes: tuple[str, ...] = ("bfloat16", "float16", "float32")
    max_rows: int | None = None
    sglang_switch: str | None = None
    sglang_switch_module: str | None = None
    size_env: str | None = None
    tunable: bool = False
    title: str = ""
    dtype_gate: str = ""
    tolerance: Callable[[str, int], float] | None = None
    wire_bytes: float | None = None
    kernel_patterns: tuple[KernelPattern, ...] = ()
    sglang_methods: tuple[str, ...] = ()
    sglang_switch_label: str = ""
    jit_modules: tuple[JitModule, ...] = ()

    @property
    def deployable(self) -> bool:
        """Whether ``launch`` can put it into an SGLang server at all."""
        return self.reach is not Reach.none

    def kernel_runs_on(self, sm: tuple[int, int]) -> bool:
        """Whether the kernel runs on compute capability ``sm`` = (major, minor)."""
        if self.kernel_sm is not None and tuple(sm) not in self.kernel_sm:
            return False
        return self.kernel_sm_majors is None or sm[0] in self.kernel_sm_majors


BACKENDS: tuple[BackendInfo, ...] = (
    # Preference order when nothing was measured: the IPC kernel first (the PCIe box is the target:
    # 5-15 us vs ~200 us NCCL at 12-96 KiB, SGLang pcie_ipc_ar.py docstring), the fused kernels next
    # (b12x only where it runs, trtllm measured 10x slower on the wrong fabric), SGLang's custom
    # all-reduce, and torch.distributed last as the backend that supports every shape.
    BackendInfo(
        BackendName.pcie_ipc,
        "fastverify.backends.flashinfer_pcie_ipc",
        "PcieIpcBackend",
        Role.all_reduce,
        Reach.sglang_switch,
        needs_p2p=True,
        world_sizes=(2, 4, 8),
        title="FlashInfer PCIe IPC all-reduce",
        dtypes=("bfloat16",),
        sglang_switch="SGLANG_ENABLE_PCIE_IPC_ALLREDUCE",
        sglang_switch_module="sglang.srt.distributed.device_communicators.pcie_ipc_ar",
        size_env="SGLANG_PCIE_IPC_MAX_NUMEL",
        tunable=True,
        dtype_gate=(
            "SGLang 0.5.23 builds its PCIe IPC workspace in bfloat16 and sends it bfloat16 only "
            "(should_pcie_ipc_ar, distributed/device_communicators/pcie_ipc_ar.py)"
        ),
        kernel_patterns=(
            KernelPattern(
                r"(?i)pcie_?ipc.*(all_?gather|reduce_?scatter)",
                "other_comm",
                "flashinfer_pcie_ipc",
                "flashinfer PcieIpcAllGatherWorkspace / PcieIpcReduceScatterWorkspace",
            ),
            KernelPattern(
                r"(?i)pcie_?ipc",
                "allreduce",
                "flashinfer_pcie_ipc",
                "flashinfer include/flashinfer/comm/pcie_ipc_all_reduce.cuh: flashinfer::comm::pcie_ipc::"
                "push_oneshot_param_kernel, ipc_rsag_push_param_kernel, ipc_rsag_ring_push_param_kernel, "
                "ipc_tp2_remote_push_kernel, ipc_topo_rsag8_* (PR #4393)",
            ),
        ),
        sglang_methods=("pcie_ipc",),
        sglang_switch_label="PCIe IPC all-reduce",
        jit_modules=(JitModule("pcie_ipc_comm", "flashinfer.jit.comm", "gen_pcie_ipc_comm_module"),),
    ),
    BackendInfo(
        BackendName.b12x,
        "fastverify.backends.flashinfer_b12x",
        "B12xFusedBackend",
        Role.fused_norm,
        Reach.patch_add_norm,
        kernel_sm=((12, 0), (12, 1)),
        kernel_sm_majors=(12,),
        title="FlashInfer b12x one-shot all-reduce + RMSNorm",
        needs_p2p=True,
        world_sizes=(2, 4, 6, 8, 10),
        dtypes=("bfloat16", "float16", "float32"),
        max_rows=36,
        tunable=True,
    ),
    BackendInfo(
        BackendName.fused,
        "fastverify.backends.flashinfer_fused",
        "FusedBackend",
        Role.fused_norm,
        Reach.patch_fused_norm,
        kernel_sm_majors=(9, 10, 12),
        # SGLang 0.5.23 calls RMSNorm.forward_with_allreduce_fusion only on SM90/SM100
        # (flashinfer_ar_fusion_applies, layers/layer_boundary/residual/add_norm.py)
        sglang_sm_majors=(9, 10),
        title="FlashInfer fused all-reduce + RMSNorm",
        needs_p2p=True,
        world_sizes=(2, 4, 8, 16),
        tunable=True,
        kernel_patterns=(
            KernelPattern(
                r"(moereduce_|moefinalize_)?allreduce_fusion_kernel|oneshotAllreduceFusionKernel"
                r"|(lamport_style_)?one_shot_all_reduce_norm_kernel|allreduce_fusion_",
                "fused_allreduce",
                "flashinfer_trtllm_fused",
                "flashinfer include/flashinfer/comm/trtllm_allreduce_fusion.cuh, trtllm_mnnvl_allreduce.cuh",
            ),
        ),
        jit_modules=(JitModule("trtllm_comm", "flashinfer.jit.comm", "gen_trtllm_comm_module"),),
    ),
    BackendInfo(
        BackendName.custom_ar,
        "fastverify.backends.sglang_custom_ar",
        "SglangCustomArBackend",
        Role.all_reduce,
        Reach.native,
        needs_p2p=True,
        world_sizes=(2, 4, 6, 8),
        world_sizes_without_nvlink=(2,),
        title="SGLang custom all-reduce",
        nvlink_gate=(
            "SGLang 0.5.23 runs it on 2 PCIe GPUs, on more only with full NVLink "
            "(custom_all_reduce_utils.py can_use_custom_all_reduce_with_nvlink: disabled when "
            "world_size > 2 and not full_nvlink)"
        ),
        dtypes=("bfloat16", "float16", "float32"),
        tunable=True,
        kernel_patterns=(
            KernelPattern(
                r"cross_device_reduce_(1|2)stage",
                "allreduce",
                "custom_ar",
                "vllm csrc/custom_all_reduce.cuh; sglang sgl-kernel/csrc/allreduce/custom_all_reduce.cuh",
            ),
        ),
        sglang_methods=("ca",),
    ),
    # NCCL's kernel names stay in fastverify.trace.classify: their order against the expert-parallel
    # all-to-all rules decides, and NCCL kernels run for more than this backend.
    BackendInfo(
        BackendName.nccl,
        "fastverify.backends.torch_dist",
        "NcclBackend",
        Role.baseline,
        Reach.native,
        sglang_methods=("pynccl", "pynccl_symm_mem", "nccl"),
    ),
    BackendInfo(
        BackendName.gloo,
        "fastverify.backends.torch_dist",
        "GlooBackend",
        Role.baseline,
        Reach.none,
        device="cpu",
        sglang_methods=("gloo",),
    ),
)

_BY_NAME = {b.name: b for b in BACKENDS}


def backend_info(name: BackendName | str) -> BackendInfo:
    """The registry entry for ``name``.

    Raises
    ------
    ValueError
        For a name not in the registry; the message lists the known names.
    """
    try:
        return _BY_NAME[BackendName(name)]
    except ValueError:
        raise ValueError(
            f"unknown all-reduce backend {name!r}; known: {', '.join(b.value for b in BackendName)}"
        ) from None


def names(
    *, role: Role | None = None, tunable: bool | None = None, deployable: bool | None = None, device: str | None = None
) -> tuple[BackendName, ...]:
    """Registry names in preference order, filtered by the given facts."""
    return tuple(
        b.name
        for b in BACKENDS
        if (role is None or b.role is role)
        and (tunable is None or b.tunable is tunable)
        and (deployable is None or b.deployable is deployable)
        and (device is None or b.device == device)
    )


def sm_text(sm: tuple[int, int] | None) -> str:
    """``(12, 0)`` → ``"SM120"``."""
    return "SM unknown" if sm is None else f"SM{sm[0]}{sm[1]}"


def dtype_reason(info: BackendInfo, dtype: str) -> str | None:
    """Why ``info`` cannot run on ``dtype`` (a torch dtype name, ``"float16"``), in one line
    starting with its name, naming the source of the limit; None when ``dtype`` is in ``dtypes``."""
    if dtype in info.dtypes:
        return None
    why = f": {info.dtype_gate}" if info.dtype_gate else ""
    return f"{info.name.value}: dtype {dtype} unsupported (takes {', '.join(info.dtypes)}{why})"


def unreachable_reason(
    info: BackendInfo,
    *,
    sm: tuple[int, int] | None,
    world_size: int | None,
    p2p_ok: bool | None,
    p2p_source: str = "",
    sglang_version: str | None = None,
    nvlink_full: bool | None = None,
    dtype: str | None = None,
) -> str | None:
    """Why ``info`` cannot run inside SGLang on this box, in one line starting with its name; None
    when nothing known stops it. Facts left None are unknown: an unknown SM or P2P status blocks a
    backend that depends on it (a guess could hang or crash every TP rank).

    Parameters
    ----------
    sm : (major, minor) or None
        Compute capability of the box's GPUs.
    world_size : int or None
        Tensor-parallel size.
    p2p_ok : bool or None
        P2P between every GPU pair proven (True), refuted (False), not checked (None).
    p2p_source : str
        How ``p2p_ok`` was obtained (named in the message).
    sglang_version : str or None
        Installed SGLang version (named in the message).
    nvlink_full : bool or None
        Every pair of the ``world_size`` GPUs on NVLink (True), not (False, a PCIe box), unknown
        (None). Only read for a backend with ``world_sizes_without_nvlink``.
    dtype : str or None
        torch dtype name of the model's all-reduced tensors (``"bfloat16"``); one outside
        ``info.dtypes`` is refused (:func:`dtype_reason`). None: unknown, not checked.
    """
    sg = f"SGLang {sglang_version}" if sglang_version else "SGLang"
    n = info.name.value
    if not info.deployable:
        return f"{n}: not deployable into an SGLang server ({info.device} stand-in)"
    if dtype is not None and (why := dtype_reason(info, dtype)) is not None:
        return why
    if info.device == "cuda" and sm is None:
        return f"{n}: needs a CUDA GPU and this box's compute capability is unknown"
    # SGLang's gate first: where SGLang never calls the code path, the kernel's own range is moot.
    if sm is not None and info.sglang_sm_majors is not None and sm[0] not in info.sglang_sm_majors:
        majors = "/".join(f"SM{m}0" for m in info.sglang_sm_majors)
        return f"{n}: {sg} calls it only on {majors}; this box is {sm_text(sm)}"
    if sm is not None and not info.kernel_runs_on(sm):
        want = (
            ", ".join(sm_text(s) for s in info.kernel_sm)
            if info.kernel_sm
            else "/".join(f"SM{m}x" for m in info.kernel_sm_majors or ())
        )
        return f"{n}: the kernel runs only on {want}; this box is {sm_text(sm)}"
    if world_size is not None and info.world_sizes is not None and world_size not in info.world_sizes:
        return f"{n}: world size {world_size} unsupported (kernel dispatches {list(info.world_sizes)})"
    if (
        world_size is not None
        and info.world_sizes_without_nvlink is not None
        and world_size not in info.world_sizes_without_nvlink
        and nvlink_full is not True
    ):
        state = "this box has none" if nvlink_full is False else "this box's NVLink status is unknown"
        return f"{n}: world size {world_size} needs full NVLink between every GPU pair and {state}; {info.nvlink_gate}"
    if info.needs_p2p and p2p_ok is not True:
        how = f" ({p2p_source})" if p2p_source else ""
        state = "fails" if p2p_ok is False else "is not proven"
        return (
            f"{n}: needs P2P between every GPU pair and it {state} on this box{how}; run `fastverify p2p` or use nccl"
        )
    # An SGLang without the backend's own switch module (``sglang_has_switch`` False) is not a
    # refusal: the in-rank patch routes GroupCoordinator.all_reduce itself (Reach.patch_dispatch).
    return None
