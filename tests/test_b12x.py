"""The b12x backend (``fastverify.backends.flashinfer_b12x``) against FlashInfer 0.7.4's own code.

The b12x package in the wheel (``flashinfer/experimental/b12x/``, importable as ``b12x``) is
extracted from ``$FASTVERIFY_FLASHINFER_WHEEL`` and its CPU-runnable parts are run for real:

* the 36-row rule: ``comm/pcie/_oneshot_preparation.py`` ``query_from_runtime`` and
  ``query_from_metadata``, on a real ``PCIeOneshotAllReduce`` runtime state built by the real
  ``_CuTeOneshotBackend`` (``comm/pcie/pcie_oneshot.py``), its CUDA-only pieces swapped for CPU ones;
* the SM gate: ``comm/pcie/api.py`` ``is_supported`` with ``_lib/gating.py`` ``is_b12x``, under a
  monkeypatched ``torch.cuda.get_device_capability``;
* the world sizes and dtypes: constants read with ``ast``;
* on a 2-rank gloo group: the real ``query_from_runtime``/``plan``, ``Plan.request``,
  ``CollectiveRequirement``, ``_OneshotExecutionState``, ``_prepare_plain_call``/``_prepare_fused_call``,
  ``types._prime``, the real public ``all_reduce``/``all_reduce_fused_add_rms_norm`` input checks and
  ``PreparationSession``'s real loop (``preparation/session.py``: coordinator, ``collective_barrier``
  hook, materialize, bind, prime). What cannot run on CPU is a stand-in: the kernels (a gloo
  all-reduce + fp32 add + RMSNorm that refuses more than 36 rows, as ``_oneshot_preparation.py``
  states), their compilation (``_oneshot_preparation.compile_oneshot_surface`` / ``load_programs``:
  CuTe DSL and Triton, absent here; Triton's observer hook in ``_lib/compile_plan.py`` is marked
  installed), the plan's declared device (``_configure`` takes only CUDA declarations: it reads
  ``cuda`` while the tensors stay on CPU), the CUDA IPC setup/teardown, and ``require_prepared``'s
  CUDA-device check.

The ranks are started by ``tests/rank_harness.py``; each runs ``_rank`` with a scenario name.
"""

from __future__ import annotations

import ast
import gc
import os
import sys
import threading
import types
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import pytest  # noqa: E402
import rank_harness  # noqa: E402
import torch  # noqa: E402

from fastverify.backends import (  # noqa: E402
    BackendName,
    ProbeContext,
    check_close,
    flashinfer_b12x as b12x_backend,  # noqa: E402
    ipc,  # noqa: E402
    make_backend,
    probe,
    reference_residual_rmsnorm,
)
from fastverify.backends.probing import check_kernel_sm  # noqa: E402
from fastverify.registry import backend_info  # noqa: E402

WHEEL_ENV = "FASTVERIFY_FLASHINFER_WHEEL"
B12X_DIR = "flashinfer/experimental/b12x/"
PCIE_DIR = B12X_DIR + "comm/pcie/"
HIDDEN, EPS = 8, 1e-6
MAX_NUMEL = 40 * HIDDEN
SHAPES = [(4, HIDDEN), (36, HIDDEN), (37, HIDDEN), (40, HIDDEN)]  # prepared; (5, HIDDEN) is not
CALL_ROWS = (4, 36, 37, 40, 5)
INFO = backend_info(BackendName.b12x)


# --- the wheel's b12x ------------------------------------------------------------------------------


def extract_b12x(wheel: str, dest: Path) -> Path:
    """Unpack the b12x files (and the ``flashinfer`` package markers its alias shim looks for)."""
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            if name.startswith(("b12x/", B12X_DIR)) or name in (
                "flashinfer/__init__.py",
                "flashinfer/experimental/__init__.py",
            ):
                z.extract(name, dest)
    return dest


def import_b12x(root: Path) -> types.SimpleNamespace:
    """Import the wheel's b12x modules that run on CPU (no CuTe kernel is imported)."""
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    import importlib

    names = {
        "po": "b12x.comm.pcie.pcie_oneshot",
        "op": "b12x.comm.pcie._oneshot_preparation",
        "prep": "b12x.comm.pcie._preparation",
        "types": "b12x.preparation.types",
        "device": "b12x.preparation.device",
        "gating": "b12x._lib.gating",
        "session": "b12x.preparation.session",
        "compile_plan": "b12x._lib.compile_plan",
    }
    return types.SimpleNamespace(**{k: importlib.import_module(v) for k, v in names.items()})


