"""NCCL knowledge: settings catalogue and validator, library version, NCCL_DEBUG log and nccl-tests parsers, all-reduce cost model.

Settings: :mod:`.checks` (the catalogue, each setting's check, validate, explain, suggest), built on
:mod:`.findings` (records, severities). Logs: :mod:`.debuglog` reads ``NCCL_DEBUG=INFO`` output
into records. nccl-tests: :mod:`.perftable` reads ``all_reduce_perf`` output. Cost model:
:mod:`.model` (NCCL's tuning model, its fitted PCIe correction, and the algorithms and protocols an
environment leaves enabled). Library: :mod:`.version`.
"""
