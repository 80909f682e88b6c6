"""``fastverify collect``: one support bundle of this box and its SGLang server, for ``fastverify report``.

Modules: :mod:`.command` (flags, refusals, the time budget, writing the bundle), :mod:`.core` (the
run's context, a part's outcome, child processes with a time limit), :mod:`.parts` (doctor,
``nvidia-smi topo -m``, NVML, IOMMU/ACS, verify records), :mod:`.server` (the server's arguments
and profiler trace over HTTP), :mod:`.gpu` (P2P check, NCCL debug log, tune sweep). The bundle's
format is :mod:`fastverify.bundle`.
"""