def wheel_source(relpath: str) -> str:
    with zipfile.ZipFile(os.environ[WHEEL_ENV]) as z:
        return z.read(relpath).decode()


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    if not os.environ.get(WHEEL_ENV):
        pytest.skip(f"set {WHEEL_ENV} to the flashinfer-python 0.7.4 wheel to run b12x's own code")
    root = extract_b12x(os.environ[WHEEL_ENV], tmp_path_factory.mktemp("fi"))
    before = set(sys.modules)
    try:
        yield import_b12x(root)
    finally:
        # The extracted tree holds a partial ``flashinfer`` package: leave neither it on sys.path nor
        # its modules imported, or later tests see a broken ``import flashinfer``.
        while str(root) in sys.path:
            sys.path.remove(str(root))
        for name in set(sys.modules) - before:
            if name.split(".")[0] in ("b12x", "flashinfer"):
                del sys.modules[name]


# --- stand-ins for what needs CUDA -------------------------------------------------------------------


def standins(real: types.SimpleNamespace, record: list, fail: dict | None = None) -> types.SimpleNamespace:
    """The real runtime class with CPU tensors and a gloo kernel; the real session, compiling nothing."""
    import torch.distributed as dist

    po = real.po

    class CpuExt(po._CuTeOneshotBackend):
        """The real pure-Python extension adapter; only its CUDA assertions differ."""

        def init_custom_ar(self, signal_ptrs, rank_data, rank):  # the real one wants CUDA rank_data
            state = po._CuTeOneshotState(
                rank=int(rank),
                world_size=len(signal_ptrs),
                signal_ptrs=tuple(int(p) for p in signal_ptrs),
                rank_data=rank_data,
                signal_table_address=int(rank_data.data_ptr()),
                next_table_offset=po._POINTER_TABLE_BYTES,
                registered_tables={},
            )
            self._write_table(state, state.signal_ptrs, offset=0)
            handle = self._next_handle
            self._next_handle += 1
            self._states[handle] = state
            return handle

        @staticmethod
        def _device_index(device):  # the real one asks torch.cuda for an index-less device
            return device.index

    class Runtime(po.PCIeOneshotAllReduce):
        live: list = []

        @classmethod
        def make(cls, *, rank, world_size, group, device, max_size, eager_buffer_bytes, stream_affine):
            if world_size not in po.SUPPORTED_WORLD_SIZES or max_size > eager_buffer_bytes:
                raise ValueError("stand-in: arguments the real from_exchange_group refuses")
            ptrs = tuple(range(1, world_size + 1))
            runtime, err = cls._from_prepared_factory(
                rank=rank,
                world_size=world_size,
                device=torch.device(device),
                signal_ptrs=ptrs,
                eager_buffer_ptrs0=tuple(p + 100 for p in ptrs),
                eager_buffer_ptrs1=tuple(p + 200 for p in ptrs),
                eager_buffer_bytes=eager_buffer_bytes,
                transport_policy=po._transport_policy_contract(),
                exchange_group=group,
                ipc=None,
                owned_buffers=(),
                max_size=max_size,
                rank_data_bytes=4096,
                ext_module=CpuExt(),
                stream_affine=stream_affine,
            )
            if err is not None:
                raise err
            cls.live.append(runtime)
            return runtime

        @classmethod
        def from_exchange_group(
            cls,
            *,
            exchange_group,
            device,
            eager_buffer_bytes=po.DEFAULT_MAX_SIZE,
            max_size=po.DEFAULT_MAX_SIZE,
            rank_data_bytes=po.DEFAULT_RANK_DATA_BYTES,
            ext_module=None,
            stream_affine=True,
        ):
            record.append(
                [
                    "from_exchange_group",
                    {"max_size": max_size, "eager_buffer_bytes": eager_buffer_bytes, "stream_affine": stream_affine},
                ]
            )
            return cls.make(
                rank=dist.get_rank(exchange_group),
                world_size=dist.get_world_size(exchange_group),
                group=exchange_group,
                device=device,
                max_size=max_size,
                eager_buffer_bytes=eager_buffer_bytes,
                stream_affine=stream_affine,
            )

        # The kernels: what the CuTe launchers compute, as a gloo all-reduce in fp32.
        def _run_prepared_plain(self, inp, out, query, launchers):
            self._prepared_launcher(launchers, inp)  # real: the slot variant must have been prepared
            record.append(["plain", int(inp.shape[0])])
            acc = inp.float().clone()
            dist.all_reduce(acc, group=self.exchange_group)
            out.copy_(acc)

        def _run_prepared_fused(self, inp, residual, weight, out, residual_out, epsilon, query, launchers):
            self._prepared_launcher(launchers, inp)
            rows = inp.numel() // int(inp.shape[-1])
            # _oneshot_preparation.py: "fused allreduce RMSNorm supports at most 36 rows"; the
            # launcher is built for exactly query.call["rows"] rows.
            if rows > 36 or rows != query.call["rows"]:
                raise ValueError("fused allreduce RMSNorm supports at most 36 rows")
            record.append(["fused", rows])
            acc = inp.float().clone()
            dist.all_reduce(acc, group=self.exchange_group)
            r = (acc + residual.float()).to(inp.dtype)
            residual_out.copy_(r)
            rf = r.float()
            out.copy_(rf * torch.rsqrt(rf.pow(2).mean(-1, keepdim=True) + epsilon) * weight.float())

        def close(self):  # the real close also unmaps CUDA IPC; it barriers on the group
            if getattr(self, "_coordinated_close_complete", False):
                return
            record.append(["close"])
            self._closed = True
            self._ext.dispose(self._ptr)
            if self.exchange_group is not None:
                dist.barrier(group=self.exchange_group)
            self._coordinated_close_complete = True

    def query_from_runtime(runtime, *, surface, call):
        inp = call["inp"]
        if (
            fail
            and fail.get("rank") == runtime.rank
            and tuple(inp.shape) == tuple(fail.get("shape", ()))
            and surface.endswith("rms_norm")
        ):
            raise ValueError("stand-in: this rank fails to plan the shape")
        return real.prep.query_from_runtime(runtime, surface=surface, call=call)

    return types.SimpleNamespace(
        Runtime=Runtime, query_from_runtime=query_from_runtime, **vars(session_and_compile(real, record, fail))
    )


