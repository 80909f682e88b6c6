"""NCCL knowledge: settings catalogue and validator, library version, NCCL_DEBUG log and nccl-tests parsers, all-reduce cost model.

Settings: :mod:`.catalogue` (validate, explain, suggest) over the table in :mod:`.settings`, whose
checks live in :mod:`.algoproto`, :mod:`.p2plevel`, :mod:`.buffsize` and :mod:`.valuechecks`,
built on :mod:`.findings` (records, severities) and :mod:`.intparse` (NCCL's integer reading);
:mod:`.enabled` answers which algorithms and protocols an environment leaves on.
Logs: :mod:`.logparse` reads ``NCCL_DEBUG=INFO`` output into the records of :mod:`.logrecords`,
with the line forms in :mod:`.loglines`. nccl-tests: :mod:`.perftable` over :mod:`.perflines`,
:mod:`.perfrows` and :mod:`.perfheader`. Cost model: :mod:`.model` over :mod:`.tuning` (NCCL's
constants), :mod:`.ringsearch` and :mod:`.gridfit`. Library: :mod:`.version`.
"""
