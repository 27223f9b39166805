"""Per-adapter Prometheus series: requests and output tokens by LoRA adapter, and how many
adapters the worker has loaded (``ferry top`` shows their names from the heartbeat).

Its own small module beside ``metrics.py`` because the label set is open-ended (one series
per adapter): the names are capped (``MAX_LABELLED``; later ones count under ``other``),
so a fleet loading thousands of adapters cannot blow up the scrape.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from worker.service.metrics.prometheus import PREFIX

MAX_LABELLED = 256


class LoraMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(PREFIX + "lora_requests_total",
                                "Requests admitted, by LoRA adapter.", ["adapter"],
                                registry=registry)
        self.tokens = Counter(PREFIX + "lora_output_tokens_total",
                              "Output tokens of finished requests, by LoRA adapter.",
                              ["adapter"], registry=registry)
        self.loaded = Gauge(PREFIX + "lora_adapters_loaded",
                            "LoRA adapters this worker has registered.", registry=registry)
        self._labelled: set[str] = set()

    def _label(self, adapter: str) -> str:
        if adapter in self._labelled or len(self._labelled) < MAX_LABELLED:
            self._labelled.add(adapter)
            return adapter
        return "other"

    def admitted(self, adapter: str) -> None:
        self.requests.labels(adapter=self._label(adapter)).inc()

    def finished(self, adapter: str, output_tokens: int) -> None:
        self.tokens.labels(adapter=self._label(adapter)).inc(output_tokens)
