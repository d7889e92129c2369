"""What crosses a connection: control messages, their records and codec, object
frames. Plain data: imports nothing of the agent above it."""
