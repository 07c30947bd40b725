"""Exporters: Prometheus, OpenTelemetry (OTLP), alert rules, Grafana JSON."""
