"""The serving engine: requests, scheduling over the hybrid cache, sampling, the offline LLM API."""
