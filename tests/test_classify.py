"""Kernel classification: one table of rules (fastverify.trace.classify.RULES), checked by name.

Names come from the shared traces, from ../shared/research/profiling.md §3.5 and from the
kernel sources named in each rule. ``None`` as the expected class means "the name alone cannot
tell; the launching op decides" (RCCL's generic kernel, FlashInfer's generic names).
"""

from __future__ import annotations

import gzip
import json
import re

import pytest

from fastverify.events import EventClass
from fastverify.trace.classify import RULES, classify_name, resolve_from_op
from fastverify.trace.load import load_trace

A = EventClass.ALLREDUCE
F = EventClass.FUSED_ALLREDUCE
O = EventClass.OTHER_COMM
M = EventClass.MEMORY
U = EventClass.UNKNOWN_COMM
C = EventClass.COMPUTE
E = EventClass.EP_ALLTOALL
NEEDS_OP = None

NAMES: list[tuple[str, EventClass | None]] = [
    # --- NCCL, new names (NCCL >= 2.19; AllGather form is in the TraceLens B200 trace) -------------
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", A),
    ("ncclDevKernel_AllReduce_Sum_f32_TREE_LL(ncclDevKernelArgsStorage<4096ul>)", A),
    ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", O),
    ("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", O),
    ("ncclDevKernel_Broadcast_RING_LL(ncclDevKernelArgsStorage<4096ul>)", O),
    ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", O),
    # --- NCCL, old names (NCCL 2.17, HTA test data) ---------------------------------------------
    ("ncclKernel_AllReduce_RING_LL_Sum_float(ncclDevComm*, unsigned long, ncclWork*)", A),
    ("ncclKernel_AllReduce_RING_LL_Sum_half(ncclDevComm*, unsigned long, ncclWork*)", A),
    ("ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t(ncclDevComm*, unsigned long, ncclWork*)", O),
    # --- RCCL generic kernel: collective only from the launching op -----------------------------
    ("ncclDevKernel_Generic(ncclDevKernelArgsStorage<4096ul>)", NEEDS_OP),
    ("rcclGenericKernel<1, false>(ncclDevKernelArgsStorage<4096ul>)", NEEDS_OP),
    # --- vLLM / SGLang / aiter custom all-reduce ------------------------------------------------
    (
        "void vllm::cross_device_reduce_1stage<__nv_bfloat16, 2>(vllm::RankData*, vllm::Signal*, vllm::Signal**, __nv_bfloat16*, int, int)",
        A,
    ),
    (
        "void vllm::cross_device_reduce_2stage<__nv_bfloat16, 8>(vllm::RankData*, vllm::Signal*, vllm::Signal**, __nv_bfloat16*, int, int)",
        A,
    ),
    (
        "void sglang::cross_device_reduce_1stage<__nv_bfloat16, 8>(sglang::RankData*, sglang::Signal*, sglang::Signal**, __nv_bfloat16*, int, int)",
        A,
    ),
    (
        "void aiter::cross_device_reduce_2stage_naive<__hip_bfloat16, 8>(aiter::RankData*, aiter::RankSignals, aiter::Signal*, __hip_bfloat16*, int, int)",
        A,
    ),
    # --- FlashInfer / TensorRT-LLM fused all-reduce + residual + RMSNorm ------------------------
    (
        "void flashinfer::trtllm_allreduce_fusion::allreduce_fusion_kernel_oneshot_lamport<(flashinfer::trtllm_allreduce_fusion::AllReduceFusionPattern)1, __nv_bfloat16, 2, true, true>(flashinfer::trtllm_allreduce_fusion::AllReduceFusionParams<__nv_bfloat16>)",
        F,
    ),
    (
        "void flashinfer::trtllm_allreduce_fusion::allreduce_fusion_kernel_twoshot_sync<(flashinfer::trtllm_allreduce_fusion::AllReduceFusionPattern)1, __nv_bfloat16, 8, true>(flashinfer::trtllm_allreduce_fusion::AllReduceFusionParams<__nv_bfloat16>)",
        F,
    ),
    (
        "void flashinfer::trtllm_moe_allreduce_fusion::moereduce_allreduce_fusion_kernel_oneshot_lamport<__nv_bfloat16, 8>(flashinfer::trtllm_moe_allreduce_fusion::MoeReductionAllReduceFusionParams<__nv_bfloat16>)",
        F,
    ),
    (
        "void flashinfer::trtllm_moe_allreduce_fusion::moefinalize_allreduce_fusion_kernel_oneshot_lamport<__nv_bfloat16, 8>(flashinfer::trtllm_moe_allreduce_fusion::MoeFinalizeAllReduceFusionParams<__nv_bfloat16>)",
        F,
    ),
    (
        "void flashinfer::trtllm_mnnvl_allreduce::oneshotAllreduceFusionKernel<__nv_bfloat16, 8, true>(flashinfer::trtllm_mnnvl_allreduce::AllReduceFusionParams)",
        F,
    ),
    (
        "void tensorrt_llm::kernels::one_shot_all_reduce_norm_kernel<__nv_bfloat16>(tensorrt_llm::kernels::AllReduceParams)",
        F,
    ),
    (
        "void tensorrt_llm::kernels::lamport_style_one_shot_all_reduce_norm_kernel<__nv_bfloat16, 8>(tensorrt_llm::kernels::AllReduceParams)",
        F,
    ),
    # --- FlashInfer / TensorRT-LLM plain one/two-shot all-reduce --------------------------------
    (
        "void flashinfer::trtllm_allreduce::oneShotAllReduceKernel<__nv_bfloat16, 8, false>(flashinfer::trtllm_allreduce::AllReduceParams<__nv_bfloat16>)",
        A,
    ),
    (
        "void flashinfer::trtllm_allreduce::twoShotAllReduceKernel<__nv_bfloat16, 8, false>(flashinfer::trtllm_allreduce::AllReduceParams<__nv_bfloat16>)",
        A,
    ),
    (
        "void flashinfer::trtllm_mnnvl_allreduce::twoshotAllreduceKernel<__nv_bfloat16, 8>(flashinfer::trtllm_mnnvl_allreduce::AllReduceParams)",
        A,
    ),
    # --- FlashInfer PCIe IPC collectives (flashinfer include/flashinfer/comm/pcie_ipc_*.cuh) ----------
    # All-reduce kernels live in namespace flashinfer::comm::pcie_ipc (pcie_ipc_all_reduce.cuh at
    # flashinfer fb28d7242): push_oneshot_param_kernel, ipc_rsag_push_param_kernel,
    # ipc_rsag_ring_push_param_kernel, ipc_tp2_remote_push_kernel, ipc_topo_rsag8_*_kernel.
    (
        "void flashinfer::comm::pcie_ipc::push_oneshot_param_kernel<__nv_bfloat16, 8, false, true>(flashinfer::comm::pcie_ipc::PushOneshotParamData<__nv_bfloat16>)",
        A,
    ),
    (
        "void flashinfer::comm::pcie_ipc::ipc_rsag_push_param_kernel<__nv_bfloat16, 4, false>(flashinfer::comm::pcie_ipc::PushOneshotParamData<__nv_bfloat16>)",
        A,
    ),
    (
        "void flashinfer::comm::pcie_ipc::ipc_tp2_remote_push_kernel<__nv_bfloat16, true, false>(flashinfer::comm::pcie_ipc::IpcTp2RemotePushData<__nv_bfloat16>)",
        A,
    ),
    (
        "void flashinfer::comm::pcie_ipc::all_gather::detail::flat_push_kernel<8, 0>(flashinfer::comm::pcie_ipc::all_gather::detail::KernelParams)",
        O,
    ),
    (
        "void flashinfer::comm::pcie_ipc::reduce_scatter::detail::flat_push_kernel<__nv_bfloat16, 8, 0>(flashinfer::comm::pcie_ipc::reduce_scatter::detail::KernelParams)",
        O,
    ),
    # --- MSCCL++ (SGLang sgl-kernel/csrc/allreduce/mscclpp_allreduce.cuh) -----------------------
    (
        "void sglang::allreduce_1shotLL_1node<__nv_bfloat16>(mscclpp::DeviceHandle<mscclpp::MemoryChannel>*, __nv_bfloat16*, __nv_bfloat16*, unsigned long, int, int, unsigned int)",
        A,
    ),
    (
        "void sglang::allreduce_1shotLL_2node<__nv_bfloat16>(mscclpp::DeviceHandle<mscclpp::MemoryChannel>*, __nv_bfloat16*, __nv_bfloat16*, unsigned long, int, int, unsigned int)",
        A,
    ),
    (
        "void allreducePacket<__nv_bfloat16>(__nv_bfloat16*, __nv_bfloat16*, void*, mscclpp::DeviceHandle<mscclpp::MemoryChannel>*, unsigned long, int, int, int, unsigned long, unsigned int)",
        A,
    ),
    # --- torch symmetric memory (CUDASymmetricMemoryOps.cu; multimem form from the B200 trace) -----
    (
        "void (anonymous namespace)::multimem_all_reduce_kernel<c10::BFloat16, 16>(c10::BFloat16*, unsigned long, unsigned int**, unsigned long, unsigned long)",
        A,
    ),
    (
        "void c10d::symmetric_memory::(anonymous namespace)::two_shot_all_reduce_kernel_inplace<c10::BFloat16, 16, 8>(c10::BFloat16**, unsigned long, unsigned long, unsigned int**, unsigned long, unsigned long)",
        A,
    ),
    (
        "void c10d::symmetric_memory::(anonymous namespace)::one_shot_all_reduce_kernel<c10::BFloat16, 16, 8>(c10::BFloat16**, unsigned long, c10::BFloat16*, c10::BFloat16*, unsigned int**, unsigned long, unsigned long)",
        A,
    ),
    (
        "void c10d::symmetric_memory::(anonymous namespace)::multimem_one_shot_reduce_kernel<c10::BFloat16, 16>(c10::BFloat16*, c10::BFloat16*, unsigned long, unsigned long, unsigned int**, unsigned long, unsigned long)",
        A,
    ),
    (
        "void c10d::symmetric_memory::(anonymous namespace)::multimem_all_gather_kernel<16>(char*, char*, unsigned long, unsigned int**, unsigned long, unsigned long)",
        O,
    ),
    # --- SGLang / aiter others ------------------------------------------------------------------
    (
        "void aiter::quickreduce::allreduce_prototype_twoshot<aiter::quickreduce::CodecFP<__hip_bfloat16, 8>, false>(__hip_bfloat16 const*, __hip_bfloat16*, unsigned int, int, int, unsigned char**, unsigned int, unsigned int)",
        A,
    ),
    ("void sglang::trt_reduce::oneShotAllReduceKernel<__nv_bfloat16, 8>(sglang::trt_reduce::AllReduceParams)", A),
    ("quick_all_reduce_kernel", A),
    # --- generic names: the launching op decides ------------------------------------------------
    ("void allreduce_kernel<__nv_bfloat16>(__nv_bfloat16*, int)", NEEDS_OP),
    ("void flashinfer::comm::allgather_kernel<__nv_bfloat16>(__nv_bfloat16*, int)", NEEDS_OP),
    ("reducescatter_kernel", NEEDS_OP),
    # --- memory (Kineto gpu_memcpy / gpu_memset names, B200 / MI300X / HTA traces) ---------------
    ("Memcpy DtoD (Device -> Device)", M),
    ("Memcpy HtoD (Pinned -> Device)", M),
    ("Memcpy HtoD (Host -> Device)", M),
    ("Memcpy DtoH (Device -> Pageable)", M),
    ("Memset (Device)", M),
    # --- compute: plain GEMM / elementwise / reductions, real names -----------------------------
    ("Cijk_Alik_Bljk_BBS_BH_Bias_HA_S_SAV_UserArgs_MT128x256x32_MI16x16x1_SN_LDSB1_AFC1_AFEM1", C),
    (
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas",
        C,
    ),
    (
        "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<c10::BFloat16>, std::array<char*, 1ul> >(int, at::native::FillFunctor<c10::BFloat16>, std::array<char*, 1ul>)",
        C,
    ),
    (
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<float>, unsigned int, long, 4, 4> >(at::native::ReduceOp<float, at::native::ArgMaxOps<float>, unsigned int, long, 4, 4>)",
        C,
    ),
    ("void at::native::vectorized_gather_kernel<16, long>(char*, char*, long*, int, long, long, long, long, bool)", C),
    (
        "void splitKreduce_kernel<float, float, float, float, true, false, false>(cublasSplitKParams<float>, float const*, float const*, float*, float const*, float const*, float const*, float const*, float*, void*, long, float*, int*, bool)",
        C,
    ),
    (
        "void vllm::fused_add_rms_norm_kernel<c10::BFloat16, 8>(c10::BFloat16*, c10::BFloat16*, c10::BFloat16 const*, float, int, int)",
        C,
    ),
    ("compute_position_kernel", C),
    # A CUTLASS GEMM with a bias-broadcast epilogue (cutlass/epilogue/threadblock/epilogue_with_broadcast.h)
    (
        "void cutlass::Kernel<cutlass::gemm::kernel::GemmWithFusedEpilogue<cutlass::gemm::threadblock::MmaMultistage<cutlass::gemm::GemmShape<128, 128, 32>>, cutlass::epilogue::threadblock::EpilogueWithBroadcast<cutlass::gemm::GemmShape<128, 128, 32>>, cutlass::gemm::threadblock::GemmIdentityThreadblockSwizzle<8>, false>>(cutlass::gemm::kernel::GemmWithFusedEpilogue<>::Params)",
        C,
    ),
    # --- expert-parallel all-to-all: its own class, never compute (issue 12) --------------------
    # DeepEP: deepseek-ai/DeepEP csrc/kernels/intranode.cu (commit f7fb36f) declares, in namespace
    # deep_ep::intranode, `template<int kNumRanks> notify_dispatch`, `cached_notify_dispatch`, and
    # `template<int kNumRanks, int kNumThreads, int kNumTMABytesPerWarp> dispatch(int4* recv_x, ...)`;
    # csrc/kernels/internode.cu declares deep_ep::internode::notify_dispatch<bool kLowLatencyMode,
    # int kNumRDMARanks>; internode_ll.cu the low-latency dispatch/combine. Names below are those
    # declarations as Kineto demangles them (return type first, template arguments, parameter types).
    (
        "void deep_ep::intranode::dispatch<8, 768, 8192>(int4*, float*, int*, long*, float*, int*, int*, int4 const*, "
        "float const*, long const*, float const*, bool const*, int const*, int, int, int, int, int, int, int, int, "
        "void**, int, int, int)",
        E,
    ),
    (
        "void deep_ep::intranode::notify_dispatch<8>(int const*, int*, int const*, int*, int, int, int, bool const*, "
        "int*, int*, int, int, void**, int**, int)",
        E,
    ),
    ("void deep_ep::intranode::cached_notify_dispatch<8>(int const*, int, void**, int**, int)", E),
    ("void deep_ep::intranode::combine<__nv_bfloat16, 8, 768, 4096>(__nv_bfloat16*, float*, int*, int*)", E),
    ("void deep_ep::internode::notify_dispatch<false, 2>(int const*, int*, int, int const*, int*)", E),
    ("void deep_ep::internode::combine<false, 2, 4, 7168>(int4*, float*, bool const*)", E),
    ("void deep_ep::internode_ll::dispatch<true, 3, 7168>(void*, float*, int*, long*)", E),
    ("void deep_ep::internode_ll::combine<false, 3, 7168, 9>(void*, void*, int*, void*)", E),
    # AMD's port keeps DeepEP's namespaces under primus_turbo:: (Primus-Turbo csrc/kernels/deep_ep/)
    ("void primus_turbo::deep_ep::internode::dispatch<false, 2, 8>(int4*, float*)", E),
    # pplx-kernels: namespace pplx, classes AllToAllIntraNode / AllToAllInterNode (include
    # all_to_all/intranode.h, internode.h); its dispatch and combine kernels live in that namespace.
    ("void pplx::dispatchKernel<32, 7168, 8, __nv_bfloat16>(int*, unsigned long, void*)", E),
    ("void pplx::combineKernel<__nv_bfloat16, __nv_bfloat16, 8>(__nv_bfloat16*, unsigned long)", E),
    ("void pplx::(anonymous namespace)::dispatchKernel<true>(unsigned int*, __nv_bfloat16 const*)", E),
    # NCCL's all-to-all function (msccl src/collectives/device/all_to_all.h: ncclFuncAllToAll)
    ("ncclKernel_AllToAll_RING_SIMPLE_Sum_bf16(ncclDevComm*, unsigned long, ncclWork*)", E),
    # --- look collective, no rule: reported as unknown_comm, never counted as compute ------------
    ("void my_team::custom_allreduce_push_kernel<__nv_bfloat16>(__nv_bfloat16*, int)", U),
    ("void mylib::lamport_push_kernel<__nv_bfloat16>(__nv_bfloat16*, int)", U),
    ("void fancy::multimem_ld_reduce_kernel<16>(float*, unsigned long)", U),
]