def session_and_compile(real: types.SimpleNamespace, record: list, fail: dict | None) -> types.SimpleNamespace:
    """The real ``PreparationSession`` (recording), and stand-ins for kernel compilation and the
    plan's declared device: what its loop needs CUDA for (Triton's hook: ``install_modules``)."""

    class Session(real.session.PreparationSession):
        """The real PreparationSession (preparation/session.py), its loop untouched; it records its
        construction, every call of the embedder's barrier hook (and on which thread), what it
        prepared and its close."""

        def __init__(self, **kw):
            record.append(["session", {k: kw.get(k) for k in ("autotune", "compile_workers")}])
            hook = kw.get("collective_barrier")
            if hook is not None:

                def barrier(key, ranks, hook=hook):
                    off_main = threading.current_thread() is not threading.main_thread()
                    record.append(["barrier", key, list(ranks), off_main])
                    return hook(key, ranks)

                kw["collective_barrier"] = barrier
            super().__init__(**kw)

        def prepare(self, requests, **kw):
            requests = tuple(requests)
            result = super().prepare(requests, **kw)
            record.extend(["prepared", r.name, list(r.collective.ranks)] for r in requests)
            return result

        def close(self):
            super().close()
            record.append(["session_close"])

    def compile_surface(query_payload, ordinal):
        """For ``_oneshot_preparation.compile_oneshot_surface`` (CuTe, under ``torch.cuda.device``):
        one launcher token per slot variant the query declares; ``fail["compile"]`` = ``[kind,
        rows]`` makes this rank's compile of that request raise, as an OOM would."""
        payload = dict(query_payload)
        setup = dict(payload["setup"])
        kind = "fused" if payload["surface"] == b12x_backend.FUSED_SURFACE else "plain"
        record.append(["compile", kind, int(setup["rows"])])
        if fail and fail.get("rank") == payload["rank"] and fail.get("compile") == [kind, int(setup["rows"])]:
            raise torch.OutOfMemoryError("CUDA out of memory (stand-in: this rank's kernel compile fails)")
        return {tuple(v): ("launcher", kind, tuple(v)) for v in setup["variants"]}

    def plan(query, *, runtime, **kw):
        made = real.prep.plan(query, runtime=runtime, **kw)
        # session.py _configure: "declaration and session devices differ" unless the declaration
        # is CUDA; the CPU session's ordinal is None, as torch.device("cuda").index.
        object.__setattr__(made, "_device", torch.device("cuda"))
        return made

    return types.SimpleNamespace(Session=Session, compile_surface=compile_surface, plan=plan)


