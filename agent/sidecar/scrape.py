"""Scrape mode: poll an inference server's Prometheus `/metrics` and store what maps.

For servers where no code may be added (vLLM without the plugin, SGLang, TGI,
TensorRT-LLM). Each `sample()` fetches the endpoint once (text format, parsed
by prometheus_client's parser) and returns:

- `ServerMetric` rows for every sample of the server's own families (request
  latency histograms as `_bucket{le=...}`/`_sum`/`_count`, KV usage, running and
  waiting requests, token counters), with the engine label as `engine`;
- `PrefixCounters` per engine from vLLM's `vllm:prefix_cache_queries_total` /
  `vllm:prefix_cache_hits_total` (the same counters the plugin matches);
- `RunLabel`s from vLLM's `vllm:cache_config_info` (block size, KV blocks, ...), once.

What scrape mode cannot give (there is no such figure on `/metrics`): per-step
records (phase, tokens, step time, TP-rank stragglers), per-request lifecycle
events (only histograms), page-level KV accounting (fragmentation, cached and
shared pages, largest free run, churn), recomputation after preemption and
evicted blocks. `CANNOT` lists them; the CLI prints it.

Quiet for the environment: an unreachable endpoint gives no rows (counted in
`failures`, logged once per outage).
"""

from __future__ import annotations

import logging
import os
import time
import urllib.request
import uuid
from typing import Callable

from ..records.events import Hello, PrefixCounters, Record, RunLabel, ServerMetric

log = logging.getLogger("phasescope.scrape")

CANNOT = ("per-step records (phase, tokens, step time, per-rank stragglers)",
          "per-request lifecycle events (only latency histograms)",
          "page-level KV accounting (fragmentation, cached/shared pages, free runs, churn)",
          "recomputation after preemption, evicted blocks")

_PREFIX = {"vllm:prefix_cache_queries": "queried", "vllm:prefix_cache_hits": "hit"}
_INFO_LABELS = ("block_size", "num_gpu_blocks", "enable_prefix_caching", "cache_dtype", "gpu_memory_utilization")
_SKIP_LABELS = {"engine", "model_name"}
_SKIP_FAMILIES = ("python_", "process_", "http_")  # the web server's own process, not inference


def _fetch(url: str, timeout_s: float) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:  # noqa: S310 - a URL the operator gave
        return resp.read().decode("utf-8", "replace")


class ScrapeCollector:
    """Polls one `/metrics` URL; a sidecar collector with a source of its own (`hello()`)."""

    def __init__(self, url: str, run_id: str | None = None, timeout_s: float = 2.0,
                 fetch: Callable[[str, float], str] = _fetch,
                 clock_ns: Callable[[], int] = time.monotonic_ns) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"scrape URL must be http(s)://..., got {url!r}")
        if timeout_s <= 0:
            raise ValueError("timeout_s must be > 0")
        self.url = url
        self.run_id = (run_id or uuid.uuid4().hex[:16])[:16]
        self.timeout_s = timeout_s
        self._fetch = fetch
        self._clock_ns = clock_ns
        self.failures = 0
        self.scrapes = 0
        self._down = False
        self._labels_sent = False

    def hello(self) -> Hello:
        """Who the scraped rows come from (one `sources` row)."""
        now = self._clock_ns()
        return Hello(now, time.time_ns() - now, os.getpid(), 0, 1, self.run_id,
                     self.url.encode()[:48].decode("utf-8", "ignore"), "scrape")

    def sample(self) -> list[Record]:
        try:
            text = self._fetch(self.url, self.timeout_s)
        except Exception as exc:  # noqa: BLE001 - the server may be starting or gone
            self.failures += 1
            if not self._down:
                log.info("scrape of %s failed (%r); retrying", self.url, exc)
                self._down = True
            return []
        self._down = False
        self.scrapes += 1
        return self.parse(text)

    def parse(self, text: str) -> list[Record]:
        """Records from one exposition text (pure apart from the clock)."""
        from prometheus_client.parser import text_string_to_metric_families

        now = self._clock_ns()
        out: list[Record] = []
        prefix: dict[int, dict[str, float]] = {}
        for fam in text_string_to_metric_families(text):
            if fam.name == "vllm:cache_config_info":
                if not self._labels_sent:
                    for s in fam.samples:
                        for k in _INFO_LABELS:
                            if k in s.labels:
                                out.append(RunLabel(now, k, str(s.labels[k])[:96]))
                    self._labels_sent = True
                continue
            if fam.name.startswith(_SKIP_FAMILIES):
                continue
            for s in fam.samples:
                if s.name.endswith("_created"):
                    continue
                engine = _engine(s.labels.get("engine"))
                if fam.name in _PREFIX and s.name.endswith("_total"):
                    slot = prefix.setdefault(engine, {})
                    slot[_PREFIX[fam.name]] = slot.get(_PREFIX[fam.name], 0.0) + s.value
                rest = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in _SKIP_LABELS)
                out.append(ServerMetric(now, engine, _fit(s.name, 64), _fit(rest, 64), float(s.value)))
        for engine, c in sorted(prefix.items()):
            out.append(PrefixCounters(now, engine, int(c.get("queried", 0)), int(c.get("hit", 0)), 0, 0))
        return out


def _engine(text: str | None) -> int:
    try:
        return max(0, min(int(text or 0), 65535))
    except ValueError:
        return 0


def _fit(text: str, width: int) -> str:
    raw = text.encode("utf-8")
    return text if len(raw) <= width else raw[:width].decode("utf-8", "ignore")
