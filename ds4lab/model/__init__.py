"""DeepSeek V4 in MLX, one module per component (see model.py for the stack)."""

from __future__ import annotations

from .model import NUMERICS, Model
from .session import Session

__all__ = ["NUMERICS", "Model", "Session", "load"]


def load(path, numerics: str = "float") -> Model:
    """Open a ds4 GGUF, load its weights (routed experts kept in block form) and return the Model."""
    from .. import gguf
    from .weights import load_weights

    model_file = gguf.open(path)
    return Model(load_weights(model_file), numerics=numerics, source=str(path))
