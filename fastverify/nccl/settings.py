"""The catalogue: each NCCL setting fastverify checks, as a :class:`~fastverify.nccl.findings.Setting`
with its check, and the other ``NCCL_*`` names NCCL (or other software) reads.

Each entry says what values NCCL accepts (per NCCL version where that changed), the default,
whether NCCL reads it once per process or at each communicator init, and the NCCL source file
that reads it. Facts: NVIDIA/nccl's own source at tags v2.18.3 … v2.30.7.
"""

from __future__ import annotations

from fastverify.nccl.algoproto import check_list
from fastverify.nccl.buffsize import check_buffsize
from fastverify.nccl.findings import ALWAYS, V, Check, Ctx, Kind, Scope, Setting, Severity, Verdict, merge, show
from fastverify.nccl.p2plevel import check_p2p_disable, check_p2p_level
from fastverify.nccl.valuechecks import (
    SUBSYS,
    check_channels,
    check_choice,
    check_cta_policy,
    check_debug_subsys,
    check_nthreads,
    check_text,
    check_thread_thresholds,
    check_tuner_plugin,
    flag,
)
from fastverify.nccl.version import LIBRARY_ENV


def _check_no_cache(value: str, ctx: Ctx, s: Setting) -> Verdict:
    """``NCCL_NO_CACHE``: full names of settings NCCL keeps in an ``NCCL_PARAM`` cache, or ALL."""
    tokens = list(filter(None, value.split(",")))
    if not tokens:
        return Verdict(Severity.WARNING, "empty: nothing is re-read", "remove the variable")
    unknown = [t for t in tokens if t != "ALL" and t not in CATALOGUE_BY_NAME and t not in OTHER_NAMES]
    not_param = [t for t in tokens
                 if t in CATALOGUE_BY_NAME and not CATALOGUE_BY_NAME[t].source.startswith("NCCL_PARAM")]
    verdicts = []
    if unknown:
        verdicts.append(Verdict(Severity.WARNING, f"not NCCL variable names (exact, with NCCL_): "
                                f"{', '.join(map(show, unknown))}", "list full names such as NCCL_NTHREADS, or ALL"))
    if not_param:
        verdicts.append(Verdict(Severity.WARNING, f"no effect on {', '.join(not_param)}: not kept in an "
                                "NCCL_PARAM cache", "remove it from the list; changing it needs a fresh process"))
    effective = [t for t in tokens if t not in unknown and t not in not_param]
    return merge(*verdicts, Verdict(Severity.OK, "re-read at each use: " + ", ".join(effective)) if effective else None)


P, C = Scope.PROCESS, Scope.COMMUNICATOR
_LIST_CHANGES = ("<= 2.23: comma list, case-insensitive, leading ^ excludes; unknown names silently ignored",
                 ">= 2.24: list[;function:list]*, function in Broadcast/Reduce/AllGather/ReduceScatter/AllReduce; "
                 "an unknown name or function fails communicator init")

