"""b12x start-up on two gloo ranks: a compile that fails on one rank, and the plan's stride rule.

Driven from FlashInfer 0.7.4's own source (``$FASTVERIFY_FLASHINFER_WHEEL``, imported as
``b12x`` the way ``tests/test_b12x.py`` does): the real ``PreparationSession`` loop
(``preparation/session.py``: coordinator, ``collective_barrier`` hook on the library's daemon
thread, ``_instantiate(compile_directly=True)``: materialize, bind, prime), the real plan and
``_OneshotExecutionState`` (``comm/pcie/_oneshot_preparation.py``), and the real runtime class.
Stood in (``test_b12x.standins`` / ``session_and_compile`` / ``install_modules``), each because it
needs CUDA or a GPU compiler: the kernels (a gloo all-reduce on the device group, so a rank that
launches while a peer is elsewhere blocks, as the spinning kernel does); their compilation
(``compile_oneshot_surface`` + ``load_programs``: CuTe/Triton; rank 1's raises
``torch.OutOfMemoryError`` for one request); Triton's observer hook (``_lib/compile_plan.py``,
marked installed); the plan's declared device (``session.py`` ``_configure`` takes only CUDA
declarations); the CUDA IPC handle exchange; ``require_prepared``'s device check; ``check_cuda``.
SGLang (not installed) is stood in by a ``parallel_state._groups`` registry holding one
``GroupCoordinator``-shaped object whose ``device_group`` (gloo here, NCCL in a server) and
``cpu_group`` are two distinct gloo groups.

The ranks are started by ``tests/rank_harness.py``; each runs ``_rank`` with a scenario name.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
import types
import weakref
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
for path in (str(HERE.parent), str(HERE)):
    if path not in sys.path:
        sys.path.insert(0, path)

import pytest  # noqa: E402
import rank_harness  # noqa: E402
import test_b12x as base  # noqa: E402
import torch  # noqa: E402

from fastverify.backends import (  # noqa: E402
    BackendName,
    ProbeContext,
    check_close,
    flashinfer_b12x as b12x_backend,  # noqa: E402
    ipc,  # noqa: E402
    make_backend,
)

H = base.HIDDEN
SHAPES = [(1, H), (4, H)]
NOT_BUILT = re.compile(r"^b12x not built: (.+); all-reduces stay on NCCL$")
TIMEOUT_S = 60
NO_WHEEL = f"set {base.WHEEL_ENV} to the flashinfer-python 0.7.4 wheel to run b12x's own code"


# --- worker --------------------------------------------------------------------------------------


def _sglang_groups(dist) -> tuple[object, object, object]:
    """Two gloo groups and an SGLang-shaped coordinator registered in ``parallel_state._groups``
    (SGLang 0.5.23: ``_register_group`` stores ``weakref.ref(GroupCoordinator)``)."""

    class GroupCoordinator:  # what sglang_cpu_group reads of SGLang's
        def __init__(self, device_group, cpu_group):
            self.unique_name, self.device_group, self.cpu_group = "tp:0", device_group, cpu_group

    device, cpu = dist.new_group(backend="gloo"), dist.new_group(backend="gloo")
    coordinator = GroupCoordinator(device, cpu)
    ps = types.ModuleType(b12x_backend.MOD_PARALLEL_STATE)
    ps._groups = {"tp:0": weakref.ref(coordinator)}
    sys.modules[ps.__name__] = ps
    return device, cpu, coordinator


def _spy_exchanges(dist, device, cpu, log: list) -> None:
    """Record each ``all_gather_object``: its group, whether on the main thread, the message."""
    real_gather = dist.all_gather_object

    def gather(out, obj, group=None):
        where = "cpu" if group is cpu else "device" if group is device else repr(group)
        log.append(
            [where, threading.current_thread() is threading.main_thread(), list(obj) if isinstance(obj, tuple) else obj]
        )
        return real_gather(out, obj, group=group)

    dist.all_gather_object = gather


def _backend(world: int, device_group):
    ctx = ProbeContext(
        world_size=world,
        device_type="cpu",
        dtype=torch.float32,
        group_backend="nccl",
        sm=(12, 0),
        p2p_ok=True,
        single_node=True,
    )
    return make_backend(
        BackendName.b12x, device_group, device="cpu", dtype=torch.float32, max_numel=8 * H, hidden=H, context=ctx
    )


def _scenario_compile_fails(be, rank: int, out: dict) -> None:
    be.prepare(SHAPES)  # rank 1's compile of the fused 4-row request raises
    x, residual, weight = base.inputs(rank, 4, torch.float32)
    xs = [base.inputs(r, 4, torch.float32)[0] for r in range(2)]
    out["after"] = {
        "all_reduce": check_close(be.all_reduce(x), sum(v.float() for v in xs), torch.float32),
        "fused": be.all_reduce_residual_rmsnorm(x, residual, weight, base.EPS)[0].shape == x.shape,
    }


def _layouts() -> dict[str, torch.Tensor]:
    return {
        "contiguous_1": torch.randn(1, H),
        "view_1_stride_2H": torch.randn(1, 2 * H)[:, :H],  # is_contiguous() is True
        "offset_1": torch.randn(2, H)[1:],
        "contiguous_4": torch.randn(4, H),
        "rows_4_stride_2H": torch.randn(4, 2 * H)[:, :H],
        "expanded_4": torch.randn(1, H).expand(4, H),
    }


def _scenario_strides(be, rank: int, out: dict) -> None:
    """Per layout: fastverify's readiness (plain and fused) against the real plan's rule, run on
    the plan's prepared ``_OneshotExecutionState`` (``_check_input``) and the runtime's
    ``should_allreduce``; each call's result and path; and what the library itself does when
    handed the refused view (``OneshotAllReduce.all_reduce``)."""
    be.prepare(SHAPES)
    torch.manual_seed(rank)
    res = {}
    for name, v in _layouts().items():
        lib = {}
        for kind in ("plain", "fused"):
            state = be._plans[(kind, tuple(v.shape))].prepared.state
            try:
                type(state)._check_input(state, v)
                lib[kind] = be._runtime.should_allreduce(v)
            except ValueError as err:
                lib[kind] = False
                lib[f"{kind}_error"] = str(err)
        before = dict(be.path_counts)
        summed = be.all_reduce(v)
        normed, _ = be.all_reduce_residual_rmsnorm(v, torch.zeros(v.shape), torch.ones(H), base.EPS)
        gathered = [torch.empty(v.shape) for _ in range(2)]
        torch.distributed.all_gather(gathered, v.contiguous(), group=be.cpu_group)
        keys = ("all_reduce", "fallback_all_reduce", "fused", "fallback")
        paths = {k: be.path_counts[k] - before.get(k, 0) for k in keys}
        res[name] = {
            "lib": lib,
            "is_contiguous": v.is_contiguous(),
            "stride": list(v.stride()),
            "shape": list(v.shape),
            "ours_plain": be._ready("plain", v) is not None,
            "ours_fused": be._ready("fused", v) is not None,
            "paths": paths,
            "sum_ok": check_close(summed, sum(gathered), torch.float32)[0],
            "normed_shape": list(normed.shape),
        }
    v = _layouts()["view_1_stride_2H"]
    try:
        be._runtime.all_reduce(v, plan=be._plans[("plain", (1, H))], out=torch.empty(1, H))
        res["library_on_view"] = "ran"
    except ValueError as err:
        res["library_on_view"] = f"ValueError: {err}"
    out["layouts"] = res


PATCH_SHAPES = [(4, H), (8, H), (40, H)]  # verify rows as the rank step passes them (40 > 36)


def _count_preparation(real, calls: dict) -> None:
    """Count every call of the library's preparation entry points the backend resolves: the two
    prepare-call builders (``_oneshot_preparation.py``) and ``query_from_runtime`` per surface."""

    def counting(name: str, fn):
        def builder(*args, **kw):
            calls[name] = calls.get(name, 0) + 1
            return fn(*args, **kw)

        return builder

    for name in ("_prepare_plain_call", "_prepare_fused_call"):
        setattr(real.op, name, counting(name, getattr(real.op, name)))
    pcie = sys.modules["flashinfer.experimental.b12x.comm.pcie"]

    def query(runtime, *, surface, call, _fn=pcie.query_from_runtime):
        calls[surface] = calls.get(surface, 0) + 1
        return _fn(runtime, surface=surface, call=call)

    pcie.query_from_runtime = query


def _scenario_patch(rank: int, world: int, coordinator, real, out: dict):
    """The patch's own build and prepare of the add-norm slot (``install.default_factory`` ->
    ``rank.make_for_rank`` -> ``slots.create_together``, as the rank step runs it), counting
    the library's preparation calls. Stood in: the device choice (a CPU box gets the gloo
    stand-in) and the context's GPU facts (SM120, proven P2P)."""
    from fastverify.patch import install, rank as R, slots

    calls: dict = {}
    _count_preparation(real, calls)
    R.backend_for_device = lambda kind, device_type: BackendName(kind)
    R.context_from_coordinator = lambda coord, **kw: ProbeContext(
        world_size=world,
        device_type="cpu",
        dtype=torch.float32,
        group_backend="gloo",
        sm=(12, 0),
        p2p_ok=True,
        single_node=True,
    )
    coordinator.world_size, coordinator.rank_in_group = world, rank
    slot = slots.ADD_NORM_SLOT
    slot.factory = install.default_factory(slot, modules={})
    probe = install.Probe((40, H), "cpu", torch.float32, is_cuda=False)
    be = slots.create_together(slot, coordinator, probe, PATCH_SHAPES)
    x, residual, weight = base.inputs(rank, 4, torch.float32)
    xs = [base.inputs(r, 4, torch.float32)[0] for r in range(world)]
    normed, res_out = be.all_reduce_residual_rmsnorm(x, residual, weight, base.EPS)
    want = base.reference_residual_rmsnorm(xs, residual, weight, base.EPS)
    out.update(
        kind=slot.kind.value,
        slot_prepared=slot.prepared,
        calls=calls,
        prepared={k: sorted(map(list, v)) for k, v in be.prepared_shapes.items()},
        supports={str(r): be.supports(torch.zeros(r, H)) for r, _ in PATCH_SHAPES},
        fused_ok=[check_close(normed, want[0], torch.float32)[0], check_close(res_out, want[1], torch.float32)[0]],
    )
    slot.backend = slot.factory = None
    return be