def install_modules(real: types.SimpleNamespace, fakes: types.SimpleNamespace) -> None:
    """Put the real objects and the stand-ins where ``ExternalCall.resolve`` imports them."""
    prefix = "flashinfer.experimental.b12x"
    pkg = types.ModuleType("flashinfer")
    pkg.__version__ = "0.7.4"
    gating = types.ModuleType(f"{prefix}._lib.gating")
    gating.has_cutlass_dsl = lambda minimum=real.gating.MIN_CUTLASS_DSL: True  # no CuTe on this machine
    gating.MIN_CUTLASS_DSL = real.gating.MIN_CUTLASS_DSL
    pcie = types.ModuleType(f"{prefix}.comm.pcie")
    pcie.is_supported = lambda device=None: True  # the SM gate is tested from the real source below
    pcie.OneshotAllReduce = fakes.Runtime
    pcie.query_from_runtime = fakes.query_from_runtime
    pcie.plan = fakes.plan
    prep = types.ModuleType(f"{prefix}.preparation")
    prep.Plan = real.types.Plan
    prep.CollectiveRequirement = real.types.CollectiveRequirement
    prep.PreparationSession = fakes.Session
    sys.modules.update(
        {
            "flashinfer": pkg,
            gating.__name__: gating,
            pcie.__name__: pcie,
            prep.__name__: prep,
            f"{prefix}.comm.pcie._oneshot_preparation": real.op,
        }
    )
    # What compiles and loads kernels (CuTe DSL, Triton: absent here). Triton's observer hook
    # (_lib/compile_plan.py _ensure_triton_hook, imports triton) is marked installed.
    real.op.compile_oneshot_surface = fakes.compile_surface
    real.op.load_programs = lambda value: value
    real.compile_plan._TRITON_HOOK = object()
    # require_prepared's last check is "tensor on the plan's CUDA device"; everything else is real.
    real_require = real.types.require_prepared
    real.po.require_prepared = lambda plan, component_id, device=None: real_require(plan, component_id, None)


# --- workers -----------------------------------------------------------------------------------------


