"""Reading PyTorch profiler (Kineto) Chrome traces into per-rank event tables. Never imports torch."""