def _worker(rank: int, world: int, scenario: str, root: Path) -> dict:
    import torch.distributed as dist

    real = base.import_b12x(root)
    record: list = []
    fail = {"rank": 1, "compile": ["fused", 4]} if scenario == "compile_fails" else None
    fakes = base.standins(real, record, fail)
    base.install_modules(real, fakes)
    ipc.check_cuda = lambda ctx: None  # the one probe fact a CPU box cannot have
    device, cpu, coordinator = _sglang_groups(dist)
    exchanges: list = []
    _spy_exchanges(dist, device, cpu, exchanges)
    out: dict = {}
    if scenario == "patch":
        with _scenario_patch(rank, world, coordinator, real, out) as be:
            out.update(disabled_reason=be.disabled_reason, paths=dict(be.path_counts))
        fakes.Runtime.live.clear()
        out.update(record=record)
        del be, coordinator
        return out
    with _backend(world, device) as be:
        out["cpu_group_is_sglangs"] = be.cpu_group is cpu
        {"compile_fails": _scenario_compile_fails, "strides": _scenario_strides}[scenario](be, rank, out)
        out.update(
            disabled_reason=be.disabled_reason,
            barrier_calls=[list(c) for c in be.barrier_calls],
            paths=dict(be.path_counts),
        )
    fakes.Runtime.live.clear()  # no ProcessGroup reference may outlive destroy_process_group
    out.update(record=record, exchanges=exchanges)
    del be, coordinator
    return out


