"""A non-last stage's output, read out of llama.cpp's compute graph.

The eval callback (``cb_eval``) asks for exactly one tensor, ``l_out-{n-1}``
(the residual stream after the stage's last block), copies it with
``ggml_backend_tensor_get`` (host or device memory alike) into the rows of
the step, once per ubatch, and then returns false, which stops the graph: the
final norm and the vocabulary projection of a non-last stage are never
computed. ``llama_decode`` still returns 0 and every block's KV cache is
written (docs/worker.md, "ExecuteStep").
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ggufpipe_agent.errors import EngineError


class RowCapture:
    """The rows of one step's ``l_out`` tensor of a stage of ``block_count``
    blocks, ``hidden`` wide; ``ggml`` is the ggml library (llama/devices.py)."""

    def __init__(self, ggml: Any, block_count: int, hidden: int) -> None:
        self._ggml = ggml
        self.name = f"l_out-{block_count - 1}".encode()
        self.hidden = hidden
        self._rows: np.ndarray | None = None
        self._row = 0

    def begin(self, n: int) -> None:
        """A step of ``n`` rows starts: its rows are captured from here."""
        self._rows = np.empty((n, self.hidden), dtype=np.float32)
        self._row = 0

    def take(self, n: int) -> np.ndarray:
        """The step's ``n`` rows, all of them captured."""
        rows, self._rows = self._rows, None
        assert rows is not None
        if self._row != n:
            raise EngineError(f"captured {self._row} of {n} activation rows from {self.name.decode()}")
        return rows

    def on_eval(self, tensor: int, ask: bool, _user: int) -> bool:
        """llama.cpp's eval callback: asked, whether to see ``tensor``; then
        false (stop the graph) once the stage's output is copied."""
        lib = self._ggml
        if ask:
            return bool(lib.get_name(tensor) == self.name)
        if lib.get_name(tensor) != self.name:
            return True
        assert self._rows is not None
        nbytes = lib.nbytes(tensor)
        end = self._row + nbytes // (4 * self.hidden)
        if end > self._rows.shape[0]:
            return False
        lib.tensor_get(tensor, self._rows[self._row : end].ctypes.data, 0, nbytes)
        self._row = end
        return False
