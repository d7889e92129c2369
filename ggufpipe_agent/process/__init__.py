"""The agent process: the runtime, one control session per orchestrator, shared
processes, the listener, links to peer stages, heartbeats."""