# NCCL >= 2.27 symmetric-memory kernels (NVIDIA/nccl src/device/symmetric/generate.py: kernel_cname
# pastes "ncclSymDevKernel" (2.27) / "ncclSymkDevKernel" (2.28+), coll, algo, red, type). vLLM's
# PyNCCL symmetric path runs them for small bf16 all-reduces, also under CUDA graphs, where no
# launching op can rescue a class-less name.
NCCL_SYMMETRIC: list[tuple[str, EventClass]] = [
    ("ncclSymDevKernel_AllReduce_RSxLD_AGxST_sum_bf16(ncclSymDevArgs)", A),
    ("ncclSymDevKernel_AllReduce_AGxLL_R_sum_bf16(ncclSymDevArgs)", A),
    ("ncclSymkDevKernel_AllReduce_AGxLLMC_R_sum_bf16(ncclSymkDevWorkArgs4K)", A),
    ("ncclSymDevKernel_AllGather_LL(ncclSymDevArgs)", O),
    ("ncclSymDevKernel_ReduceScatter_LL_sum_bf16(ncclSymDevArgs)", O),
]

# RCCL's generic kernel is a template, so its demangled name starts with the return type.
RCCL_TEMPLATE = "void rcclGenericKernel<1, false>(ncclDevKernelArgsStorage<4096ul>)"

