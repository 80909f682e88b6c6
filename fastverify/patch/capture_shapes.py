"""What the in-rank patch reads of SGLang's model runner before CUDA-graph capture: the decode
batch sizes SGLang will capture, the rows each takes, and the runner's hidden size, device and dtype.
Names as in SGLang 0.5.23 (``srt/runtime_context.py``, ``srt/model_executor/model_runner.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fastverify.patch import rank as R
from fastverify.patch.targets import MOD_RUNTIME_CONTEXT


@dataclass
class Probe:
    """What a factory reads of the first tensor (``shape[-1]``, ``device``, ``dtype``), without
    allocating one."""

    shape: tuple[int, ...]
    device: Any
    dtype: Any
    is_cuda: bool = True


def capture_batch_sizes(runner: Any, modules: Mapping[str, Any] | None) -> list[int]:
    """The decode batch sizes SGLang will capture, as far as they can be read before it does
    (0.5.23: ``get_exec().graph.cuda_graph_config.decode.bs``, clamped to the request pool as
    ``get_batch_sizes_to_capture`` does; older: ``server_args.cuda_graph_bs`` / ``cuda_graph_max_bs``)."""
    bs: list[int] = []
    try:
        bs = [int(b) for b in (R.module(MOD_RUNTIME_CONTEXT, modules).get_exec().graph.cuda_graph_config.decode.bs or [])]
    except Exception:
        bs = []
    if not bs:
        sa = getattr(runner, "server_args", None)
        got = getattr(sa, "cuda_graph_bs", None)
        if got:
            bs = [int(b) for b in got]
        elif isinstance(getattr(sa, "cuda_graph_max_bs", None), int):
            bs = [int(sa.cuda_graph_max_bs)]
    pool = getattr(getattr(runner, "req_to_token_pool", None), "size", None)
    if bs and isinstance(pool, int) and pool > 0:
        bs = [b for b in bs if b <= pool] + ([pool] if max(bs) > pool else [])
    return sorted({b for b in bs if b > 0})


def tokens_per_request(runner: Any) -> int:
    """Rows a request takes in one decode/verify step: the runner's ``decode_num_tokens_per_req()``
    (SGLang 0.5.23: the draft tokens in speculative decoding), else 1."""
    try:
        fn = getattr(runner, "decode_num_tokens_per_req", None)
        return max(1, int(fn())) if callable(fn) else 1
    except Exception:
        return 1


def capture_rows(runner: Any, modules: Mapping[str, Any] | None) -> list[int]:
    """Rows of every captured decode/verify batch: batch size × tokens per request."""
    width = tokens_per_request(runner)
    return sorted({b * width for b in capture_batch_sizes(runner, modules)})


def covers(runner: Any, modules: Mapping[str, Any] | None) -> str:
    """What the captured graphs cover, from SGLang's own config in this rank:
    ``verify steps up to 48 requests x 6 tokens (288 rows)``, or that every step runs eagerly."""
    bs = capture_batch_sizes(runner, modules)
    width = tokens_per_request(runner)
    what = "verify steps" if width > 1 else "decode steps"
    if not bs:
        return f"{what} eager (no decode CUDA graph captured), {width} tokens a request"
    return f"{what} up to {max(bs)} requests x {width} tokens ({max(bs) * width} rows) in CUDA graphs"


def max_rows(runner: Any, modules: Mapping[str, Any] | None, record: Any) -> int | None:
    """The widest verify all-reduce (rows): ``record``'s ``max_batch × draft_tokens`` (a
    :class:`~fastverify.deploy.DeploymentRecord`, or None), else SGLang's widest captured decode;
    None when neither is known."""
    if record is not None:
        return record.shapes.max_rows
    rows = capture_rows(runner, modules)
    return rows[-1] if rows else None


def runner_probe(runner: Any) -> tuple[int, Any, Any]:
    """(hidden, device, dtype) of the target model runner."""
    hidden = int(runner.model_config.hidden_size)
    dtype = getattr(runner, "dtype", None)
    device: Any = getattr(runner, "device", "cuda")
    try:
        import torch

        if torch.cuda.is_available() and str(device).startswith("cuda"):
            device = torch.device("cuda", torch.cuda.current_device())
        elif str(device) == "cuda" and isinstance(getattr(runner, "gpu_id", None), int):
            device = f"cuda:{runner.gpu_id}"
    except Exception:
        pass
    return hidden, device, dtype
