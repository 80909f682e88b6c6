"""What blocks a launch: :func:`fastverify.patch.launch.plan_launch`'s checks either refuse at
the first failure (the real launch: one line, nothing started) or, for ``--dry-run``, collect
every failure as a :class:`Blocker` so that a user preparing away from the box sees all of them
at once, each with its fix.

``plan_launch`` runs the checks in order; one :class:`Checks` object per plan decides whether a
failed check raises or is recorded, and :func:`blocked_text` / :func:`summary` render the
recorded ones. The checks against the box, the record and the command's TP group
(:func:`check_box`: record box and TP, backend reach, P2P proof) are here too, each written
once and used by both modes.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from fastverify.deploy import BoxFingerprint, DeploymentRecord, P2PFacts
from fastverify.errors import UserError
from fastverify.patch.launch_notes import served_dtype, workspace_check
from fastverify.patch.server_cmd import ServerShapes
from fastverify.registry import BackendInfo, sm_text, unreachable_reason
from fastverify.topo.p2p_proof import proof_for

if TYPE_CHECKING:
    from fastverify.patch.sglang_info import SGLangInfo

P2P_FIX = "run `fastverify p2p --output p2p.json` on the serving box, then add `--p2p-check p2p.json`"
"""The fix of every P2P blocker: only the real check proves P2P, and only for the GPUs it tested."""
P2P_FAILS_FIX = (
    "use `--backend nccl`, or make P2P work between these GPUs (`fastverify topo` shows ACS/IOMMU) "
    "and rerun `fastverify p2p`"
)
"""The fix of P2P that a real check saw fail: rerunning the check alone changes nothing."""
BACKEND_FIX = (
    "use `--backend nccl`, or re-run `fastverify tune --write-env` on the serving box to pick a backend it reaches"
)
"""The fix of a backend the box or SGLang cannot reach (SM, world size, NVLink, dtype)."""


@dataclass(frozen=True)
class Blocker:
    """One check that would refuse the real launch.

    Attributes
    ----------
    check : str
        What was checked, in a word or two: ``box``, ``TP``, ``backend``, ``P2P``,
        ``environment``, ``IPC workspace``, ``command``; for the proof of a swap
        (:func:`fastverify.proof.run.proof_blockers`) ``load``, ``URL``, ``baseline``, ``run folder``.
    message : str
        The one line the real launch refuses with (exactly that text).
    fix : str or None
        What to run or change, where ``message`` does not already say it.
    """

    check: str
    message: str
    fix: str | None = None

    def line(self) -> str:
        """``box: <message>`` plus ``; fix: <fix>`` where a fix is given; one line."""
        text = " ".join(f"{self.check}: {self.message}".split("\n"))
        return text + (f"; fix: {self.fix}" if self.fix else "")


class Checks:
    """The failed checks of one plan: raised at once (``collect=False``) or recorded.

    Parameters
    ----------
    collect : bool
        False: :meth:`refuse` raises and :meth:`guard` lets the error through (the real launch
        stops at the first blocker). True: both record a :class:`Blocker` and return, and the
        caller goes on with the next check.
    """

    def __init__(self, collect: bool) -> None:
        self.collect = collect
        self._found: list[Blocker] = []

    @property
    def blockers(self) -> tuple[Blocker, ...]:
        """The recorded blockers, in the order the checks ran (always empty when not collecting)."""
        return tuple(self._found)

    def refuse(self, check: str, message: str, fix: str | None = None) -> None:
        """A failed check.

        Raises
        ------
        UserError
            ``message``, when not collecting.
        """
        if not self.collect:
            raise UserError(message)
        self._found.append(Blocker(check, message, fix))

    @contextmanager
    def guard(self, check: str, fix: str | None = None) -> Iterator[None]:
        """Run a check that raises :class:`~fastverify.errors.UserError` when it fails: recorded
        as a blocker when collecting (the rest of the ``with`` body is skipped), else re-raised."""
        try:
            yield
        except UserError as err:
            if not self.collect:
                raise
            self._found.append(Blocker(check, str(err), fix))


def blocked_text(blockers: Sequence[Blocker]) -> list[str]:
    """The dry run's last lines: ``blocked by:`` and one indented line per blocker, or
    ``blocked by: nothing``."""
    if not blockers:
        return ["blocked by: nothing"]
    return ["blocked by:", *(f"  - {b.line()}" for b in blockers)]


def summary(blockers: Sequence[Blocker]) -> str:
    """The one line a blocked dry run prints on stderr (after ``fastverify: error:``); it names
    the count and repeats the first blocker, which is what the real launch would refuse with.

    Raises
    ------
    ValueError
        ``blockers`` is empty (nothing blocks: there is no error to say).
    """
    if not blockers:
        raise ValueError("summary() needs at least one blocker")
    n = len(blockers)
    return f"launch is blocked by {n} check{'s' if n != 1 else ''} (listed above); first: {blockers[0].message}"


# --- the checks against the box, the record and the command -----------------------------------------


def flag_int(argv: Sequence[str], flags: Sequence[str]) -> int | None:
    """The integer after any of ``flags`` in ``argv`` (``--f N`` or ``--f=N``; last one wins);
    None when no flag is given.

    Raises
    ------
    UserError
        The value after a flag is not an integer (a typo in the command: refused in both modes).
    """
    value = None
    for i, a in enumerate(argv):
        name, eq, rest = a.partition("=")
        if name not in flags:
            continue
        text = rest if eq else (argv[i + 1] if i + 1 < len(argv) else "")
        try:
            value = int(text)
        except ValueError:
            raise UserError(f"the command's {name} {text!r}: expected an integer") from None
    return value


def _box_mismatch(record: DeploymentRecord, box: BoxFingerprint, where: str) -> str | None:
    """Why a record made on another box (GPU name, compute capability or count differ) is refused,
    one line naming ``where``; None when it is this box's. A field the record does not know
    (``tune --predict`` from ``nvidia-smi topo -m`` text has no GPU name) is not compared."""
    rb = record.box
    diffs = []
    if rb.gpu_name is not None and rb.gpu_name != box.gpu_name:
        diffs.append("GPU")
    if rb.sm is not None and tuple(rb.sm) != (tuple(box.sm) if box.sm else None):
        diffs.append("SM")
    if rb.gpu_count != box.gpu_count:
        diffs.append("GPU count")
    if not diffs:
        return None
    return (
        f"{where}: deployment record is for another box ({', '.join(diffs)} differ): made on "
        f"{box_text(rb)}, this box has {box_text(box)}; re-run `fastverify tune --write-env` here"
    )


def box_text(b: BoxFingerprint) -> str:
    """``8 x NVIDIA GeForce RTX 4090 (SM89)``; ``no GPU`` for a box without one."""
    if not b.gpu_count:
        return "no GPU"
    return f"{b.gpu_count} x {b.gpu_name or 'GPU of unknown name'} ({sm_text(tuple(b.sm) if b.sm else None)})"


_HOW = {
    "p2p_check": "real P2P check",
    "nvml": "NVML's report only, not exercised",
    "nccl_log": "NCCL's log only, not exercised",
    "caller": "given by the caller",
    "not_checked": "not checked",
}


def _tp_ordinals(argv: Sequence[str], world: int) -> list[int]:
    """The CUDA ordinals of the server's TP ranks: SGLang 0.5.23 puts rank ``r`` on
    ``base_gpu_id + r * gpu_id_step`` (``entrypoints/engine.py``; ``--base-gpu-id`` 0 and
    ``--gpu-id-step`` 1 by default, ``arg_groups/fields/device.py``)."""
    base = flag_int(argv, ("--base-gpu-id",))
    step = flag_int(argv, ("--gpu-id-step",))
    base = 0 if base is None else base
    step = 1 if step is None else step
    return [base + r * step for r in range(world)]


def _tp_gpus(box: BoxFingerprint, argv: Sequence[str], world: int | None) -> tuple[list | None, str]:
    """This box's GPUs of the server's TP group (rank order), or ``(None, why)``. With the TP size
    unknown (not an SGLang command) the group is every GPU the command sees: the proof must
    then cover all of them."""
    if box.gpus is None:
        return None, 'NVML gave no GPU identities here (a described box without "gpus")'
    if not world:
        return (list(box.gpus), "") if len(box.gpus) > 1 else (None, "the TP size is not known")
    if world > len(box.gpus):  # said before a list of ``world`` ordinals is made (a TP of 10**18)
        return None, f"the command's TP group needs {world} GPUs, and this box shows {len(box.gpus)} GPU(s) to it"
    ordinals = _tp_ordinals(argv, world)
    if max(ordinals) >= len(box.gpus) or min(ordinals) < 0:
        return None, (
            f"the command's TP group needs CUDA ordinals {ordinals[0]}..{ordinals[-1]}, and this box shows "
            f"{len(box.gpus)} GPU(s) to it"
        )
    return [box.gpus[o] for o in ordinals], ""


def _record_proof(p2p: P2PFacts, tp_gpus: list | None, why: str) -> tuple[bool | None, str]:
    """``p2p_ok`` for :func:`unreachable_reason` from a deployment record's P2P facts: True only
    when the record's real check tested every GPU of this TP group (:attr:`P2PFacts.gpus`, every
    ordered pair among them passed); the source in words."""
    how = _HOW.get(p2p.source, p2p.source)
    if not p2p.proven:
        return (False if p2p.ok is False else None), how + (f": {p2p.note}" if p2p.note else "")
    if not p2p.gpus:
        return None, (
            f"{how} of the deployment record names no GPU (a record written before the check recorded "
            "which GPUs it tested), so it cannot show they are this box's; rerun `fastverify tune "
            "--write-env --p2p-check FILE`"
        )
    if tp_gpus is None:
        return None, f"{how} of the deployment record cannot be bound to this box's GPUs: {why}"
    missing = [g for g in tp_gpus if not any(g.same_gpu(h) for h in p2p.gpus)]
    if missing:
        return None, (
            f"{how} of the deployment record did not test {missing[0].label()} of this TP group (it "
            f"tested {', '.join(h.label() for h in p2p.gpus)})"
        )
    n = len(tp_gpus)
    return True, f"{how} of the deployment record: all {n * (n - 1)} directions of the TP group's GPUs passed"


def check_box(
    checks: Checks,
    box: BoxFingerprint,
    record: DeploymentRecord | None,
    record_path: Path | None,
    tp: int | None,
    argv: Sequence[str],
    to_check: Sequence[BackendInfo],
    check_file: object,
    p2p_file: str | Path | None,
    info: SGLangInfo,
    server: ServerShapes | None,
) -> tuple[int | None, P2PFacts | None]:
    """The checks against the box: the record's box and TP, then each backend of ``to_check``
    against :func:`fastverify.registry.unreachable_reason`, every reason but P2P first (a box the
    backend cannot run on is said as such), then P2P (``check_file``, the read ``--p2p-check``,
    else the record's proof), bound to the TP group's GPUs.

    Returns
    -------
    (world, p2p)
        The TP size checked (None: unknown) and the P2P facts used (None: nothing needed them).

    Raises
    ------
    UserError
        The first failed check, unless ``checks`` collects them (then each is a blocker).
    """
    if record is not None:
        mismatch = _box_mismatch(record, box, str(record_path))
        if mismatch is not None:
            checks.refuse("box", mismatch)
        if tp is not None and record.box.tp and tp != record.box.tp:
            checks.refuse(
                "TP",
                f"{record_path}: deployment record is for TP {record.box.tp}; the command runs "
                f"TP {tp} (re-run `fastverify tune --write-env --tp {tp}`)",
            )
    world = tp if tp is not None else (record.box.tp if record is not None and record.box.tp else None)
    facts = dict(
        sm=tuple(box.sm) if box.sm else None,
        world_size=world,
        sglang_version=info.version,
        nvlink_full=box.nvlink_full,
        dtype=served_dtype(record, server),
    )
    blocked = set()
    for b in to_check:
        reason = unreachable_reason(b, p2p_ok=True, **facts)
        if reason is not None:
            checks.refuse("backend", reason, BACKEND_FIX)
            blocked.add(b.name)
    tp_gpus, why = _tp_gpus(box, argv, world)
    if check_file is not None and any(b.needs_p2p for b in to_check):
        proof = None
        with checks.guard("P2P", P2P_FIX):  # refuses, naming the file, what proves nothing here
            proof = proof_for(check_file, tp_gpus, why)
        if proof is None:  # recorded as the P2P blocker: the file proves nothing for this group
            return world, P2PFacts(ok=None, source="p2p_check", note=checks.blockers[-1].message[:300])
        ok, note = proof
        p2p = P2PFacts(
            ok=ok,
            source="p2p_check",
            note=note[:300],
            pairs=len(tp_gpus) * (len(tp_gpus) - 1),
            gpus=tuple(tp_gpus) if ok else (),
        )
        p2p_ok, how = ok, _HOW["p2p_check"] + ("" if ok else f": {note}")
    else:
        p2p = record.p2p if record is not None else P2PFacts(ok=None, source="not_checked")
        p2p_ok, how = _record_proof(p2p, tp_gpus, why)
    for b in to_check:
        if b.name in blocked:  # already refused for its box; P2P is moot there
            continue
        reason = unreachable_reason(b, p2p_ok=p2p_ok, p2p_source=how, **facts)
        if reason is not None:
            if b.needs_p2p and p2p_ok is not True and "P2P" in reason and p2p_file is None:
                reason += " (or give --p2p-check FILE with its JSON)"
            checks.refuse("P2P", reason, P2P_FAILS_FIX if p2p_ok is False else P2P_FIX)
    return world, p2p


def workspace_note(
    checks: Checks,
    notes: list[str],
    b: BackendInfo,
    environ: Mapping[str, str],
    record: DeploymentRecord | None,
    server: ServerShapes | None,
    box: BoxFingerprint | None,
    world: int | None,
) -> None:
    """Append :func:`~fastverify.patch.launch_notes.workspace_check`'s line to ``notes``; a
    workspace too large for the GPU is refused through ``checks`` (raises
    :class:`~fastverify.errors.UserError` unless collecting)."""
    with checks.guard("IPC workspace"):
        notes.append(workspace_check(b, environ, record, server, box, world))
