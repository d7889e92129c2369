"""The front ends that are commands: headless --prompt, --plan, and the cache command."""