def _rank(rank: int, world: int, out_dir: Path, scenario: str) -> dict:
    """One gloo rank of ``run_ranks`` (tests/rank_harness.py)."""
    import torch.distributed as dist

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(message)s")
    out = _worker(rank, world, scenario, out_dir / "fi")
    dist.barrier()
    return out


def run_ranks(tmp_path: Path, scenario: str, world: int = 2) -> tuple[list[dict], list[str], float]:
    """Both ranks' results and output; fails (killing both) when either runs past TIMEOUT_S."""
    if not os.environ.get(base.WHEEL_ENV):
        pytest.skip(NO_WHEEL)
    base.extract_b12x(os.environ[base.WHEEL_ENV], tmp_path / "fi")
    run = rank_harness.run_ranks(_rank, world, tmp_path, scenario, timeout_s=TIMEOUT_S, hang="b12x start-up hung")
    return run.results(), run.logs, run.elapsed


# --- tests ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compile_fails(tmp_path_factory):
    return run_ranks(tmp_path_factory.mktemp("b12x_compile"), "compile_fails")


def test_compile_failure_on_one_rank_ends_on_every_rank_without_a_hang(compile_fails):
    """Rank 1's compile of the fused 4-row request raises after the real session authorized it
    and ran the barrier hook (session.py ``_install_obligation``: ``yield item.collective``, then
    ``_instantiate(compile_directly=True)``). Both ranks end, within TIMEOUT_S, with the one line."""
    outs, logs, elapsed = compile_fails
    assert elapsed < TIMEOUT_S
    for rank, (out, log) in enumerate(zip(outs, logs)):
        reason = NOT_BUILT.match(out["disabled_reason"] or "")
        why = f"rank 1: fastverify.b12x.fused.4x{H}: OutOfMemoryError: CUDA out of memory"
        assert reason and reason.group(1).startswith(why), out
        assert [ln for ln in log.splitlines() if "b12x not built" in ln] == [out["disabled_reason"]], log
        assert out["after"]["all_reduce"][0] and out["after"]["fused"]  # every call falls back, still correct
        assert out["paths"] == {"fallback_all_reduce": 2, "fallback": 1}