_ENTRIES: tuple[tuple[Setting, Check], ...] = (
    (Setting("NCCL_ALGO", Kind.LIST, "Ring, Tree, CollNetDirect, CollNetChain (2.14+), NVLS (2.17+), NVLSTree (2.18+), "
             "PAT (2.23+); CollNet 2.6-2.13", "all (only Ring and Tree can run an all-reduce on one PCIe node)", C,
             V(2, 5), "algorithms NCCL's cost model may pick", "src/graph/tuning.cc (ncclTopoTuneModel, parseList)",
             _LIST_CHANGES), check_list),
    (Setting("NCCL_PROTO", Kind.LIST, "LL, LL128, Simple", "LL and Simple; LL128 only where NCCL deems it safe "
             "(NVLink, never PCIe-only)", C, V(2, 5), "protocols NCCL's cost model may pick; forcing LL128 skips its "
             "safety checks", "src/graph/tuning.cc (ncclTopoTuneModel, parseList)", _LIST_CHANGES), check_list),
    (Setting("NCCL_MIN_NCHANNELS", Kind.INT, "0..64 (0..32 before 2.25)", "-2 (unset: platform dependent)", P, V(2, 5),
             "lower bound on channels (CUDA blocks) per communicator", "NCCL_PARAM MinNchannels, src/graph/connect.cc",
             ("2.17: deprecated for NCCL_MIN_CTAS", "2.25: limit 32 -> 64")), check_channels(True, False)),
    (Setting("NCCL_MAX_NCHANNELS", Kind.INT, "1..64 (1..32 before 2.25)", "-2 (unset: up to 64)", P, V(2, 5),
             "upper bound on channels (CUDA blocks) per communicator", "NCCL_PARAM MaxNchannels, src/graph/connect.cc",
             ("2.17: deprecated for NCCL_MAX_CTAS", "2.25: limit 32 -> 64")), check_channels(False, False)),
    (Setting("NCCL_MIN_NRINGS", Kind.INT, "as NCCL_MIN_NCHANNELS", "-2 (unset)", P, V(2, 2),
             "old name of NCCL_MIN_NCHANNELS, ignored when that is set", "NCCL_PARAM MinNrings, src/graph/connect.cc",
             alias_of="NCCL_MIN_NCHANNELS"), check_channels(True, False)),
    (Setting("NCCL_MAX_NRINGS", Kind.INT, "as NCCL_MAX_NCHANNELS", "-2 (unset)", P, V(2, 0, 5),
             "old name of NCCL_MAX_NCHANNELS, ignored when that is set", "NCCL_PARAM MaxNrings, src/graph/connect.cc",
             alias_of="NCCL_MAX_NCHANNELS"), check_channels(False, False)),
    (Setting("NCCL_MIN_CTAS", Kind.INT, "1..64 (1..32 before 2.25)", "unset (ncclConfig_t.minCTAs or automatic)", P,
             V(2, 17), "lower bound on CTAs (channels); overrides ncclConfig_t.minCTAs",
             "NCCL_PARAM MinCTAs, src/init.cc (envConfigOverride)"), check_channels(True, True)),
    (Setting("NCCL_MAX_CTAS", Kind.INT, "1..64 (1..32 before 2.25)", "unset (ncclConfig_t.maxCTAs or 64)", P, V(2, 17),
             "upper bound on CTAs (channels); overrides ncclConfig_t.maxCTAs",
             "NCCL_PARAM MaxCTAs, src/init.cc (envConfigOverride)"), check_channels(False, True)),
    (Setting("NCCL_NTHREADS", Kind.INT, "multiple of 32 in [64, 512] (docs: 64, 128, 256, 512)",
             "512; Ring/Simple 256 when ring bandwidth x channels <= 12 GB/s", P, ALWAYS,
             "threads per CUDA block for LL and Simple", "NCCL_PARAM Nthreads, src/graph/tuning.cc (getNthreads)"),
     check_nthreads(64, 512)),
    (Setting("NCCL_LL128_NTHREADS", Kind.INT, "multiple of 32 in [160, 640]", "640", P, V(2, 5),
             "threads per CUDA block for LL128", "NCCL_PARAM Ll128Nthreads, src/graph/tuning.cc (getNthreads)"),
     check_nthreads(160, 640)),
    (Setting("NCCL_BUFFSIZE", Kind.INT, "bytes >= 4096 (less crashes NCCL >= 2.22), power of 2 recommended",
             "4194304 (4 MiB)", P, ALWAYS, "per-peer FIFO size of the Simple protocol",
             "NCCL_PARAM BuffSize, src/init.cc (computeBuffSizes)"), check_buffsize),
    (Setting("NCCL_LL_BUFFSIZE", Kind.INT, "bytes >= 256 (less crashes NCCL >= 2.22)",
             "524288 (8 lines x 512 threads x 8 steps x 16 B)", P, V(2, 7), "per-peer FIFO size of the LL protocol",
             "NCCL_PARAM LlBuffSize, src/init.cc (computeBuffSizes)"), check_buffsize),
    (Setting("NCCL_LL128_BUFFSIZE", Kind.INT, "bytes >= 16384 (less crashes NCCL >= 2.22)",
             "4915200 (120 x 640 threads x 8 steps x 8 B)", P, V(2, 7), "per-peer FIFO size of the LL128 protocol",
             "NCCL_PARAM Ll128BuffSize, src/init.cc (computeBuffSizes)"), check_buffsize),
    (Setting("NCCL_P2P_LEVEL", Kind.CHOICE, "LOC, NVL, NVB, C2C (2.26+), PIX, PXB, P2C (2.27+), PXN (2.12+), PHB, SYS "
             "(exact case); legacy 0..5 = LOC, PIX, PXB, PHB, SYS, SYS", "PXB (SYS on AMD x86 with <= 2 GPUs)", P,
             V(2, 3, 4), "farthest GPU-to-GPU path on which NCCL uses the P2P transport (else SHM through the host)",
             "src/graph/paths.cc (ncclGetLevel, static ncclTopoUserP2pLevel)",
             ("2.26: C2C added", "2.27: P2C added")), check_p2p_level),
    (Setting("NCCL_P2P_DISABLE", Kind.FLAG, "1 disables; anything else is ignored", "unset (P2P enabled)", P, ALWAYS,
             "disable the P2P transport (level LOC, overrides NCCL_P2P_LEVEL)",
             "src/graph/paths.cc (ncclGetLevel)"), check_p2p_disable),
    (Setting("NCCL_SHM_DISABLE", Kind.FLAG, "0, 1 (only 1 has an effect)", "0", P, ALWAYS,
             "disable the SHM transport; without P2P and SHM GPUs talk through NET (sockets)",
             "NCCL_PARAM ShmDisable, src/transport/shm.cc"), flag(True)),
    (Setting("NCCL_P2P_USE_CUDA_MEMCPY", Kind.FLAG, "0, 1", "0", P, V(2, 13),
             "P2P copies by the copy engine through the proxy thread (log suffix /CE); for bandwidth, not latency",
             "NCCL_PARAM P2pUseCudaMemcpy, src/transport/p2p.cc"), flag(False)),
    (Setting("NCCL_CUMEM_ENABLE", Kind.FLAG, "0, 1 (-2 = auto)", "auto since 2.19 (on if the driver supports "
             "cuMem); 0 in 2.18", P, V(2, 18), "cuMem/VMM allocations and fd-based IPC (P2P/CUMEM) instead of "
             "legacy CUDA IPC (P2P/IPC)", "NCCL_PARAM CuMemEnable, src/misc/cudawrap.cc",
             ("2.19: default 0 -> auto",)), flag(False, {-2: "auto (on if supported)"})),
    (Setting("NCCL_NVLS_ENABLE", Kind.FLAG, "0, 1, 2", "2", P, V(2, 17), "NVLink SHARP; needs NVSwitch and sm90+, "
             "no effect on PCIe", "NCCL_PARAM NvlsEnable, src/transport/nvls.cc"),
     flag(False, {0: "off", 1: "on (no effect without NVSwitch)", 2: "auto (no effect without NVSwitch)"})),
    (Setting("NCCL_GRAPH_REGISTER", Kind.FLAG, "0, 1", "1", P, V(2, 11),
             "register user buffers during CUDA-graph capture", "NCCL_PARAM GraphRegister, src/enqueue.cc"),
     flag(False)),
    (Setting("NCCL_LAUNCH_MODE", Kind.CHOICE, "PARALLEL, GROUP (case-insensitive)", "PARALLEL", C, V(2, 1),
             "kernel launch mode for several GPUs per process; re-read at each init but kept process-wide; "
             "GROUP deprecated since 2.9", "src/init.cc (ncclGetEnv NCCL_LAUNCH_MODE)"),
     check_choice({"PARALLEL": "PARALLEL (default)", "GROUP": "GROUP (deprecated since 2.9)"},
                  "NCCL uses PARALLEL")),
    (Setting("NCCL_TUNER_PLUGIN", Kind.TEXT, "library path, suffix (libnccl-tuner-<name>.so) or none",
             "libnccl-tuner.so, else the net plugin's tuner, else NCCL's model", P, V(2, 19),
             "external tuner that picks algorithm, protocol and channels; load status is kept per process",
             "src/plugin/tuner.cc"), check_tuner_plugin),
    (Setting("NCCL_TUNER_CONFIG_FILE", Kind.TEXT, "path of a CSV config", "nccl_tuner.conf in the working directory",
             C, V(2, 27, 5), "config of NCCL's example tuner plugin only (read by its init, once per communicator)",
             "plugins/tuner/example/plugin.c (ext-tuner/example before 2.29.7)"), check_text("config file")),
    (Setting("NCCL_CTA_POLICY", Kind.CHOICE, "DEFAULT, EFFICIENCY, ZERO combined with | (2.29+); legacy 0, 1, 2",
             "DEFAULT", P, V(2, 27), "CTA policy; EFFICIENCY/ZERO only change NVLS and symmetric kernels, no effect "
             "on a PCIe all-reduce", "src/init.cc (getEnvCtaPolicyOnce, envConfigOverride)",
             ("2.27: integer 0..1", "2.28: integer 0..2", "2.29: names with |, legacy digit = first character")),
     check_cta_policy),
    (Setting("NCCL_IGNORE_CPU_AFFINITY", Kind.FLAG, "0, 1", "0", P, V(2, 4, 6),
             "1: pin NCCL threads to the GPU's NUMA CPUs, ignoring the process affinity",
             "NCCL_PARAM IgnoreCpuAffinity, src/graph/topo.cc"), flag(False)),
    (Setting("NCCL_NET_DISABLE_INTRA", Kind.FLAG, "0, 1 (only 1 has an effect)", "0", P, V(2, 12),
             "1: never route intra-node traffic through a NIC", "NCCL_PARAM NetDisableIntra, src/graph/paths.cc"),
     flag(True)),
    (Setting("NCCL_IGNORE_DISABLED_P2P", Kind.FLAG, "0, 1, 2", "0", P, V(2, 12),
             "1: no warning when NVML reports P2P disabled; 2: skip the NVML P2P check (P2P is then tried anyway)",
             "NCCL_PARAM IgnoreDisabledP2p, src/graph/paths.cc (ncclTopoCheckP2p)"),
     flag(False, {1: "silence the 'P2P is disabled' message (P2P stays off)",
                  2: "skip NVML's P2P status check"})),
    (Setting("NCCL_GRAPH_FILE", Kind.TEXT, "path of an XML graph", "unset", C, V(2, 6),
             "load the ring/tree graphs from a file instead of searching", "src/graph/search.cc"),
     check_text("graph file")),
    (Setting("NCCL_TOPO_FILE", Kind.TEXT, "path of an XML topology", "unset", C, V(2, 6),
             "load the topology from a file before detection", "src/graph/topo.cc"), check_text("topology file")),
    (Setting("NCCL_DEBUG", Kind.CHOICE, "VERSION, WARN, INFO, ABORT, TRACE (case-insensitive)", "unset (no log)", P,
             ALWAYS, "log level", "src/debug.cc"),
     check_choice({"VERSION": "VERSION: the version line only", "WARN": "WARN: errors only",
                   "INFO": "INFO: the init and per-subsystem lines", "ABORT": "ABORT", "TRACE": "TRACE"},
                  "NCCL logs nothing")),
    (Setting("NCCL_DEBUG_SUBSYS", Kind.LIST, ", ".join(SUBSYS) + " (comma list, ^ excludes)", "INIT,BOOTSTRAP,ENV",
             P, V(2, 3, 4), "which subsystems log INFO lines; GRAPH and TUNING give the graph and model tables",
             "src/debug.cc"), check_debug_subsys),
    (Setting("NCCL_NO_CACHE", Kind.LIST, "comma list of NCCL_ names, or ALL (exact case)", "unset", P, V(2, 29, 7),
             "re-read the listed NCCL_PARAM settings at each use instead of once per process",
             "src/misc/param.cc, src/param/param.cc"), _check_no_cache),
    (Setting("NCCL_THREAD_THRESHOLDS", Kind.LIST, "up to 6 integers: Tree LL LL128 Simple, Ring LL LL128 Simple",
             "per protocol (Ring LL x nRanks)", C, V(2, 5),
             "bytes per thread below which NCCL halves the threads of a collective", "src/graph/tuning.cc"),
     check_thread_thresholds),
)

