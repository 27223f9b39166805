"""What a step hands back and how it becomes text: the ids-only ``StepBatch``, the
detokenizers (the byte table fast path, the incremental window fallback), stop strings,
and the text outputs. Torch-free (the output process imports it), and imports no other
room of the engine.
"""
