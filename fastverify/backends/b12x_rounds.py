"""The b12x preparation's cross-rank agreement: one exchange round per step on a gloo CPU group.

FlashInfer 0.7.4's ``PreparationSession`` (``flashinfer/experimental/b12x/preparation/session.py``)
with autotune off (``_warmup_only``) authorizes each request (``yield item.collective`` ->
``coordinator``), runs the embedder's ``collective_barrier`` hook (``PreparationJob._collective_barrier``:
a daemon thread, bounded by ``B12X_COLLECTIVE_BARRIER_TIMEOUT``, 120 s), and only then compiles the
plan (``_instantiate(..., compile_directly=True)``: ``_materialize``), binds it (``prepare_call(state)``)
and launches it (``_prime``). A compile that fails on one rank after its peers launched leaves them
spinning in the priming kernel; so every cross-rank step (the construction vote, the coordinator,
the barrier hook, a vote after the bind and before the launch, the final "done") is one round of
:class:`PreparationRounds` on SGLang's gloo CPU group (``GroupCoordinator.cpu_group``,
``sglang/srt/distributed/parallel_state.py``), never on the NCCL device group, and a failing rank's
next round is its ``("fail", why)``: every rank stops at the same round, before any launch of that
request.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import torch.distributed as dist

from fastverify.backends.ipc import new_gloo_group

MOD_PARALLEL_STATE = "sglang.srt.distributed.parallel_state"  # _groups: unique_name -> weakref(GroupCoordinator)


def _backend_of(group: Any) -> str:
    return str(dist.get_backend(group)).lower()


def sglang_cpu_group(group: Any) -> Any:
    """The ``cpu_group`` (gloo) of the SGLang ``GroupCoordinator`` whose ``device_group`` is
    ``group``, found in ``parallel_state._groups`` (name -> weakref, ``_register_group``; SGLang
    0.5.23 ``sglang/srt/distributed/parallel_state.py``); None outside an SGLang worker."""
    groups = getattr(sys.modules.get(MOD_PARALLEL_STATE), "_groups", None)
    if not isinstance(groups, dict):
        return None
    for ref in list(groups.values()):
        coordinator = ref() if callable(ref) else None
        if coordinator is not None and getattr(coordinator, "device_group", None) is group:
            return getattr(coordinator, "cpu_group", None)
    return None


def cpu_group_for(group: Any, option: Any) -> tuple[Any, bool]:
    """``(gloo group over the ranks of group, owned)``: the ``cpu_group`` option, else SGLang's
    coordinator's, else ``group`` itself when it is gloo, else a new gloo group when ``group``
    spans the default group (``new_group`` is collective over it). Decided from facts every rank
    shares, so every rank takes the same branch. Raises ``ValueError`` when none fits."""
    world = group if group is not None else dist.group.WORLD
    cpu = option if option is not None else sglang_cpu_group(world)
    if cpu is not None:
        if _backend_of(cpu) != "gloo":
            raise ValueError(f"the CPU group must be gloo, got {_backend_of(cpu)}")
        return cpu, False
    if _backend_of(world) == "gloo":
        return world, False
    subgroup = "no gloo CPU group for this subgroup: pass options={'cpu_group': <gloo group>}"
    return new_gloo_group(world, subgroup), True


class RoundsEnded(Exception):
    """Every rank saw the same failed exchange round; no rank sends another message."""


class PreparationRounds:
    """The exchange rounds of one backend on ``cpu_group``, a gloo group over ``ranks``.

    Parameters
    ----------
    cpu_group : ProcessGroup
        gloo, over the ranks of the backend's group (:func:`cpu_group_for`).
    owned : bool
        Whether it was built for these rounds: :meth:`release` destroys it then.
    world_size : int
        Ranks in the group. ranks : tuple[int, ...] : their global ranks, sorted.

    Attributes
    ----------
    ended : str or None
        Why the rounds since :meth:`start` ended, the same on every rank; None while they run.
    step : str or None
        The request being planned or authorized, named in a failure.
    barrier_calls : list[tuple[str, tuple[int, ...]]]
        ``(key, ranks)`` of every call the library's barrier hook got.
    """

    def __init__(self, cpu_group: Any, owned: bool, world_size: int, ranks: tuple[int, ...]) -> None:
        self.cpu_group = cpu_group
        self.world_size = world_size
        self.ranks = ranks
        self.ended: str | None = None
        self.step: str | None = None
        self.barrier_calls: list[tuple[str, tuple[int, ...]]] = []
        self._owned = owned
        self._lock = threading.Lock()  # the barrier hook's round runs on a library thread

    def start(self) -> None:
        """Begin the rounds of one preparation."""
        self.ended = self.step = None

    def exchange(self, message: Any) -> list[Any]:
        """All-gather one picklable object per rank on the CPU group; every rank gets the same list."""
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, message, group=self.cpu_group)
        return out

    def round(self, message: tuple) -> None:
        """One round of the preparation protocol: every rank sends one message. Unless all are
        the same ``(step, key)`` / ``("done",)``, every rank records the same reason in ``ended``
        and raises :class:`RoundsEnded`, so every rank stops sending at the same round. Once the
        rounds ended (on any thread) it sends nothing and raises again."""
        with self._lock:  # the barrier thread's round and a main-thread round never overlap
            if self.ended is None:
                got = self.exchange(message)
                if message[0] != "fail" and all(m == message for m in got):
                    return
                fails = [f"rank {r}: {m[1]}" for r, m in enumerate(got) if m[0] == "fail"]
                self.ended = "; ".join(fails) if fails else f"ranks disagree on the preparation step: {got}"
            raise RoundsEnded(self.ended)

    def fail(self, why: str) -> None:
        """This rank's local failure, told the others in the round they are in (nothing is sent
        when the rounds already ended, e.g. in the barrier hook). Always raises :class:`RoundsEnded`."""
        self.round(("fail", f"{self.step}: {why}" if self.step else why))

    def coordinate(self, progress: Any) -> str | None:
        """``PreparationSession.prepare``'s coordinator: authorize a collective (priming) launch
        once every rank reached the same one; returns its key. Nothing to authorize: None, no
        communication (ranks reach this a different number of times while compiling)."""
        if getattr(progress, "ready_tuning", ()) or getattr(progress, "ready_cache", None) is not None:
            raise RuntimeError("b12x asked for a tuning agreement with autotune=False")
        ready = tuple(progress.ready_collectives)
        if not ready:
            return None
        key = self.step = ready[0].key
        self.round(("key", key))
        return key

    def barrier(self, key: str, ranks: tuple[int, ...]) -> None:
        """The session's ``collective_barrier(key, ranks)`` hook (session.py
        ``PreparationJob._collective_barrier``, on its daemon thread): one round on the CPU group
        after the authorization and before this request compiles and launches."""
        self.barrier_calls.append((key, tuple(ranks)))
        if tuple(ranks) != self.ranks:
            raise ValueError(f"collective {key!r} is over ranks {tuple(ranks)}, this group is {self.ranks}")
        self.round(("barrier", key))

    def release(self) -> None:
        """Drop the CPU group, destroying it when it was built here (every rank does, at the same
        point): a group object outliving ``destroy_process_group`` aborts the process at exit."""
        cpu, self.cpu_group = self.cpu_group, None
        if self._owned and cpu is not None:
            self._owned = False
            dist.destroy_process_group(cpu)
