"""The settings every all-reduce backend is built with, written once.

:class:`BackendSettings` is the one record of a backend's construction arguments besides its process
group; :class:`~fastverify.backends.base.AllReduceBackend` and
:func:`~fastverify.backends.base.make_backend` take it, or its fields as keywords
(:meth:`BackendSettings.of`), so a backend class declares only the options that differ.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

import torch


@dataclass(frozen=True, kw_only=True)
class BackendSettings:
    """How a backend is built: device, element type, sizes, backend-specific options.

    Parameters
    ----------
    device : torch.device or str
        This rank's device; inputs must live there. Stored as a :class:`torch.device`.
    dtype : torch.dtype
        Element type of the inputs (bf16/fp16 for the GPU kernels).
    max_numel : int or None
        Largest ``x.numel()`` (elements) the backend must handle; sizes IPC workspaces. None:
        unbounded (only backends without a workspace accept it). Required: no default.
    hidden : int or None
        Hidden size (elements, the last dimension of every input), where the caller knows it: the
        fused backends size their workspaces in rows of it. None: not known.
    options : Mapping[str, Any] or None
        Backend-specific settings, checked by the backend class (unknown keys raise
        ``ValueError`` there). Every backend also takes ``norm``
        (:data:`fastverify.backends.base.NORM_OPTION`). Stored as a read-only copy.

    Raises
    ------
    ValueError
        ``max_numel`` or ``hidden`` is not a positive int or None.
    """

    device: torch.device
    dtype: torch.dtype
    max_numel: int | None
    hidden: int | None = None
    options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        max_numel, hidden = self.max_numel, self.hidden
        if max_numel is not None and (not isinstance(max_numel, int) or max_numel <= 0):
            raise ValueError(f"max_numel must be a positive int or None, got {max_numel!r}")
        if hidden is not None and (not isinstance(hidden, int) or isinstance(hidden, bool) or hidden <= 0):
            raise ValueError(f"hidden must be a positive int or None, got {hidden!r}")
        object.__setattr__(self, "device", torch.device(self.device))
        object.__setattr__(self, "options", MappingProxyType(dict(self.options or {})))

    @classmethod
    def of(cls, settings: "BackendSettings | None", fields: Mapping[str, Any]) -> "BackendSettings":
        """The one adapter from keyword calls: ``settings`` itself, or a record built from
        ``fields`` (``device=``, ``dtype=``, ``max_numel=``, ``hidden=``, ``options=``).

        Raises
        ------
        TypeError
            Both or neither given, ``settings`` is not a :class:`BackendSettings`, or ``fields``
            lacks a required field or names an unknown one.
        ValueError
            As the constructor.
        """
        if settings is None:
            return cls(**fields)
        if fields:
            raise TypeError(f"pass a BackendSettings or its fields as keywords, not both (got also {sorted(fields)})")
        if not isinstance(settings, cls):
            raise TypeError(f"settings must be a BackendSettings, got {type(settings).__name__}")
        return settings
