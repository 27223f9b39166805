"""The gateway's Prometheus metrics: its own series per app (``prometheus``), and the
fleet's ``vllm:*`` view rebuilt from the workers' heartbeats at each scrape (``fleet``).
Imports the protocol and ``observability``; never the routes.
"""