def test_no_rank_launches_the_request_that_failed_to_compile(compile_fails):
    """The three requests before it were primed on both ranks (stand-in kernel ran); the failing
    one was compiled on rank 0 but launched nowhere: rank 0's vote after its bind met rank 1's
    ``fail`` in the same round."""
    outs, _, _ = compile_fails
    names = [f"fastverify.b12x.{k}.{r}x{H}" for r, k in ((1, "plain"), (1, "fused"), (4, "plain"), (4, "fused"))]
    for rank, out in enumerate(outs):
        launches = [e for e in out["record"] if e[0] in ("plain", "fused")]
        assert launches[:3] == [["plain", 1], ["fused", 1], ["plain", 4]], launches
        assert ["fused", 4] not in launches
        assert ["compile", "fused", 4] in out["record"]  # attempted on both; raised on rank 1
        assert not any(e[0] == "prepared" for e in out["record"])
        assert [c[0] for c in out["barrier_calls"]] == names  # the hook ran for the failing request too
    last = [[m for where, _, m in out["exchanges"]][-1] for out in outs]
    assert last[0] == ["bound", names[3]] and last[1][0] == "fail"


def test_barrier_hook_is_the_sessions_and_votes_only_on_sglangs_cpu_group(compile_fails):
    """The hook handed to the real ``PreparationSession(collective_barrier=...)`` is called by the
    library on its own thread (``PreparationJob._collective_barrier``) and exchanges on SGLang's
    ``cpu_group``; no vote of any kind runs on the device (NCCL) group."""
    outs, _, _ = compile_fails
    for out in outs:
        assert out["cpu_group_is_sglangs"]
        hooked = [e for e in out["record"] if e[0] == "barrier"]
        assert hooked and all(e[2] == [0, 1] and e[3] for e in hooked)  # [.., ranks, off the main thread]
        on_thread = [e for e in out["exchanges"] if not e[1]]
        assert [m for _, _, m in on_thread] == [["barrier", c[0]] for c in out["barrier_calls"]]
        assert {where for where, _, _ in out["exchanges"]} == {"cpu"}