def inputs(rank: int, rows: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(1000 * rows + rank)
    x = torch.randn(rows, HIDDEN, generator=gen)
    gen = torch.Generator().manual_seed(7 * rows)
    residual = torch.randn(rows, HIDDEN, generator=gen)
    weight = 1 + 0.1 * torch.randn(HIDDEN, generator=gen)
    return x.to(dtype), residual.to(dtype), weight.to(dtype)


def _worker(rank: int, world: int, scenario: str, root: Path) -> dict:
    real = import_b12x(root)
    record: list = []
    fail = {"rank": 1, "shape": (36, HIDDEN)} if scenario == "fail" else None
    fakes = standins(real, record, fail)
    install_modules(real, fakes)
    # CUDA is the one probe fact this machine cannot have; the rest (SM from the context,
    # library_status through the ExternalCall tables) runs as on a GPU box.
    ipc.check_cuda = lambda ctx: None
    out: dict = {"dtypes": {}}
    for dtype in (torch.float32, torch.bfloat16):
        ctx = ProbeContext(
            world_size=world,
            device_type="cpu",
            dtype=dtype,
            group_backend="gloo",
            sm=(12, 0),
            p2p_ok=True,
            single_node=True,
        )
        record.clear()
        with make_backend(
            BackendName.b12x, None, device="cpu", dtype=dtype, max_numel=MAX_NUMEL, hidden=HIDDEN, context=ctx
        ) as be:
            be.prepare(SHAPES)
            res = {
                "disabled_reason": be.disabled_reason,
                "prepared": {k: sorted(map(list, v)) for k, v in be.prepared_shapes.items()},
                "supports": {str(r): be.supports(torch.zeros(r, HIDDEN, dtype=dtype)) for r in (4, 5, 40)},
                "calls": {},
            }
            for rows in CALL_ROWS:
                x, residual, weight = inputs(rank, rows, dtype)
                x0, r0 = x.clone(), residual.clone()
                normed, res_out = be.all_reduce_residual_rmsnorm(x, residual, weight, EPS)
                summed = be.all_reduce(x)
                xs = [inputs(r, rows, dtype)[0] for r in range(world)]
                want_norm, want_res = reference_residual_rmsnorm(xs, residual, weight, EPS)
                res["calls"][str(rows)] = {
                    "normed": check_close(normed, want_norm, dtype),
                    "residual_out": check_close(res_out, want_res, dtype),
                    "all_reduce": check_close(summed, sum(x.float() for x in xs), dtype),
                    "inputs_unchanged": bool(torch.equal(x, x0) and torch.equal(residual, r0)),
                    "dtypes": [str(t.dtype) for t in (normed, res_out, summed)],
                }
            res["paths"] = dict(be.path_counts)
        res["closed"] = be.closed
        res["record"] = list(record)
        out["dtypes"][str(dtype)] = res
        res["runtime_released"] = be._runtime is None
        del be
    fakes.Runtime.live.clear()
    gc.collect()  # no ProcessGroup reference may outlive destroy_process_group (abort at exit)
    return out


def _rank(rank: int, world: int, out_dir: Path, scenario: str) -> dict:
    """One gloo rank of ``run_ranks`` (tests/rank_harness.py)."""
    import torch.distributed as dist

    out = _worker(rank, world, scenario, out_dir / "fi")
    dist.barrier()
    return out


def run_ranks(tmp_path: Path, scenario: str, world: int = 2, timeout_s: float = 180) -> list[dict]:
    if not os.environ.get(WHEEL_ENV):
        pytest.skip(f"set {WHEEL_ENV} to the flashinfer-python 0.7.4 wheel to run b12x's own code")
    extract_b12x(os.environ[WHEEL_ENV], tmp_path / "fi")
    return rank_harness.run_ranks(_rank, world, tmp_path, scenario, timeout_s=timeout_s).results()


# --- the library's own rules, run from the wheel ------------------------------------------------------


def test_row_limit_is_the_libraries(real):
    """The real query functions accept the fused surface up to 36 rows and refuse beyond; our bound
    and the registry's switch exactly there (the plain surface takes every size that fits)."""
    Runtime = standins(real, []).Runtime
    rt = Runtime.make(
        rank=0,
        world_size=2,
        group=None,
        device="cpu",
        max_size=64 * HIDDEN * 4,
        eager_buffer_bytes=64 * HIDDEN * 4,
        stream_affine=False,
    )
    accepted = {}
    for rows in range(1, 48):
        x = torch.zeros(rows, HIDDEN)
        got = []
        for query in (
            lambda: real.op.query_from_runtime(rt, surface=b12x_backend.FUSED_SURFACE, call={"inp": x}),
            lambda: real.op.query_from_metadata(
                rt, surface=b12x_backend.FUSED_SURFACE, shape=(rows, HIDDEN), dtype=torch.float32
            ),
        ):
            try:
                q = query()
                assert q.call["rows"] == rows
                got.append(True)
            except ValueError as err:
                assert "at most 36 rows" in str(err)
                got.append(False)
        assert got[0] == got[1]
        accepted[rows] = got[0]
        real.op.query_from_runtime(rt, surface=b12x_backend.PLAIN_SURFACE, call={"inp": x})  # never refused
    assert accepted == {rows: b12x_backend.fused_fits(rows) for rows in accepted}
    assert max(r for r, ok in accepted.items() if ok) == b12x_backend.MAX_ROWS == INFO.max_rows == 36
    # 4 draft tokens: batch 9 is the largest verify step that fits.
    assert b12x_backend.fused_fits(9 * 4) and not b12x_backend.fused_fits(10 * 4)


def test_row_limit_literal_in_source():
    """Every ``rows > N`` test in _oneshot_preparation.py uses our bound (a changed rule fails here
    even where the functions above could not run)."""
    if not os.environ.get(WHEEL_ENV):
        pytest.skip(f"set {WHEEL_ENV}")
    tree = ast.parse(wheel_source(PCIE_DIR + "_oneshot_preparation.py"))
    bounds = [
        node.comparators[0].value
        for node in ast.walk(tree)
        if isinstance(node, ast.Compare)
        and isinstance(node.left, ast.Name)
        and node.left.id == "rows"
        and isinstance(node.ops[0], ast.Gt)
        and isinstance(node.comparators[0], ast.Constant)
    ]
    assert bounds == [b12x_backend.MAX_ROWS] * 2  # query_from_metadata and query_from_runtime


def _constant(tree: ast.Module, name: str) -> ast.expr:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return node.value
    raise AssertionError(f"{name} not assigned")


def test_world_sizes_and_dtypes_are_the_libraries():
    if not os.environ.get(WHEEL_ENV):
        pytest.skip(f"set {WHEEL_ENV}")
    oneshot = ast.parse(wheel_source(PCIE_DIR + "pcie_oneshot.py"))
    assert ast.literal_eval(_constant(oneshot, "SUPPORTED_WORLD_SIZES")) == INFO.world_sizes
    dtypes = {f"{e.attr}" for e in _constant(oneshot, "SUPPORTED_DTYPES").elts}
    assert dtypes == set(INFO.dtypes) == {str(d).removeprefix("torch.") for d in b12x_backend.DTYPES}
    surfaces = ast.literal_eval(_constant(ast.parse(wheel_source(PCIE_DIR + "_tuning.py")), "SURFACES"))
    assert surfaces[b12x_backend.PLAIN_SURFACE] == surfaces[b12x_backend.FUSED_SURFACE] == INFO.world_sizes


SMS = [(7, 5), (8, 0), (8, 9), (9, 0), (10, 0), (10, 3), (11, 0), (12, 0), (12, 1), (12, 2), (13, 0)]


def test_sm_gate_is_the_libraries(monkeypatch):
    """Real ``is_supported`` (api.py) over real ``is_b12x`` (gating.py) for each compute capability,
    against our probe's SM check and the registry's kernel gate."""
    if not os.environ.get(WHEEL_ENV):
        pytest.skip(f"set {WHEEL_ENV}")
    ns: dict = {"__name__": "b12x_gating"}
    exec(compile(wheel_source(B12X_DIR + "_lib/gating.py"), "gating.py", "exec"), ns)
    api = ast.parse(wheel_source(PCIE_DIR + "api.py"))
    fn = next(n for n in api.body if isinstance(n, ast.FunctionDef) and n.name == "is_supported")
    api_ns = {"is_b12x": ns["is_b12x"]}
    exec(compile(ast.Module([fn], []), "api.py", "exec"), api_ns)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    seen = set()
    for sm in SMS:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, sm=sm: sm)
        lib = api_ns["is_supported"]()
        ctx = ProbeContext(world_size=8, device_type="cuda", dtype=torch.bfloat16, sm=sm, p2p_ok=True, single_node=True)
        ours = check_kernel_sm(ctx, INFO, b12x_backend.SM_WHY)  # the probe's SM gate
        assert (ours is None) == lib == INFO.kernel_runs_on(sm), sm
        if ours is not None:
            assert f"SM{sm[0]}{sm[1]}" in ours.reason and "\n" not in ours.reason
        seen.add(lib)
    assert seen == {True, False}
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # the library also wants >= 2 GPUs
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (12, 0))
    assert api_ns["is_supported"]() is False