# A name no real NCCL uses, for the catch-all "any other NCCL/RCCL kernel" rule.
NCCL_CATCH_ALL = "ncclDevKernel_SomeFutureCollective(ncclDevKernelArgsStorage<4096ul>)"


@pytest.mark.parametrize("name, expected", NAMES, ids=[n[:70] for n, _ in NAMES])
def test_name_table(name, expected):
    assert classify_name(name).cls == expected


@pytest.mark.parametrize("name, expected", NCCL_SYMMETRIC, ids=[n for n, _ in NCCL_SYMMETRIC])
def test_nccl_symmetric_kernels(name, expected):
    assert classify_name(name).cls == expected


def test_rccl_generic_template_name_needs_the_op():
    c = classify_name(RCCL_TEMPLATE)
    assert (c.cls, c.family) == (NEEDS_OP, "rccl")


def test_nccl_catch_all_needs_the_op():
    assert classify_name(NCCL_CATCH_ALL).cls is NEEDS_OP


def test_every_rule_has_a_source_and_a_listed_name():
    assert len(RULES) > 0
    for rule in RULES:
        assert rule.source.strip(), rule.pattern
        assert rule.family.strip(), rule.pattern
        re.compile(rule.pattern)
    listed = [n for n, _ in NAMES] + [n for n, _ in NCCL_SYMMETRIC] + [RCCL_TEMPLATE, NCCL_CATCH_ALL]
    hit = {classify_name(n).rule for n in listed}
    missing = [(i, r.pattern) for i, r in enumerate(RULES) if i not in hit]
    assert not missing, f"rules matched by no listed name: {missing}"