def test_the_patch_prepares_no_plain_plan(tmp_path):
    """The patch's add-norm slot calls only the fused kernel (at most 36 rows), so its start-up
    asks the library for fused plans only: no plain-surface query, no ``_prepare_plain_call``,
    no plain compile; the 40-row verify shape gets nothing. The slot still takes a prepared
    shape through the fused kernel, summed over both ranks."""
    outs, _, _ = run_ranks(tmp_path, "patch")
    fused = f"fastverify.b12x.fused.{{}}x{H}"
    for out in outs:
        assert out["kind"] == "b12x" and out["slot_prepared"] and out["disabled_reason"] is None
        assert out["calls"] == {b12x_backend.FUSED_SURFACE: 2, "_prepare_fused_call": 2}, out["calls"]
        assert [e for e in out["record"] if e[0] == "compile"] == [["compile", "fused", 4], ["compile", "fused", 8]]
        assert [e[1] for e in out["record"] if e[0] == "prepared"] == [fused.format(4), fused.format(8)]
        assert out["prepared"] == {"plain": [], "fused": [[4, H], [8, H]]}
        assert out["supports"] == {"4": True, "8": True, "40": False}
        assert out["fused_ok"] == [True, True] and out["paths"] == {"fused": 1}


@pytest.fixture(scope="module")
def strides(tmp_path_factory):
    return run_ranks(tmp_path_factory.mktemp("b12x_strides"), "strides")[0]


def test_readiness_follows_the_plans_stride_rule(strides):
    """For every layout, fastverify's ``_ready`` takes a tensor exactly when the real prepared
    state's ``_check_input`` (``_oneshot_preparation.py``) and ``should_allreduce`` do; a refused
    tensor takes the counted fallback and is still summed over both ranks."""
    for out in strides:
        assert out["disabled_reason"] is None
        for name, row in out["layouts"].items():
            if name == "library_on_view":
                continue
            assert row["ours_plain"] == row["lib"]["plain"] and row["ours_fused"] == row["lib"]["fused"], (name, row)
            assert row["sum_ok"] and row["normed_shape"] == row["shape"], (name, row)
            # all_reduce once, and once inside the fused call's fallback when the fused plan refuses
            paths = row["paths"]
            assert paths.get("all_reduce", 0) == row["ours_plain"] * (1 + (not row["ours_fused"])), (name, row)
            assert paths.get("fallback_all_reduce", 0) == (not row["ours_plain"]) * (1 + (not row["ours_fused"]))
            assert paths.get("fused", 0) == row["ours_fused"] and paths.get("fallback", 0) == (not row["ours_fused"])
    assert not all(row["lib"]["plain"] for name, row in strides[0]["layouts"].items() if name != "library_on_view")


def test_a_1_by_h_view_with_row_stride_2h_falls_back_instead_of_crashing(strides):
    """``(1, H)`` with stride ``(2H, 1)`` passes ``is_contiguous()`` but not the plan's exact
    stride comparison (``_OneshotExecutionState._check_input``), which the library raises from
    inside ``all_reduce``; fastverify refuses it up front. A contiguous ``(1, H)`` passes both."""
    for out in strides:
        view, plain = out["layouts"]["view_1_stride_2H"], out["layouts"]["contiguous_1"]
        assert view["is_contiguous"] and view["stride"] == [2 * H, 1]
        assert view["lib"] == {
            "plain": False,
            "plain_error": "oneshot input metadata differs from the prepared plan",
            "fused": False,
            "fused_error": "oneshot input metadata differs from the prepared plan",
        }
        assert not view["ours_plain"] and not view["ours_fused"] and view["sum_ok"]
        assert view["paths"] == {"fallback_all_reduce": 2, "fallback": 1, "all_reduce": 0, "fused": 0}
        assert out["layouts"]["library_on_view"] == "ValueError: oneshot input metadata differs from the prepared plan"
        assert plain["lib"] == {"plain": True, "fused": True} and plain["ours_plain"] and plain["ours_fused"]
        assert plain["paths"] == {"all_reduce": 1, "fused": 1, "fallback_all_reduce": 0, "fallback": 0}


