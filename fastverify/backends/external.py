"""External library calls (FlashInfer, SGLang) through a table the signature test checks, and
the import / version check every GPU backend's probe ends with.

Re-exported by :mod:`fastverify.backends.base`, where the backends import it from.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Sequence

from fastverify.backends.probing import Capability, fail


@dataclass(frozen=True)
class ExternalCall:
    """One function, class or constant of an external library that a backend uses, with the
    parameter names the backend passes. Backends build their keyword arguments through
    :meth:`kwargs`, which refuses names missing from ``params``; the test suite's signature test
    checks ``params`` against the real signatures. So code, table and library cannot drift apart.

    Attributes
    ----------
    public : str
        Module the backend imports the name from (``"flashinfer.comm"``).
    qualname : str
        Dotted path inside ``public``: ``"allreduce_fusion"``, ``"PcieIpcAllReduceWorkspace.tune"``.
    defined_in : str
        Module whose source defines it (``"flashinfer.comm.allreduce"``), for reading the
        source without importing the library.
    params : tuple[str, ...]
        Keyword names the backend passes (all arguments are passed by keyword).
    kind : str
        ``"function"``, ``"class"`` (params checked against ``__init__``), ``"method"`` or
        ``"attribute"`` (a constant; params empty).
    """

    public: str
    qualname: str
    defined_in: str
    params: tuple[str, ...] = ()
    kind: str = "function"

    def resolve(self) -> Any:
        """Import ``public`` and return the object (``ImportError``/``AttributeError`` if absent)."""
        obj: Any = importlib.import_module(self.public)
        for part in self.qualname.split("."):
            obj = getattr(obj, part)
        return obj

    def kwargs(self, **kw: Any) -> dict[str, Any]:
        unknown = sorted(set(kw) - set(self.params))
        assert not unknown, f"{self.qualname}: {unknown} not in its ExternalCall table entry"
        return kw


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("+")[0].split("."):
        digits = "".join(ch for ch in piece if ch.isdigit()) if piece[:1].isdigit() else ""
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def library_status(
    module: str, dist_name: str, min_version: tuple[int, ...], needed: Sequence[ExternalCall]
) -> Capability:
    """Whether ``module`` imports, is at least ``min_version`` and has every name in ``needed``.
    Importing is the test (a broken CUDA/JIT install fails here, not mid-collective)."""
    try:
        mod = importlib.import_module(module)
    except Exception as err:  # ImportError, or a library failing inside its own import
        return fail(
            f"{module} not importable ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}); "
            f"pip install '{dist_name}>={'.'.join(map(str, min_version))}'"
        )
    version = str(getattr(mod, "__version__", "") or "")
    if not version:
        try:
            from importlib.metadata import version as dist_version

            version = dist_version(dist_name)
        except Exception:
            version = "0"
    if _version_tuple(version) < min_version:
        return fail(
            f"{dist_name} {version} is older than {'.'.join(map(str, min_version))}; "
            f"pip install -U '{dist_name}>={'.'.join(map(str, min_version))}'"
        )
    for call in needed:
        try:
            call.resolve()
        except Exception as err:
            return fail(
                f"{dist_name} {version} lacks {call.public}.{call.qualname} ({type(err).__name__}); "
                f"install a version that has it"
            )
    return Capability(True, f"{dist_name} {version}")