CATALOGUE: tuple[Setting, ...] = tuple(s for s, _ in _ENTRIES)
CATALOGUE_BY_NAME: dict[str, Setting] = {s.name: s for s in CATALOGUE}
CHECKS: dict[str, Check] = {s.name: check for s, check in _ENTRIES}

# Every other NCCL_* variable some NCCL release (2.18 .. 2.30.7) reads (NCCL_PARAM, ncclGetEnv, getenv
# in src/ and the plugins) or env.rst documents: known, so not "unknown", but not checked here.
OTHER_NAMES = frozenset("NCCL_" + n for n in """
AGG_CHANNEL_SIZE ALLGATHERV_ENABLE ALLOC_P2P_NET_LL_BUFFERS CGA_CLUSTER_SIZE CHECKS_DISABLE CHECK_MODE
CHECK_POINTERS CHUNK_SIZE COLLNET_ENABLE COLLNET_NODE_THRESHOLD COMM_BLOCKING COMM_ID COMM_SHRINK_SHARE_RESOURCES
COMM_SPLIT_SHARE_RESOURCES CONF_FILE CONNECT_ROUND_MAX_PEERS CREATE_THREAD_CONTEXT CROSS_NIC CUDA_PATH
CUMEM_HOST_ENABLE DEBUG_FILE DEBUG_TIMESTAMP_FORMAT DEBUG_TIMESTAMP_LEVELS DEV_API_JIT DISABLE_MEM_MANAGER
DMABUF_ENABLE ELASTIC_BUFFER_REGISTER ENABLE_VERSION_CHECK ENV_PLUGIN GDAKI_USE_RELIABLE_DB GDRCOPY_ENABLE
GDRCOPY_FIFO_ENABLE GDRCOPY_FLUSH_ENABLE GDRCOPY_SYNC_ENABLE GDR_FLUSH_DISABLE GIN_COUNTER_POOL_SIZE GIN_ENABLE
GIN_ERROR_QUERY_SEC GIN_EXCLUSIVE_CONTEXTS GIN_GDAKI_MAX_DEST_RD_ATOMIC GIN_GDAKI_MAX_QP_RD_ATOMIC
GIN_GDAKI_NIC_HANDLER GIN_GDAKI_QP_DEPTH GIN_IB_TC GIN_NCONNECTIONS GIN_NCONTEXTS GIN_PLUGIN GIN_PLUGIN_REF_COUNT
GIN_PROXY_QUEUE_SIZE GIN_SIGNAL_POOL_SIZE GIN_TYPE GRAPH_DUMP_FILE GRAPH_DUMP_FILE_RANK GRAPH_HELPER_DISABLE
GRAPH_MIXING_SUPPORT GRAPH_STREAM_ORDERING GROUP_CUDA_STREAM HOSTID IBVERBS_LIB IB_ADAPTIVE_ROUTING IB_ADDR_FAMILY
IB_ADDR_RANGE IB_AR_THRESHOLD IB_CUDA_SUPPORT IB_DATA_DIRECT IB_DEVICE_PCI_ORDER IB_DISABLE IB_ECE_ENABLE IB_FIFO_TC
IB_GID_INDEX IB_HCA IB_MERGE_NICS IB_MERGE_VFS IB_MQP_RETRY_ALL IB_MQP_RETRY_CNT IB_MQP_RETRY_SLEEP_MSEC IB_OOO_RQ
IB_PCI_RELAXED_ORDERING IB_PKEY IB_PREPOST_RECEIVE_WORK_REQUESTS IB_QPS_PER_CONNECTION IB_QUERY_PORT_SPEED
IB_RECEIVER_SIDE_MATCHING_SCHEME IB_RESILIENCY_PORT_FAILOVER IB_RESILIENCY_PORT_FAILOVER_MAX_ATTEMPTS
IB_RESILIENCY_PORT_FAILOVER_PROBE_DELAY IB_RESILIENCY_PORT_RECOVERY IB_RESILIENCY_PORT_RECOVERY_ACK_TIMEOUT
IB_RESILIENCY_PORT_RECOVERY_ALIVE_MSG_BATCH_INTERVAL IB_RESILIENCY_PORT_RECOVERY_ALIVE_MSG_BATCH_SIZE
IB_RESILIENCY_PORT_RECOVERY_ALIVE_MSG_SEQUENCE_SIZE IB_RESILIENCY_PORT_RECOVERY_ALIVE_MSG_TIMEOUT
IB_RESILIENCY_PORT_RECOVERY_ATTEMPTS_MAX IB_RESILIENCY_PORT_RECOVERY_START_DELAY IB_RETRY_CNT IB_RETURN_ASYNC_EVENTS
IB_ROCE_VERSION_NUM IB_ROUTABLE_FLID_GID_INDEX IB_SL IB_SPLIT_DATA_ON_QPS IB_SUBNET_AWARE_ROUTING
IB_SUBNET_PREFIX_LEN IB_TC IB_TIMEOUT IB_USE_INLINE IB_WARN_RAIL_LOCAL IGNORE_COLLNET_MISMATCH IGNORE_NET_MISMATCH
INSPECTOR_COLL_POOL_SIZE INSPECTOR_COMM_POOL_SIZE INSPECTOR_DUMP_COLL_RING_SIZE INSPECTOR_DUMP_DIR
INSPECTOR_DUMP_MIN_SIZE_BYTES INSPECTOR_DUMP_P2P_RING_SIZE INSPECTOR_DUMP_THREAD_ENABLE
INSPECTOR_DUMP_THREAD_INTERVAL_MICROSECONDS INSPECTOR_DUMP_VERBOSE INSPECTOR_ENABLE INSPECTOR_ENABLE_P2P
INSPECTOR_P2P_POOL_SIZE INSPECTOR_POOL_GROW INSPECTOR_PROM_DUMP INSPECTOR_REQUIRE_KERNEL_TIMING
IPC_USE_ABSTRACT_SOCKET L1_SHARED_MEMORY_CARVEOUT LAUNCH_ORDER_IMPLICIT LAUNCH_RACE_FATAL LEGACY_CUDA_REGISTER
LL128_C2C LL_THRESHOLD LOCAL_REGISTER LSA_TEAM_SIZE MAX_P2P_NCHANNELS MEM_SYNC_DOMAIN MIN_P2P_NCHANNELS
MLOPART_RDMA_ENABLE MNNVL_CLIQUE_ID MNNVL_CROSS_CLIQUE MNNVL_ENABLE MNNVL_RAIL_PER_HOST MNNVL_SCATTER_NETS_ENABLE
MNNVL_UUID MULTI_RANK_GPU_ENABLE MULTI_SEGMENT_REGISTER NCHANNELS_PER_NET_PEER NET NETDEVS_POLICY NET_FORCE_FLUSH
NET_FORCE_MERGE NET_GDR_C2C NET_GDR_MLOPART NET_GDR_READ NET_MERGE_LEVEL NET_MERGE_POLICY
NET_OPTIONAL_RECV_COMPLETION NET_OVERHEAD NET_PLUGIN NET_PLUGIN_REF_COUNT NET_SHARED_BUFFERS NET_SHARED_COMMS
NSOCKS_PERTHREAD NUM_RMA_CTX NVB_DISABLE NVB_PRECONNECT NVLINK_UTIL_CENTRIC_SCHED_ENABLE NVLSTREE_MAX_CHUNKSIZE
NVLS_CHUNKSIZE NVLS_NCHANNELS NVTX_DISABLE OOB_NET_ENABLE OOB_NET_IFNAME P2P_DIRECT_DISABLE P2P_EPOCH_ENABLE
P2P_LL_THRESHOLD P2P_MAX_PEERS P2P_NET_CHUNKSIZE P2P_NVL_CHUNKSIZE P2P_PCI_CHUNKSIZE P2P_PER_CHANNEL_NET_BW
P2P_PXN_LEVEL P2P_READ_ENABLE P2P_SCHEDULE_GROUP_SIZE PARAM_DUMP_ALL PAT_ENABLE
PROFILER_CE_POLLER_INTERVAL_MICROSECONDS PROFILER_CE_TIMING PROFILER_PLUGIN PROFILE_CE_BATCH_POOL_SIZE
PROFILE_CE_COLL_POOL_SIZE PROFILE_CE_SYNC_POOL_SIZE PROFILE_COLL_API_POOL_SIZE PROFILE_COLL_POOL_SIZE
PROFILE_DUMP_FILE PROFILE_EVENT_MASK PROFILE_GROUP_API_POOL_SIZE PROFILE_GROUP_POOL_SIZE
PROFILE_KERNEL_LAUNCH_POOL_SIZE PROFILE_P2P_API_POOL_SIZE PROFILE_P2P_POOL_SIZE PROFILE_PROXY_CTRL_POOL_SIZE
PROFILE_PROXY_DETACH_POOL_SIZE PROGRESS_APPENDOP_FREQ PROXY_APPEND_BATCH_SIZE PROXY_CPUSET PROXY_DUMP_SIGNAL
PROXY_PROFILE PXN_C2C PXN_DISABLE RAS_ADDR RAS_ENABLE RAS_TIMEOUT_FACTOR REPORT_CONNECT_PROGRESS RMA_DISABLE
RMA_PLUGIN RMA_PLUGIN_REF_COUNT RMA_PROXY_DUMP_SIGNAL RMA_PROXY_QUEUE_SIZE RUNTIME_CONNECT SET_CPU_STACK_SIZE
SET_STACK_SIZE SET_THREAD_NAME SHADOW_MEMPOOL_MAX_SIZE SHM_LOCALITY SHM_MEMCPY_MODE SHM_USE_CUDA_MEMCPY
SINGLE_PROC_MEM_REG_ENABLE SINGLE_RING_THRESHOLD SOCKET_FAMILY SOCKET_IFNAME SOCKET_INLINE SOCKET_MAGIC
SOCKET_MIN_TASKSIZE SOCKET_NTHREADS SOCKET_POLL_TIMEOUT_MSEC SOCKET_RCVBUF SOCKET_RETRY_CNT SOCKET_RETRY_SLEEP_MSEC
SOCKET_SNDBUF SYM_CE_THRESHOLD SYM_CTAS SYM_GIN_KERNELS_ENABLE SYM_KERNEL SYM_NOWIN_ENABLE SYM_REUSE_SYSMEM_HANDLES
SYM_RS_GIN_CHUNK_SIZE SYM_TMA_ENABLE TOPO_DUMP_FILE TOPO_DUMP_FILE_RANK TOPO_SPLIT_MLOPART TREE_THRESHOLD
UID_STAGGER_RATE UID_STAGGER_THRESHOLD UNPACK_DOUBLE_NCHANNELS WARN_ENABLE_DEBUG_INFO WIN_ENABLE WIN_STRIDE
WORK_ARGS_BYTES WORK_FIFO_BYTES WORK_FIFO_DEPTH
""".split())
# NCCL_-prefixed names read by other software (torch 2.13 c10d/ProcessGroupNCCL.hpp: old names of TORCH_NCCL_*).
FOREIGN_NAMES = {
    LIBRARY_ENV: "read by fastverify to locate libnccl, not by NCCL",
    "NCCL_ASYNC_ERROR_HANDLING": "read by PyTorch (old name of TORCH_NCCL_ASYNC_ERROR_HANDLING), not by NCCL",
    "NCCL_BLOCKING_WAIT": "read by PyTorch (old name of TORCH_NCCL_BLOCKING_WAIT), not by NCCL",
    "NCCL_DESYNC_DEBUG": "read by PyTorch (old name of TORCH_NCCL_DESYNC_DEBUG), not by NCCL",
    "NCCL_ENABLE_TIMING": "read by PyTorch (old name of TORCH_NCCL_ENABLE_TIMING), not by NCCL",
    "NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK": "read by PyTorch, not by NCCL",
}
ALL_NAMES = tuple(sorted(set(CATALOGUE_BY_NAME) | OTHER_NAMES | set(FOREIGN_NAMES)))
