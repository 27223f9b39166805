"""Tensor parallelism inside one worker: the process group, the shard plan and the layers."""