@pytest.mark.parametrize(
    "over,fragment",
    [
        ({"sm": (10, 0)}, "SM100"),
        ({"sm": (8, 9)}, "SM89"),
        ({"world_size": 3}, "world size 3 unsupported"),
        ({"p2p_ok": None}, "P2P status unknown"),
        ({"single_node": None}, "LOCAL_WORLD_SIZE"),
        ({"dtype": torch.float64}, "dtype float64 unsupported"),
    ],
)
def test_probe_reasons(over, fragment, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    ctx = ProbeContext(
        **{
            **dict(world_size=8, device_type="cuda", dtype=torch.bfloat16, sm=(12, 0), p2p_ok=True, single_node=True),
            **over,
        }
    )
    cap = probe(BackendName.b12x, ctx)
    assert not cap.ok and fragment in cap.reason and "\n" not in cap.reason, cap


def test_probe_without_library(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    ctx = ProbeContext(
        world_size=8, device_type="cuda", dtype=torch.bfloat16, sm=(12, 1), p2p_ok=True, single_node=True
    )
    cap = probe(BackendName.b12x, ctx)
    assert not cap.ok and cap.reason.startswith("flashinfer not importable") and "pip install" in cap.reason


# --- 2 gloo ranks: fused up to 36 rows, all-reduce + norm above, always all-reduced --------------------


@pytest.fixture(scope="module")
def ok_ranks(tmp_path_factory) -> list[dict]:
    return run_ranks(tmp_path_factory.mktemp("b12x"), "ok")


def test_fused_to_36_rows_and_fallback_above_still_all_reduces(ok_ranks):
    for out in ok_ranks:
        for dtype, res in out["dtypes"].items():
            assert res["disabled_reason"] is None
            assert res["prepared"] == {"plain": [list(s) for s in SHAPES], "fused": [[4, HIDDEN], [36, HIDDEN]]}
            for rows, call in res["calls"].items():
                for what in ("normed", "residual_out", "all_reduce"):
                    ok, err = call[what]
                    assert ok, (dtype, rows, what, err)  # the reference sums both ranks' inputs
                assert call["inputs_unchanged"] and call["dtypes"] == [dtype] * 3
            # 4 and 36 rows: fused kernel; 37 and 40: b12x all-reduce + torch norm; 5 (never
            # prepared): torch.distributed + torch norm.
            assert res["paths"] == {"fused": 2, "fallback": 3, "all_reduce": 6, "fallback_all_reduce": 2}
            assert res["supports"] == {"4": True, "5": False, "40": True}
            launches = [e for e in res["record"] if e[0] in ("plain", "fused")]
            assert max(rows for kind, rows in launches if kind == "fused") == 36
            assert [rows for kind, rows in launches[6:] if kind == "fused"] == [4, 36]  # after priming
            assert [rows for kind, rows in launches[6:] if kind == "plain"] == [4, 36, 37, 37, 40, 40]
            assert res["record"][0] == ["session", {"autotune": False, "compile_workers": 0}]
            nbytes = MAX_NUMEL * {"torch.float32": 4, "torch.bfloat16": 2}[dtype]  # max_numel elements
            assert res["record"][1] == [
                "from_exchange_group",
                {"max_size": nbytes, "eager_buffer_bytes": nbytes, "stream_affine": False},
            ]
            prepared = [e[1] for e in res["record"] if e[0] == "prepared"]
            assert prepared == [
                f"fastverify.b12x.{k}.{r}x{HIDDEN}"
                for k, r in (("plain", 4), ("fused", 4), ("plain", 36), ("fused", 36), ("plain", 37), ("plain", 40))
            ]
            assert all(e[2] == [0, 1] for e in res["record"] if e[0] == "prepared")
            # the real session called the barrier hook once per request, on its own thread, each
            # before that request compiled (session.py: authorize, barrier, materialize, prime)
            assert [e[1:] for e in res["record"] if e[0] == "barrier"] == [[n, [0, 1], True] for n in prepared]
            steps = [e[0] for e in res["record"] if e[0] in ("barrier", "compile")]
            assert steps == ["barrier", "compile"] * len(prepared)
            assert res["record"][-2:] == [["session_close"], ["close"]] and res["closed"]
            assert res["runtime_released"]
    assert ok_ranks[0]["dtypes"].keys() == ok_ranks[1]["dtypes"].keys()


def test_preparation_failure_on_one_rank_disables_on_every_rank(tmp_path):
    outs = run_ranks(tmp_path, "fail")  # rank 1 cannot plan the fused 36-row shape
    for out in outs:
        for dtype, res in out["dtypes"].items():
            assert res["disabled_reason"] == b12x_backend.not_built_line(
                f"rank 1: fastverify.b12x.fused.36x{HIDDEN}: ValueError: stand-in: this rank fails to plan the shape"
            )
            assert res["prepared"] == {"plain": [], "fused": []}
            # rank 1 failed while planning, before its session ran; rank 0's first round met its fail
            assert not any(e[0] in ("plain", "fused", "prepared", "barrier", "compile") for e in res["record"])
            for rows, call in res["calls"].items():
                assert all(call[w][0] for w in ("normed", "residual_out", "all_reduce")), (dtype, rows)
            assert res["paths"] == {"fallback": 5, "fallback_all_reduce": 10}
            assert res["record"][-1] == ["close"] and res["closed"]
