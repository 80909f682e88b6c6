"""What ``fastverify launch`` hands every SGLang rank, and how: the environment variables the patch
reads in the rank, SGLang's general-plugin group with fastverify's entry point name in it, and the
two routes that load the patch (the entry point, or the ``sitecustomize`` import hook).

Constants only, no imports: the plugin entry point (:func:`fastverify.patch.plugin`) imports this
module in every SGLang process, patched or not.
"""

ENV_FLAG = "FASTVERIFY_PATCH"
ENV_BACKEND = "FASTVERIFY_BACKEND"
ENV_PROFILE_VERIFY = "FASTVERIFY_PROFILE_VERIFY"
ENV_PROFILE_VERIFY_STEPS = "FASTVERIFY_PROFILE_VERIFY_STEPS"  # also a torch.profiler trace of this many verify steps
ENV_CUDA_MAX_CONNECTIONS = "FASTVERIFY_CUDA_DEVICE_MAX_CONNECTIONS"
ENV_PATCH_ROUTE = "FASTVERIFY_PATCH_ROUTE"
"""``plugin`` when the entry point runs the patch and the hook folder is on ``PYTHONPATH`` only to
restore ``CUDA_DEVICE_MAX_CONNECTIONS`` at start-up."""
PLUGIN_NAME = "fastverify"
PLUGIN_GROUP = "sglang.srt.plugins"
ROUTE_PLUGIN = "plugin entry point"
ROUTE_HOOK = "import hook"
