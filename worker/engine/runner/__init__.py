"""The model and its forward: loading a checkpoint, the KV tensors, a step's flat inputs
and device block tables, CUDA graphs for decodes, warm-up, and the attention backends
(``attention/``) and the lean CPU path (``cpu/``). May import ``kv`` and ``sched``'s
output types; never the sampler.
"""
