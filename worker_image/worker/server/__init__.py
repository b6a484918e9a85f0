"""The worker's HTTP server: OpenAI-compatible API, /metrics, /health, /ready and the authenticated /drain."""
