"""Architectures beyond the llama family, one module each.

Each module defines ``ARCHITECTURE`` (:class:`ggufpipe_agent.gguf.rules.Architecture`):
its name as ``general.architecture`` says it, how its split was proven exact,
and its split rules (a check that refuses what cannot be exact, the metadata
a stage file must carry, the tensors every stage keeps, where stages may
start). A module is accepted only with its split-exactness test,
``tests/model/test_arch_<module>.py``.
"""
