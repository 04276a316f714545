"""Offline research tools: routing traces (record, replay), the trace simulator, synthetic and
ShareGPT workloads. Used by `moetide.bench` and `scripts/`; the engine never imports this package."""
