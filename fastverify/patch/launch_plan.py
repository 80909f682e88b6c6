"""What blocks a launch: :func:`fastverify.patch.launch.plan_launch`'s checks either refuse at
the first failure (the real launch: one line, nothing started) or, for ``--dry-run``, collect
every failure as a :class:`Blocker` so that a user preparing away from the box sees all of them
at once, each with its fix.

``plan_launch`` runs the checks in order; one :class:`Checks` object per plan decides whether a
failed check raises or is recorded, and :func:`blocked_text` / :func:`summary` render the
recorded ones. The checks against the box, the record and the command's TP group
(:func:`check_box`: record box and TP, backend reach, P2P proof) are here too, each written
once and used by both modes.

``fastverify launch``'s notes: where the command, the env file and the installed SGLang differ
from what the deployment record was made for, and what covers the server's verify steps. Each
note is one line the plan prints (``note: ...``); only :func:`workspace_check` refuses anything
(an IPC workspace that would not fit beside SGLang's static pool).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from fastverify.deploy import BoxFingerprint, DeploymentRecord, P2PFacts
from fastverify.errors import UserError
from fastverify.patch.server_cmd import ServerShapes
from fastverify.registry import BackendInfo, sm_text, unreachable_reason
from fastverify.topo.p2p_proof import proof_for

if TYPE_CHECKING:
    from fastverify.patch.sglang_info import SGLangInfo


def settings_notes(record: DeploymentRecord, settings: Mapping[str, str], env_file: str, notes: list[str]) -> None:
    """A note (not a refusal) where the env file's NCCL settings differ from the record's.

    The env file is what is exported, and it is validated line by line like the record's
    settings; a hand edit of it (a plain docker/systemd file) is a normal thing to do, and the
    record's other facts (box, TP, backend, shapes, P2P) are checked on their own. What differs
    is only the record's gain, which was obtained with the record's settings: the note says so.
    """
    env_nccl = {k: v for k, v in settings.items() if k.startswith("NCCL_")}
    if env_nccl == dict(record.nccl_settings):
        return
    keys = sorted(set(env_nccl) | set(record.nccl_settings))
    diff = ", ".join(
        f"{k}: env {env_nccl.get(k, '(unset)')} / record {record.nccl_settings.get(k, '(unset)')}"
        for k in keys
        if env_nccl.get(k) != record.nccl_settings.get(k)
    )
    notes.append(
        f"{env_file}: NCCL settings differ from the deployment record's ({diff}); the env file's are "
        "set, and the record's gain was obtained with the record's"
    )


def served_dtype(record: DeploymentRecord | None, server: ServerShapes | None) -> str | None:
    """The dtype the server's all-reduces run in: the command's ``--dtype`` where it names one
    (``bfloat16``, ``float16``/``half``, ``float32``/``float``), else the record's; None unknown."""
    given = {
        "bfloat16": "bfloat16",
        "float16": "float16",
        "half": "float16",
        "float32": "float32",
        "float": "float32",
    }.get((server.dtype or "") if server is not None else "")
    return given or (record.shapes.dtype if record is not None else None)


_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}

IPC_WORKSPACE_MAX_GPU_PERCENT = 10
"""The most of one GPU's memory, in percent, an IPC all-reduce workspace may take (new bound, defined here,
not in :mod:`fastverify.bounds`). SGLang 0.5.23 allocates the workspace after its static pool
(weights + KV cache, ``--mem-fraction-static``), from the few GB it reserves for activations and
CUDA graphs (``arg_groups/memory_hook.py``: 512 MB + 1.5 MB per activation token + 1 GB per 8 TP
ranks, at least 10 GB above 60 GB); a decode-sized workspace takes well under 1 % (48 x 6 rows x
7168 x 2 B x 34 ≈ 140 MB at TP 8), so a tenth of the GPU is far above any real one and far below
what would take the server's own memory."""


def _ipc_slab_factor(world: int) -> int:
    """Bytes per payload byte FlashInfer 0.7.4 allocates per rank for its PCIe IPC workspace
    (``include/flashinfer/comm/pcie_ipc_all_reduce.cuh::compute_workspace_layout``): two scratch
    regions of ``2 x world x payload`` each plus the copy-engine ring, ``2 x (world - 1)``
    shards of ``payload / world`` (< 2 x payload); signals and flags are a few KiB. So at least
    ``4 x world + 2`` times the payload: a lower bound, which is what a refusal needs."""
    return 4 * world + 2


def _mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB" if n < 2**30 else f"{n / 2**30:,.1f} GiB"


