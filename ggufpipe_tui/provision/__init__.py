"""Giving hosts an agent: the wheels made here, what runs there, the set-up over SSH."""
