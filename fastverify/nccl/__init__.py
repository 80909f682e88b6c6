"""NCCL knowledge: settings catalogue and validator, library version, NCCL_DEBUG log and nccl-tests parsers, all-reduce cost model."""
