"""fastverify: profile and speed up the tensor-parallel verify step of EAGLE speculative decoding."""

__version__ = "0.1.0"
