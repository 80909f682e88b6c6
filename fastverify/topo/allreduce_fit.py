"""Whether the PCIe IPC and SGLang custom all-reduces can run on the diagnosed GPU pairs.

PCIe IPC all-reduce (FlashInfer ``PcieIpcAllReduceWorkspace``, flashinfer PR #4393): world size 2,
4 or 8 on one node, and CUDA peer access between every pair. SGLang's custom all-reduce: the
world sizes and NVLink rule of :func:`fastverify.registry.backend_info` (SGLang 0.5.23
``custom_all_reduce.py`` / ``custom_all_reduce_utils.py``), plus peer access.
"""

from __future__ import annotations

from fastverify.registry import BackendName, backend_info
from fastverify.topo.transports import PairReport


def pcie_ipc_fit(n: int, pairs: list[PairReport]) -> dict:
    """``{"possible": True | False | None, "reason"}`` for FlashInfer's PCIe IPC all-reduce on
    ``n`` GPUs (None: unknown from this input)."""
    if not pairs and n in (0, 2, 4, 8):
        return {"possible": None, "reason": "unknown from this input: no GPU pair known (add --nvidia-smi, or run "
                                            "`fastverify p2p` on the box)"}
    if n not in (2, 4, 8):
        return {"possible": False, "reason": f"world size {n}: FlashInfer's PCIe IPC all-reduce takes 2, 4 or 8 GPUs"}
    no = [f"{p.a}-{p.b}" for p in pairs if p.hw_p2p is False]
    if no:
        return {"possible": False, "reason": f"no CUDA peer access for pair(s) {', '.join(no)} (NVML); it needs every pair"}
    unknown = [p for p in pairs if p.hw_p2p is None]
    if unknown:
        return {"possible": None, "reason": "peer access unknown from this input: run the real P2P check on the box "
                                            "(fastverify p2p)"}
    return {"possible": True, "reason": "every pair reports CUDA peer access; deploy it with `fastverify launch "
                                        "--backend pcie_ipc --p2p-check FILE` (launch sets SGLang's switch after the proof)"}


def custom_ar_fit(n: int, pairs: list[PairReport]) -> dict:
    """``{"possible": True | False | None, "reason"}`` for SGLang's custom all-reduce on ``n``
    GPUs, by the registry's rule (the one launch and tune apply)."""
    info = backend_info(BackendName.custom_ar)
    if n == 0:
        return {"possible": None, "reason": "unknown from this input: the number of GPUs is not known"}
    all_nvlink = bool(pairs) and all((p.link or "").startswith("NV") for p in pairs)
    if info.world_sizes is not None and n not in info.world_sizes:
        return {"possible": False, "reason": f"SGLang's custom all-reduce runs on {list(info.world_sizes)} GPUs; {n} GPUs"}
    if not any(p.link for p in pairs) and n not in (info.world_sizes_without_nvlink or ()):
        return {"possible": None, "reason": f"{n} GPUs: SGLang's custom all-reduce needs 2 GPUs or full NVLink, and "
                                            "the links are unknown from this input"}
    if n not in (info.world_sizes_without_nvlink or ()) and not all_nvlink:
        return {"possible": False, "reason": f"SGLang's custom all-reduce needs 2 GPUs or full NVLink; {n} PCIe GPUs"}
    if any(p.hw_p2p is False for p in pairs):
        return {"possible": False, "reason": "no CUDA peer access between the GPUs"}
    return {"possible": None if any(p.hw_p2p is None for p in pairs) else True,
            "reason": "2 GPUs (or full NVLink); needs working peer access"}