@pytest.mark.parametrize(
    "collective, expected",
    [
        ("allreduce", A),
        ("c10d::allreduce_", A),
        ("vllm::all_reduce", A),
        ("nccl:all_reduce", A),
        ("_allgather_base", O),
        ("nccl:_all_gather_base", O),
        ("reduce_scatter_tensor_coalesced", O),
        ("_reduce_scatter_base", O),
        ("all_to_all", E),
        ("c10d::alltoall_base_", E),
        ("broadcast", O),
        ("nccl:send", O),
        ("recv", O),
        (None, U),
        ("", U),
        ("record_param_comms", U),
    ],
)
def test_resolve_from_op(collective, expected):
    assert resolve_from_op(collective) == expected


def test_rccl_generic_resolved_from_collective_name_and_launching_op(data_dir):
    """tests/data/rccl_generic: ncclDevKernel_Generic with the collective in its own args,
    from a record_param_comms op, from a c10d op name, and with no context at all."""
    (r,) = load_trace(data_dir / "rccl_generic" / "rccl_generic_eager.trace.json.gz")
    rows = sorted(zip(r.start_ns.tolist(), r.cls.tolist(), r.msg_bytes.tolist(), [r.names[i] for i in r.name_id]))
    generic = [(s, c, b) for s, c, b, n in rows if n.startswith("ncclDevKernel_Generic")]
    assert generic == [
        (100_000, A.code, 4096 * 2),  # 'Collective name': 'allreduce', 4096 bf16
        (120_000, O.code, 512 * 4),  # record_param_comms '_allgather_base', 512 float
        (130_000, A.code, 256 * 64 * 4),  # c10d::allreduce_ on a [256, 64] float tensor
        (140_000, U.code, -1),  # no op: unknown collective, unknown size
    ]
    gemm = [c for s, c, b, n in rows if n.startswith("Cijk")]
    assert gemm == [C.code]
    assert r.meta.get("unresolved_comm_kernels") == {"ncclDevKernel_Generic(ncclDevKernelArgsStorage<4096ul>)": 1}


