"""A client of the Prometheus HTTP query API (`/api/v1/query`), which Thanos, Mimir and VictoriaMetrics answer too.

Plain HTTP (urllib) rather than a client package: the one call used is a GET of an instant query returning JSON,
and the kept Python clients pull in pandas and matplotlib (prometheus-api-client) or serve only the write side
(prometheus_client). Every failure is a `PrometheusError` whose message is one line saying what to do: nothing
listening, an auth error, a bad query, an answer that is not Prometheus's.
"""

from __future__ import annotations

import base64
import json
import math
import socket
import urllib.error
import urllib.parse
import urllib.request
from typing import Any


class PrometheusError(RuntimeError):
    """The query API could not answer (the message is one line)."""


class PromApi:
    """Instant queries against `url` (the server's base URL: http://host:9090, or a Thanos/Mimir query frontend's
    Prometheus-compatible prefix). `token`: a bearer token; `user`/`password`: basic auth."""

    def __init__(self, url: str, *, timeout_s: float = 30.0, token: str | None = None,
                 user: str | None = None, password: str | None = None) -> None:
        if not url.startswith(("http://", "https://")):
            raise PrometheusError(f"--prometheus takes an http(s) URL, got {url!r}")
        if timeout_s <= 0:
            raise ValueError("timeout_s must be > 0")
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.headers = {"Accept": "application/json"}
        if token:
            self.headers["Authorization"] = f"Bearer {token}"
        elif user is not None:
            raw = f"{user}:{password or ''}".encode()
            self.headers["Authorization"] = "Basic " + base64.b64encode(raw).decode()

    def query(self, promql: str, at: float | None = None) -> list[tuple[dict[str, str], float]]:
        """(labels, value) of each series of an instant vector (a scalar: one with no labels); NaN values dropped."""
        params = {"query": promql}
        if at is not None:
            params["time"] = f"{at:.3f}"
        req = urllib.request.Request(f"{self.url}/api/v1/query?{urllib.parse.urlencode(params)}", headers=self.headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                body = resp.read()
        except urllib.error.HTTPError as exc:
            if exc.code in (401, 403):
                raise PrometheusError(f"{self.url} refused the query (HTTP {exc.code}): pass its credentials "
                                      "(--prometheus-token, or user:password in the URL)") from None
            detail = _error_text(exc)
            raise PrometheusError(f"{self.url} answered HTTP {exc.code}{': ' + detail if detail else ''}") from None
        except (urllib.error.URLError, socket.timeout, ConnectionError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise PrometheusError(f"cannot reach Prometheus at {self.url} ({reason}): is it running, and is this "
                                  "its base URL?") from None
        try:
            doc = json.loads(body)
        except ValueError:
            raise PrometheusError(f"{self.url} did not answer with Prometheus's JSON (is this the query API's base "
                                  "URL?)") from None
        if not isinstance(doc, dict) or doc.get("status") != "success":
            raise PrometheusError(f"{self.url} could not run the query: {doc.get('error') if isinstance(doc, dict) else doc}")
        data = doc.get("data") or {}
        kind, result = data.get("resultType"), data.get("result")
        if kind == "scalar":
            return [({}, float(result[1]))]
        if kind != "vector":
            raise PrometheusError(f"{self.url} answered a {kind} where an instant vector was asked for")
        out = []
        for s in result or ():
            v = float(s["value"][1])
            if not math.isnan(v):
                out.append((dict(s.get("metric") or {}), v))
        return out

    def names(self) -> set[str]:
        """Every metric name the server holds (to say which series are missing)."""
        req = urllib.request.Request(f"{self.url}/api/v1/label/__name__/values", headers=self.headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                return set(json.loads(resp.read()).get("data") or ())
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise PrometheusError(f"cannot list the metric names of {self.url}: {exc}") from None


def _error_text(exc: urllib.error.HTTPError) -> str:
    try:
        doc: Any = json.loads(exc.read())
        return str(doc.get("error", "")).splitlines()[0][:200]
    except (ValueError, AttributeError, IndexError, OSError):
        return ""