def workspace_check(
    b: BackendInfo,
    environ: Mapping[str, str],
    record: DeploymentRecord | None,
    server: ServerShapes | None,
    box: BoxFingerprint | None,
    world: int | None,
) -> str:
    """What covers the verify steps of a backend SGLang switches and sizes itself, and whether its
    IPC workspace fits the GPU (one line); refuses one that does not.

    The size: ``b.size_env`` from the environment where set (SGLang 0.5.23 uses it verbatim and
    sends every wider step to NCCL; the caller validated it against the bounds first,
    :func:`fastverify.envfile.check_setting`), else SGLang's own decode width
    (``pcie_ipc_ar.py::_decode_width``: largest captured batch x draft tokens, the command's
    rows here, else the record's) times the record's hidden size. Elements x dtype bytes (the
    record's dtype; SGLang builds the workspace in bfloat16) x FlashInfer's per-rank layout
    (:func:`_ipc_slab_factor`) is compared with the GPU's memory where NVML (or the described
    box) gives it (:attr:`BoxFingerprint.gpu_memory_bytes`), and said where it does not.

    Raises
    ------
    UserError
        The workspace would take more than :data:`IPC_WORKSPACE_MAX_GPU_PERCENT` % of the GPU.
    """
    covers = server.covers() if server is not None else "every captured verify step"
    hidden = record.shapes.hidden if record is not None else None
    rows = (
        server.max_rows
        if server is not None and server.max_rows
        else (record.shapes.max_rows if record is not None else None)
    )
    given = environ.get(b.size_env) if b.size_env else None
    if given is not None:
        elements = int(given)
        if hidden and rows and elements < rows * hidden:
            head = (
                f"{b.name.value}: the environment's {b.size_env}={elements} caps the workspace at "
                f"{elements // hidden} rows x hidden {hidden}; the command runs {covers}: verify steps above "
                f"{elements // hidden} rows go to NCCL (unset it to let SGLang size it)"
            )
        else:
            head = (
                f"{b.name.value}: the environment's {b.size_env}={elements} sizes the workspace (SGLang uses it "
                f"verbatim; the command runs {covers})"
            )
    else:
        elements = rows * hidden if rows and hidden else None
        head = (
            f"{b.name.value}: {b.size_env or 'the workspace'} not set: SGLang sizes the workspace from its "
            f"decode CUDA-graph width, covering {covers}"
        )
    if elements is None:
        return (
            head + "; workspace size unknown (no deployment record gives the hidden size): not checked against "
            "the GPU's memory"
        )
    elem = _DTYPE_BYTES.get(record.shapes.dtype if record is not None else "bfloat16", 2)
    w = world or 8
    slab = elements * elem * _ipc_slab_factor(w)
    what = f"{elements:,} elements x {elem} B x {_ipc_slab_factor(w)} (FlashInfer's layout at TP {w})"
    mem = box.gpu_memory_bytes if box is not None else None
    if mem is None:
        return (
            head + f"; workspace about {_mib(slab)} per GPU ({what}); GPU memory unknown (NVML gave none): not "
            "checked against it"
        )
    if slab * 100 > mem * IPC_WORKSPACE_MAX_GPU_PERCENT:  # integers: exact at the bound
        raise UserError(
            f"{b.name.value}: its IPC workspace would take {_mib(slab)} per GPU ({what}), "
            f"{100.0 * slab / mem:.1f} % of the GPU's {_mib(mem)}, more than the "
            f"{IPC_WORKSPACE_MAX_GPU_PERCENT} % SGLang leaves beside its static pool: lower the "
            f"size, the decode batch or the draft tokens, or use nccl"
        )
    return head + f"; workspace about {_mib(slab)} per GPU ({what}), {100.0 * slab / mem:.1f} % of its {_mib(mem)}"


def shape_notes(record: DeploymentRecord, server: ServerShapes | None, info: SGLangInfo, notes: list[str]) -> None:
    """Notes where the command or the installed SGLang differ from what the record was made for."""
    s = record.shapes
    if server is not None:
        notes.append(
            f"the command (read by {server.source}{'; ' + server.note if server.note else ''}) runs {server.covers()}"
        )
        rows = server.max_rows
        if rows is not None and rows > s.max_rows:
            notes.append(
                f"the record was measured for verify steps up to {s.max_rows} rows ({s.max_batch} requests x "
                f"{s.draft_tokens} tokens); the command runs up to {rows}: its gain was not measured there "
                f"(re-run tune with --max-batch {server.max_batch} --draft-tokens {server.tokens_per_request})"
            )
        if server.draft_tokens is not None and server.algorithm and server.draft_tokens != s.draft_tokens:
            notes.append(
                f"the command verifies {server.draft_tokens} tokens per request; the record was made for "
                f"{s.draft_tokens}"
            )
    if record.sglang_version and info.version and record.sglang_version != info.version:
        notes.append(f"the record was made with SGLang {record.sglang_version}; this SGLang is {info.version}")


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
    """Append :func:`workspace_check`'s line to ``notes``; a
    workspace too large for the GPU is refused through ``checks`` (raises
    :class:`~fastverify.errors.UserError` unless collecting)."""
    with checks.guard("IPC workspace"):
        notes.append(workspace_check(b, environ, record, server, box, world))