def test_kernel_names_in_shared_traces(traces_dir):
    """Every kernel in the shared traces is compute except the known collectives (B200: 73
    symmetric-memory all-reduces + 1 NCCL all-gather; HTA pair: NCCL send/recv)."""
    files = [
        "TraceLens/eager_trace.json.gz",
        "TraceLens/sglang_Qwen3-8B_prefilldecode.json.gz",
        "HolisticTraceAnalysis/sampled_rank-0.json.gz",
        "HolisticTraceAnalysis/sampled_rank-1.json.gz",
    ]
    names = set()
    for f in files:
        doc = json.loads(gzip.decompress((traces_dir / f).read_bytes()))
        names |= {e["name"] for e in doc["traceEvents"] if e.get("cat") == "kernel"}
    assert len(names) > 200
    for name in sorted(names):
        if "multimem_all_reduce_kernel" in name or name.startswith("ncclDevKernel_AllReduce"):
            want = A
        elif name.startswith(("ncclDevKernel_AllGather", "ncclKernel_SendRecv")):
            want = O
        else:
            want = C
        assert classify_name(name).cls == want, name


def _ep_trace(path, ops):
    """Kernels with their launching ops: (kernel name, op name, Collective name or None)."""
    events = []
    for i, (kernel, op, coll) in enumerate(ops):
        args = {"External id": 100 + i, "In msg nelems": 1024, "dtype": "BFloat16"}
        if coll:
            args["Collective name"] = coll
        events.append(
            {"ph": "X", "cat": "cpu_op", "name": op, "pid": 0, "tid": 1, "ts": 100 * i, "dur": 50, "args": args}
        )
        events.append(
            {
                "ph": "X",
                "cat": "kernel",
                "name": kernel,
                "pid": 0,
                "tid": 7,
                "ts": 100 * i + 10,
                "dur": 20,
                "args": {"stream": 7, "External id": 100 + i},
            }
        )
    path.write_bytes(gzip.compress(json.dumps({"traceEvents": events}).encode()))
    return path


