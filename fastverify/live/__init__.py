"""Live synthetic verify forward: a tensor-parallel model with the real per-rank shapes and
collective sequence of a DeepSeek-V3 / Kimi-K2 (or Llama-style) checkpoint, random weights, timed
per op region on every rank.

Public entry points: :func:`load_model_config`, :func:`check_tp` (no torch needed) and
:func:`run_live` (imports torch when called).
"""

from fastverify.live.config import ModelConfig, check_tp, load_model_config, preset_names

__all__ = ["ModelConfig", "check_tp", "load_model_config", "preset_names", "run_live"]


def __getattr__(name: str):
    # run_live pulls in torch; keep `import fastverify.live` cheap for the CLI and the analyzer.
    if name == "run_live":
        from fastverify.live.runner import run_live

        return run_live
    raise AttributeError(f"module 'fastverify.live' has no attribute {name!r}")
