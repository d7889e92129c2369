"""--serve: the OpenAI-compatible HTTP server (handlers, the request shapes, the process's lifecycle)."""
