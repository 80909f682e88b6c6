"""All-reduce backends behind one interface (:class:`AllReduceBackend`), for ``tune`` and the
SGLang patch. Importing this package imports torch but no GPU library: each backend module
imports FlashInfer/SGLang only inside its probe and constructor.
"""

from fastverify.backends.base import (
    REGISTRY,
    TOLERANCE,
    AllReduceBackend,
    BackendName,
    BackendUnavailable,
    Capability,
    ProbeContext,
    add_rmsnorm,
    backend_class,
    check_close,
    make_backend,
    probe,
    reference_residual_rmsnorm,
    result_tolerance,
)

__all__ = [
    "REGISTRY",
    "TOLERANCE",
    "AllReduceBackend",
    "BackendName",
    "BackendUnavailable",
    "Capability",
    "ProbeContext",
    "add_rmsnorm",
    "backend_class",
    "check_close",
    "make_backend",
    "probe",
    "reference_residual_rmsnorm",
    "result_tolerance",
]
