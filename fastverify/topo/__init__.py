"""GPU topology: nvidia-smi topo -m text, NVML, real P2P checks, and the diagnosis behind `fastverify topo`."""
