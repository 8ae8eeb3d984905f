"""HTTP API (FastAPI). Filled by the service issue; it never imports torch."""
