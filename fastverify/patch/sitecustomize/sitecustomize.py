"""fastverify's import hook for SGLang releases without general plugins.

``fastverify launch`` puts this folder first on ``PYTHONPATH``; Python's ``site`` imports this file
at start-up in the launcher and in every process SGLang spawns (spawned children run ``site`` and
inherit the environment). Unless ``FASTVERIFY_PATCH=1`` it only runs the ``sitecustomize`` it
shadows. With the flag it waits for SGLang's scheduler module (imported by every TP rank before
distributed init) to finish loading, then calls :func:`fastverify.patch.plugin` -- the same code the
plugin entry point runs. It never raises.
"""

import os
import sys

_TRIGGERS = ("sglang.srt.managers.scheduler",)
_HERE = os.path.dirname(os.path.abspath(__file__))


def _chain_other_sitecustomize():
    """Run the next ``sitecustomize.py`` on ``sys.path`` (the one this file shadows)."""
    import importlib.util

    for entry in sys.path:
        try:
            if not entry or os.path.abspath(entry) == _HERE:
                continue
            path = os.path.join(entry, "sitecustomize.py")
            if os.path.isfile(path):
                spec = importlib.util.spec_from_file_location("_fastverify_chained_sitecustomize", path)
                mod = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(mod)
                return
        except Exception:
            return


class _AfterImport:
    """Meta-path finder: when a trigger module has executed, run the patch once."""

    def __init__(self):
        self.done = False

    def find_spec(self, name, path=None, target=None):
        if self.done or name not in _TRIGGERS:
            return None
        import importlib.machinery

        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader, hook = spec.loader, self
        original_exec = loader.exec_module

        def exec_module(module):
            original_exec(module)
            if not hook.done:
                hook.done = True
                try:
                    from fastverify.patch import plugin  # lazy: plugin

                    plugin()
                except Exception as err:
                    sys.stderr.write(f"fastverify patch: import hook could not run the patch ({err})\n")

        loader.exec_module = exec_module
        return spec


def _main():
    # CUDA_DEVICE_MAX_CONNECTIONS for the ranks (fastverify.patch.launch.settings_env): SGLang's
    # launcher writes 8 before it spawns them, and each rank reaches cuInit (torch.cuda.is_available)
    # while importing SGLang, before any plugin runs. Here, at interpreter start, CUDA is untouched.
    cdmc = os.environ.get("FASTVERIFY_CUDA_DEVICE_MAX_CONNECTIONS")
    if cdmc:
        os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = cdmc
    # With the plugin route the entry point runs the patch; this file is here only for the line above.
    if os.environ.get("FASTVERIFY_PATCH") == "1" and os.environ.get("FASTVERIFY_PATCH_ROUTE") != "plugin":
        if not any(isinstance(f, _AfterImport) or type(f).__name__ == "_AfterImport" for f in sys.meta_path):
            sys.meta_path.insert(0, _AfterImport())
        if any(t in sys.modules for t in _TRIGGERS):  # already imported (unusual): patch now
            try:
                from fastverify.patch import plugin  # lazy: plugin

                plugin()
            except Exception:
                pass
    _chain_other_sitecustomize()


try:
    _main()
except Exception:
    pass
