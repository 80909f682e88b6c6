"""The SGLang functions the in-rank patch may wrap (names and parameters as in SGLang 0.5.23), and
the mechanics of wrapping them.

Each target is found by feature detection and checked with :mod:`inspect` before it is wrapped;
``fastverify patch --check`` applies the same rule to the source with :mod:`ast`
(:func:`fastverify.patch.sglang_info.check`). A target is a method (``cls`` set: the function in the class
``__dict__`` is replaced) or a module-level function (``cls`` None: the module attribute is
replaced, so it must be wrapped before SGLang binds it -- the layer boundary's fusions are bound
into each stage when the model is built). What :mod:`fastverify.patch.install` does with each is
said under its constant below.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

MOD_PARALLEL_STATE = "sglang.srt.distributed.parallel_state"
MOD_DISTRIBUTED = "sglang.srt.distributed"
MOD_LAYERNORM = "sglang.srt.layers.layernorm"
MOD_MOE_UTILS = "sglang.srt.layers.moe.utils"
MOD_TP_WORKER = "sglang.srt.managers.tp_worker"
MOD_MODEL_RUNNER = "sglang.srt.model_executor.model_runner"
MOD_RUNTIME_CONTEXT = "sglang.srt.runtime_context"
MOD_AR_FUSIONS = "sglang.srt.layers.layer_boundary.fusions.allreduce"
MOD_DECODE_GRAPHS = "sglang.srt.model_executor.runner.decode_cuda_graph_runner"
MOD_EAGLE_COMMON = "sglang.srt.speculative.eagle_worker_common"
MOD_NGRAM_WORKER = "sglang.srt.speculative.ngram_worker"
MOD_PYNCCL = "sglang.srt.distributed.device_communicators.pynccl"
MOD_GRAPH_BACKEND = "sglang.srt.model_executor.runner_backend.base_cuda_graph_backend"
GRAPH_BACKEND_MODULES = tuple(
    f"sglang.srt.model_executor.runner_backend.{m}_cuda_graph_backend" for m in ("full", "breakable", "tc_piecewise")
)
"""SGLang 0.5.23's graph backends (``runner_backend/``): imported at install so their classes exist
when the subclasses of ``BaseCudaGraphBackend`` are walked (an out-of-tree platform's, defined
later, are found by the walk before capture)."""


@dataclass(frozen=True)
class Target:
    """One thing the patch may wrap: ``module.cls.attr`` (or the module-level function
    ``module.attr`` when ``cls`` is None) whose parameters start with ``params`` (and contain
    ``needs``, positional or keyword-only)."""

    key: str
    module: str
    cls: str | None
    attr: str
    params: tuple[str, ...]
    needs: tuple[str, ...] = ()

    @property
    def where(self) -> str:
        """``module.Class.attr`` or ``module.attr``."""
        return ".".join(p for p in (self.module, self.cls, self.attr) if p)


TARGET_ALL_REDUCE = Target("all_reduce", MOD_PARALLEL_STATE, "GroupCoordinator", "all_reduce", ("self", "input_"))
"""Wrapped only for ``pcie_ipc`` on an SGLang without its own PCIe IPC all-reduce (``pcie_ipc_ar.py``);
where SGLang has it, ``launch`` sets ``SGLANG_ENABLE_PCIE_IPC_ALLREDUCE`` and the dispatch is left alone."""
TARGET_FUSED_NORM = Target(
    "fused_norm",
    MOD_LAYERNORM,
    "RMSNorm",
    "forward_with_allreduce_fusion",
    ("self", "x", "residual", "post_residual_addition", "use_attn_tp_group"),
)
"""Replaced for ``fused``. SGLang 0.5.23 calls it only where ``flashinfer_ar_fusion_applies`` holds
(``layer_boundary/residual/add_norm.py``: SM90/SM100 ...); in the rank, once the config is published,
that real rule decides whether ``fused_norm`` is reported applied or skipped
(:func:`fastverify.patch.rank.fused_norm_reach`). The replacement ALWAYS all-reduces: the fused backend
when it takes the tensor, else the group's plain all-reduce followed by the norm. It returns a fresh
residual, as SGLang's FlashInfer wrapper does. The first fused result is compared with the plain path
on every rank and the outcome voted on the CPU group."""
TARGET_VERIFY = Target(
    "verify_timer",
    MOD_TP_WORKER,
    "TpModelWorker",
    "forward_batch_generation",
    ("self", "batch", "forward_batch"),
    needs=("is_verify",),
)
"""Wrapped for ``--profile-verify DIR`` (:func:`fastverify.patch.install.make_verify_wrapper`)."""
TARGET_PRE_CAPTURE = Target(
    "pre_capture", MOD_MODEL_RUNNER, "ModelRunner", "init_cuda_graphs", ("self", "capture_decode_cuda_graph")
)
"""Wrapped whenever the patch is active: every TP rank's ``Scheduler.init_all_cuda_graphs`` calls it once
per model runner, after the process groups exist and the config is published, also with
``--disable-cuda-graph`` and on CPU. Before the original runs (target runner, once) the wrapper builds
each slot's backend from SGLang's real TP ``GroupCoordinator``, sized from the record, prepares it for
the capture shapes, votes on every step, and prints the rank's one line (``fastverify patch [TP r]: ...``)
to stderr."""
# The layer boundary's fused reduce + residual add + RMSNorm candidates (fusions/allreduce.py,
# 0.5.23). ``ffn_input_fusions`` / ``attn_input_fusions`` bind them with ``partial`` into every
# stage at model construction, and ``prepare.py`` ``_reduce_update_read`` / ``_run_entry`` call them
# on EVERY GPU before their own all-reduce + norm (they return None where their kernel does not
# apply, e.g. on SM120), so wrapping them reaches the boundary where SGLang's own gated method
# (RMSNorm.forward_with_allreduce_fusion) is never called.
TARGET_ADD_NORM_FFN = Target(
    "add_norm_ffn", MOD_AR_FUSIONS, None, "fused_ffn_input", ("plan", "hidden_states", "residual", "forward_batch")
)
TARGET_ADD_NORM_ATTN = Target(
    "add_norm_attn",
    MOD_AR_FUSIONS,
    None,
    "fused_attn_input",
    ("plan", "owed", "residual", "forward_batch", "post_residual_addition"),
    needs=("fuses_quant", "keep_bf16"),
)
"""With :data:`TARGET_ADD_NORM_FFN`: replaced (module attributes) for ``b12x``, which SGLang 0.5.23 has
no switch for; on SM120 SGLang's own ones return None (``flashinfer_ar_fusion_applies`` is False
there), so the boundary's all-reduce + norm runs. The replacement first offers the tensor to the b12x
slot: only when the rank step found the boundary reached here (:func:`fastverify.patch.rank.add_norm_reach`:
SM120/SM121, SGLang's own fusion not applying), the backend was built, prepared and its first result
checked on every rank (voted), the rows are 1..36 (registry ``max_rows``, FlashInfer
``_oneshot_preparation.py``), the norm is exactly SGLang's ``RMSNorm`` with default numerics and a
weight in the input's dtype, the owed sum is over the TP group (the backend's group), no post-residual
addition and no fused quant. Then b12x does the all-reduce + add + norm and returns a fresh residual
(``flashinfer_preserves_residual`` is False on SM120: SGLang does not rely on it being kept).
Otherwise SGLang's own candidate runs unchanged, so the all-reduce always happens, above 36 rows
included. The decision reads only facts that are the same on every TP rank, so all ranks take the
same path."""
# What the path counts read (fastverify/patch/counting.py): the method SGLang's dispatch runs, the
# forward mode, and the CUDA graphs captured and replayed.
TARGET_OUT_PLACE = Target(
    "count_out_place",
    MOD_PARALLEL_STATE,
    "GroupCoordinator",
    "_all_reduce_out_place",
    ("self", "input_", "outplace_all_reduce_method"),
)
TARGET_IN_PLACE = Target(
    "count_in_place", MOD_PARALLEL_STATE, "GroupCoordinator", "_all_reduce_in_place", ("self", "input_")
)
TARGET_FLASHINFER_AR = Target(
    "count_flashinfer", MOD_PARALLEL_STATE, "GroupCoordinator", "_flashinfer_allreduce", ("self", "input_")
)
TARGET_PYNCCL_AR = Target("count_pynccl", MOD_PYNCCL, "PyNcclCommunicator", "all_reduce", ("self", "tensor"))
TARGET_FORWARD = Target("count_mode", MOD_MODEL_RUNNER, "ModelRunner", "forward", ("self", "forward_batch"))
TARGET_CAPTURE_SHAPE = Target(
    "count_capture", MOD_GRAPH_BACKEND, "BaseCudaGraphBackend", "capture_one", ("self", "shape_key", "forward_fn")
)
TARGET_REPLAY = Target(
    "count_replay", MOD_GRAPH_BACKEND, "BaseCudaGraphBackend", "replay", ("self", "shape_key", "static_forward_batch")
)
"""With :data:`TARGET_CAPTURE_SHAPE`: abstract on the base; wrapped BY RULE on every subclass that
defines it (:func:`wrap_subclasses`), so every graph runner (decode, prefill, EAGLE draft and
draft-extend, and any later one) is counted through the backend it captures and replays with."""
SUBCLASS_TARGETS = (TARGET_CAPTURE_SHAPE, TARGET_REPLAY)
UNCOUNTED = {
    "sglang.srt.model_executor.cpu_graph_runner.CPUGraphRunner": "the CPU graph runner: its forwards' all-reduces take the CPU path, counted as they run",
    "sglang.srt.multimodal.*ViTCudaGraphRunner": "vision-encoder graphs: the ViT tower, not a language-model "
    "forward; its all-reduces are outside the verify/draft/extend modes counted",
    "sglang.srt.model_executor.runner.row_bucket_graph_runner.RowBucketGraphRunner": "graphs of per-row bookkeeping kernels, no all-reduce captured",
    "sglang.srt.model_executor.runner.metadata_glue_graph.MetadataGlueGraph": "graphs of attention-metadata preparation, no all-reduce captured",
    "sglang.srt.model_executor.runner_utils.deepep_adapter.DeepEPCudaGraphRunnerAdapter": "DeepEP buffer-mode bookkeeping around a capture/replay, not a graph of its own",
    "sglang.srt.model_executor.runner.base_cuda_graph_runner.BaseCudaGraphRunner": "abstract: its capture / capture_one_shape / execute are declared only; every subclass captures "
    "and replays through its backend",
    "sglang.srt.model_executor.runner_backend.cuda_graph_dedup_mixin": "deduplicated graph segments "
    "replayed inside a backend's replay, which is counted",
    "sglang.srt.model_executor.runner_backend_utils": "graph segment containers (breakable graph, dedup) "
    "replayed inside a backend's replay, which is counted",
    "sglang.srt.hardware_backend": "NPU/XPU graph runners and backends: not CUDA; their backends subclass "
    "BaseCudaGraphBackend and are wrapped by rule where present",
    "runner.capture / execute / replay": "runner-level methods that capture or replay only through "
    "self.backend.capture_one / self.backend.replay, which are counted (multi-step EAGLE runners' "
    "replay(step) included)",
    "sglang.srt.model_executor.runner.eager_runner.EagerRunner": "no graph: execute runs the forward eagerly, its all-reduces counted as they run",
    "sglang.srt.model_executor.runner.base_runner.BaseRunner": "the runners' common base: warm-up and workspace set-up, no capture or replay of its own",
    "sglang.srt.distributed.device_communicators.custom_all_reduce.CustomAllreduce": "capture() registers the graph's buffers; its all-reduce is reached through _all_reduce_out_place, "
    "which is counted",
    "sglang.srt.distributed.device_communicators.custom_all_reduce_v2.CustomAllReduceV2": "capture() registers the graph's buffers; its all-reduce is reached through _all_reduce_out_place, "
    "which is counted",
    "sglang.srt.layers.aux_hidden_states.AuxHiddenStatePacker": "captures EAGLE-3 auxiliary hidden states, not a CUDA graph",
    "sglang.srt.state_capturer.": "capture routed-expert / top-k state for replay to the user, not CUDA graphs",
    "PyNcclCommunicator.all_reduce outside GroupCoordinator.all_reduce": "PyNccl's own warm-up at construction and non-TP users: not a tensor-parallel all-reduce",
    "GroupCoordinator._all_reduce_out_place -> *_comm.all_reduce / outplace_all_reduce": "the communicator a counted method picked; the method names the path",
}
"""Entry points deliberately NOT wrapped, with why: SGLang's classes that capture or replay, and its
all-reduce call sites, are each either wrapped or named here (a test walks SGLang's source for
any other)."""
# Where the verify's per-request accept lengths are computed (:func:`fastverify.patch.install.make_accept_wrapper`): SGLang's
# ``eagle_utils.eagle_sample``, as each verifying worker module binds it by name (module globals are
# looked up at call time, so wrapping the name there reaches every call). Not in TARGETS: ``patch
# --check`` looks for definitions, and these modules import the function.
_SAMPLE_PARAMS = ("verify_input", "batch", "logits_output")
TARGET_ACCEPT_EAGLE = Target("accept_eagle", MOD_EAGLE_COMMON, None, "eagle_sample", _SAMPLE_PARAMS)
TARGET_ACCEPT_NGRAM = Target("accept_ngram", MOD_NGRAM_WORKER, None, "eagle_sample", _SAMPLE_PARAMS)
ACCEPT_TARGETS = (TARGET_ACCEPT_EAGLE, TARGET_ACCEPT_NGRAM)
COUNT_TARGETS = (
    TARGET_OUT_PLACE,
    TARGET_IN_PLACE,
    TARGET_FLASHINFER_AR,
    TARGET_PYNCCL_AR,
    TARGET_FORWARD,
    TARGET_CAPTURE_SHAPE,
    TARGET_REPLAY,
)
TARGETS = (
    TARGET_ALL_REDUCE,
    TARGET_FUSED_NORM,
    TARGET_VERIFY,
    TARGET_PRE_CAPTURE,
    TARGET_ADD_NORM_FFN,
    TARGET_ADD_NORM_ATTN,
    *COUNT_TARGETS,
)

installed_targets: list[tuple[Any, str, Any]] = []
"""(owner -- a class or a module --, attr, original) of every wrapped target, in install order."""


def check_signature(fn: Any, target: Target) -> str | None:
    """None when ``fn`` looks like the target, else what differs (one phrase)."""
    if not callable(fn):
        return "not callable"
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return "signature cannot be read"
    names = [p.name for p in sig.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if tuple(names[: len(target.params)]) != target.params:
        return f"parameters ({', '.join(names)}) do not start with ({', '.join(target.params)})"
    for n in target.needs:
        if n not in sig.parameters:
            return f"has no parameter {n!r}"
    return None


def resolve(target: Target, modules: Mapping[str, Any] | None) -> tuple[Any, Any, str | None]:
    """(owner, function in its ``__dict__``, None) or (None, None, why it cannot be found). The owner
    is the class, or the module itself for a module-level target (``cls`` None)."""
    try:
        mod = modules[target.module] if modules is not None else importlib.import_module(target.module)
    except KeyError:
        return None, None, f"module {target.module} not given"
    except Exception as err:
        return None, None, f"cannot import {target.module} ({type(err).__name__}: {err})"
    if target.cls is None:
        fn = vars(mod).get(target.attr)
        if fn is None:
            return None, None, f"{target.module} defines no {target.attr}"
        return mod, fn, None
    cls = getattr(mod, target.cls, None)
    if not isinstance(cls, type):
        return None, None, f"{target.module} has no class {target.cls}"
    fn = cls.__dict__.get(target.attr)
    if fn is None:
        return None, None, f"{target.cls} defines no {target.attr}"
    return cls, fn, None


def wrap(cls: Any, attr: str, make: Callable[[Any], Any]) -> bool:
    """Replace ``cls.attr`` (a class or a module attribute) by ``make(original)``; False when it is
    already ours (idempotent)."""
    current = cls.__dict__[attr]
    if getattr(current, "__fastverify_original__", None) is not None:
        return False
    new = functools.wraps(current)(make(current))
    new.__fastverify_original__ = current
    setattr(cls, attr, new)
    installed_targets.append((cls, attr, current))
    return True


def subclasses(base: type) -> list[type]:
    """Every subclass of ``base`` now defined (depth first, each once)."""
    out: list[type] = []
    todo = list(type.__subclasses__(base))
    while todo:
        c = todo.pop(0)
        if c not in out:
            out.append(c)
            todo.extend(type.__subclasses__(c))
    return out


def wrap_subclasses(
    target: Target, modules: Mapping[str, Any] | None, make: Callable[[Any], Any]
) -> tuple[list[str], str | None]:
    """Wrap ``target.attr`` on every subclass of ``target.cls`` that defines it itself and whose
    signature matches (a subclass overriding without ``super()`` is its own path; the wrappers
    count once per outermost call, so one calling ``super()`` is not counted twice). Returns
    (``Class`` names newly wrapped, why none could be)."""
    try:
        mod = modules[target.module] if modules is not None else importlib.import_module(target.module)
    except Exception as err:
        return [], f"cannot import {target.module} ({type(err).__name__}: {err})"
    base = getattr(mod, target.cls or "", None)
    if not isinstance(base, type):
        return [], f"{target.module} has no class {target.cls}"
    done = []
    for c in subclasses(base):
        fn = c.__dict__.get(target.attr)
        if fn is None or getattr(fn, "__isabstractmethod__", False) or check_signature(fn, target) is not None:
            continue
        if wrap(c, target.attr, make):
            done.append(c.__name__)
    return done, None


def unwrap_all() -> int:
    """Restore every original (latest first); returns how many."""
    n = 0
    while installed_targets:
        cls, attr, original = installed_targets.pop()
        setattr(cls, attr, original)
        n += 1
    return n
