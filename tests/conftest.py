"""Suite-wide settings that must exist before any project module is imported."""

import os

# Triton kernels run on the CPU through the interpreter when no GPU is present; the flag
# is read when triton is first imported, which importing `worker` or `kernels` can do.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