def test_plan_takes_is_the_real_check_input(tmp_path):
    """In one process, without a session: ``plan_takes`` on a real ``_OneshotExecutionState``
    installed in a real plan agrees with that state's ``_check_input`` for layouts, dtypes and
    devices; a plan with nothing prepared takes nothing."""
    if not os.environ.get(base.WHEEL_ENV):
        pytest.skip(NO_WHEEL)
    root = base.extract_b12x(os.environ[base.WHEEL_ENV], tmp_path / "fi")
    before = set(sys.modules)
    try:
        real = base.import_b12x(root)
        rt = base.standins(real, []).Runtime.make(
            rank=0,
            world_size=2,
            group=None,
            device="cpu",
            max_size=64 * H * 4,
            eager_buffer_bytes=64 * H * 4,
            stream_affine=False,
        )
        for shape in ((1, H), (4, H)):
            query = real.op.query_from_runtime(rt, surface=b12x_backend.PLAIN_SURFACE, call={"inp": torch.zeros(shape)})
            plan = real.op.plan(query, runtime=rt)
            assert not b12x_backend.plan_takes(plan, torch.zeros(shape))
            variants = tuple(tuple(v) for v in query.setup["variants"])
            state = real.op._OneshotExecutionState(query, rt, types.MappingProxyType({v: "l" for v in variants}))
            plan._install(
                real.types._Prepared(
                    state=state,
                    selection=None,
                    programs=frozenset(),
                    retained=None,
                    owners=(),
                    closers=(),
                    device=real.device.detect_device(None),
                    scratch=(),
                )
            )
            rows = shape[0]
            cases = [
                torch.zeros(shape),
                torch.zeros(rows, 2 * H)[:, :H],
                torch.zeros(shape, dtype=torch.bfloat16),
                torch.zeros(H, rows).t(),
                torch.zeros(rows + 1, H)[1:],
                torch.zeros(1, H).expand(rows, H),
            ]
            for x in cases:
                try:
                    state._check_input(x)
                    lib = True
                except ValueError:
                    lib = False
                assert b12x_backend.plan_takes(plan, x) == lib, (shape, tuple(x.stride()), x.dtype)
            plan._clear()
    finally:
        while str(root) in sys.path:
            sys.path.remove(str(root))
        for name in set(sys.modules) - before:
            if name.split(".")[0] in ("b12x", "flashinfer"):
                del sys.modules[name]


def test_sglang_keeps_its_coordinators_cpu_group_where_we_look():
    """SGLang 0.5.23 ``parallel_state.py``: ``_groups`` maps names to ``weakref.ref`` of each
    ``GroupCoordinator`` (``_register_group``), which holds ``device_group`` and a gloo
    ``cpu_group`` (what :func:`sglang_cpu_group` reads)."""
    wheel = os.environ.get("FASTVERIFY_SGLANG_WHEEL")
    if not wheel:
        pytest.skip("set FASTVERIFY_SGLANG_WHEEL to the sglang 0.5.23 wheel to check parallel_state.py")
    with zipfile.ZipFile(wheel) as z:
        src = z.read("sglang/srt/distributed/parallel_state.py").decode()
    assert b12x_backend.MOD_PARALLEL_STATE == "sglang.srt.distributed.parallel_state"
    assert '_groups: Dict[str, Callable[[], Optional["GroupCoordinator"]]] = {}' in src
    assert "_groups[group.unique_name] = weakref.ref(group)" in src
    assert "self.device_group = device_group" in src and "self.cpu_group = cpu_group" in src
    assert re.search(r"cpu_group = torch\.distributed\.new_group\(\s*ranks,\s*backend=\"gloo\"", src)
