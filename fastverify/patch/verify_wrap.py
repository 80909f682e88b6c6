"""The wrappers through which the in-rank patch times SGLang's verify forwards
(:class:`fastverify.patch.verify.VerifyTimer`) and reads how many draft tokens each request
accepted.

Wraps ``tp_worker.TpModelWorker.forward_batch_generation(..., is_verify=...)`` (SGLang 0.5.23):
the verify forwards outside a CUDA-graph capture are timed, with their load (:func:`verify_load`).

Accepted tokens (``accepted`` in a record): SGLang 0.5.23 computes each request's accept length
after the target's verify forward returns, in ``speculative/eagle_utils.py::eagle_sample`` (its
second result, ``accept_lens``: int32, shape ``(batch,)``, on the forward's device, the bonus
token included), called by ``speculative/eagle_worker_common.py::run_eagle_verify`` (EAGLE,
EAGLE-3, multi-layer EAGLE) and by ``speculative/ngram_worker.py::NGRAMWorker.forward_batch_generation``.
The patch wraps that name in both modules (:func:`_make_accept_wrapper`) and hands
``accept_lens`` to :meth:`VerifyTimer.accept`, which attaches it to the step just timed.
``accepted`` is the accepted DRAFT tokens per request, ``accept_lens - 1`` (the bonus token
excluded), so a chain's accept length is ``mean(accepted) + 1``.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

from fastverify.patch.paths import COUNTER
from fastverify.patch.rank import is_capturing as _is_capturing
from fastverify.patch.verify import VerifyTimer
from fastverify.patch.verify_trace import VerifyTrace

log = logging.getLogger("fastverify.patch")


_BATCH_ARGS = ("forward_batch", "model_worker_batch", "batch")
"""Parameters of ``forward_batch_generation`` that may hold the verify batch, in the order read:
SGLang 0.5.23's EAGLE verify passes ``batch=None, forward_batch=<ForwardBatch>``; earlier
releases passed a ``ModelWorkerBatch`` (first parameter)."""


def _int(value: Any) -> int | None:
    """``value`` when it is a plain ``int`` >= 0 (never a tensor: ``int(t)`` of a CUDA tensor
    would sync the host), else None."""
    return value if type(value) is int and value >= 0 else None


def _rows(tensor: Any) -> int | None:
    """Rows of a 1-D tensor from its ``shape`` (host metadata: no sync), else None."""
    shape = getattr(tensor, "shape", None)
    return _int(shape[0]) if shape is not None and len(shape) == 1 else None


def verify_load(fb: Any) -> tuple[int | None, int | None]:
    """``(batch, tokens)`` of a verify forward's batch object, each None where it cannot be read.

    Parameters
    ----------
    fb : ForwardBatch, ModelWorkerBatch, ScheduleBatch or anything
        ``batch`` is ``fb.batch_size`` (an int field of ``ForwardBatch``; called where it is a
        method, ``ScheduleBatch.batch_size()`` = ``len(reqs)``), else ``fb.seq_lens.shape[0]``;
        ``tokens`` is ``fb.input_ids.shape[0]`` (the flat draft tokens of the verify:
        batch × ``spec_info.draft_token_num``), else ``batch * fb.spec_info.draft_token_num``.

    Never reads a tensor's values (no ``.item()``, ``.tolist()``: no GPU sync) and never raises.
    """
    try:
        size = getattr(fb, "batch_size", None)
        batch = _int(size() if callable(size) else size)
        if batch is None:
            batch = _rows(getattr(fb, "seq_lens", None))
        tokens = _rows(getattr(fb, "input_ids", None))
        if tokens is None and batch is not None:
            per = _int(getattr(getattr(fb, "spec_info", None), "draft_token_num", None))
            tokens = batch * per if per is not None else None
        return batch, tokens
    except Exception:  # a record without its load, never a broken forward
        return None, None


def _make_verify_wrapper(original: Callable, timer: VerifyTimer, trace: VerifyTrace | None = None) -> Callable:
    sig = inspect.signature(original)
    names = list(sig.parameters)
    pos = names.index("is_verify") - 1 if "is_verify" in names else -1  # minus self
    batch_pos = [(n, names.index(n) - 1) for n in _BATCH_ARGS if n in names]

    def load_of(args: tuple, kwargs: dict) -> tuple[int | None, int | None]:
        for name, i in batch_pos:
            fb = kwargs[name] if name in kwargs else (args[i] if 0 <= i < len(args) else None)
            if fb is not None:
                return verify_load(fb)
        return None, None

    def forward_batch_generation(self, *args, **kwargs):
        if "is_verify" in kwargs:
            is_verify = kwargs["is_verify"]
        else:
            is_verify = 0 <= pos < len(args) and args[pos]
        if not is_verify or _is_capturing():
            return original(self, *args, **kwargs)
        batch, tokens = load_of(args, kwargs)  # before the forward, which may change the batch
        tracing = trace is not None and trace.active
        if tracing:
            trace.begin()
        start = timer.start()
        try:
            out = original(self, *args, **kwargs)
        finally:
            timer.stop(start, COUNTER.take(), batch=batch, tokens=tokens)
            if tracing:
                trace.end()
        return out

    return forward_batch_generation


def _make_accept_wrapper(original: Callable, timer: VerifyTimer) -> Callable:
    """Wrap SGLang's ``eagle_sample(verify_input, batch, logits_output, ...)`` (as bound in
    ``speculative/eagle_worker_common.py`` and ``speculative/ngram_worker.py``): its result is
    unchanged; its ``accept_lens`` (second item) goes to :meth:`VerifyTimer.accept`. Never raises
    into the server; a failed read leaves the record without ``accepted``."""

    def eagle_sample(*args, **kwargs):
        out = original(*args, **kwargs)
        if timer._awaiting is not None and not _is_capturing():
            try:
                timer.accept(out[1])
            except Exception as err:
                log.debug("fastverify patch: accepted tokens not read: %s: %s", type(err).__name__, err)
        return out

    return eagle_sample
