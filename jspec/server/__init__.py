"""The OpenAI-compatible HTTP server (scripts/serve.py runs it)."""
