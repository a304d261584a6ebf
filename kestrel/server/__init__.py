"""The OpenAI-compatible HTTP server over the engine."""
