"""Process-wide observability setup shared by every Ferry process (worker, gateway, CLI):
``observability.logging`` configures structured logs, ``observability.vllm_metrics``
renders vLLM's metric names. Torch-free and importable by every layer, so nothing below
the CLI has to import ``ferry``."""