def test_sendrecv_kernel_is_ep_alltoall_when_an_all_to_all_launched_it(tmp_path):
    """NCCL runs torch all_to_all_single as grouped send/recv: ncclDevKernel_SendRecv with a
    record_param_comms 'all_to_all' (or c10d::alltoall_base_) op; pipeline send/recv stays other_comm."""
    sr = "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)"
    (r,) = load_trace(
        _ep_trace(
            tmp_path / "t.json.gz",
            [
                (sr, "record_param_comms", "all_to_all"),
                (sr, "c10d::alltoall_base_", None),
                (sr, "nccl:send", None),
                ("gemm", "aten::mm", None),
            ],
        )
    )
    assert r.cls.tolist() == [E.code, E.code, O.code, C.code]
    assert r.msg_bytes.tolist() == [2048, 2048, 2048, -1]


def test_deep_ep_time_is_communication_not_compute(tmp_path):
    """A DeepEP dispatch beside a GEMM: the profile counts it as ep_alltoall, compute stays the GEMM."""
    from fastverify.analyze import breakdown

    (r,) = load_trace(
        _ep_trace(
            tmp_path / "t.json.gz",
            [
                ("void deep_ep::intranode::dispatch<8, 768, 8192>(int4*, float*)", "deep_ep::dispatch", None),
                ("gemm", "aten::mm", None),
            ],
        )
    )
    b = breakdown(r.start_ns, r.dur_ns, r.cls)
    assert b["compute_us"] == 20.0 and b["ep_alltoall_us"] == 20.0 and b["exposed_comm_us"] == 20.0
    assert b["counts"]["ep_alltoall"] == 1 and b["counts"]["compute"] == 1 and b["allreduce_us"] == 0.0
