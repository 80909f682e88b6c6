"""Live synthetic verify forward: a tensor-parallel model with the real per-rank shapes and
collective sequence of a DeepSeek-V3 / Kimi-K2 (or Llama-style) checkpoint, random weights, timed
per op region on every rank.

Public entry points: :func:`load_model_config`, :func:`check_tp` (no torch needed) and
:func:`fastverify.live.runner.run_live` (imports torch when called).
"""

from fastverify.live.config import ModelConfig, check_tp, load_model_config, preset_names

__all__ = ["ModelConfig", "check_tp", "load_model_config", "preset_names"]
