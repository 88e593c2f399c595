"""The OpenAI-compatible HTTP server: protocol models, serving logic, the FastAPI app, metrics and `serve`."""
