"""HTTP serving: OpenAI-compatible routes, native /generate, Prometheus metrics."""
