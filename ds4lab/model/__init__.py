"""DeepSeek V4 in MLX, one module per component (see model.py for the stack)."""

from __future__ import annotations

from .model import FAST_PATH_POINTS, NUMERICS, Model
from .session import Session

__all__ = ["FAST_PATH_POINTS", "NUMERICS", "Model", "Session", "load"]


def load(path, numerics: str = "float", mtp=None) -> Model:
    """Open a ds4 GGUF, load its weights (routed experts kept in block form) and return the Model.
    `mtp`: ds4's MTP GGUF for this model (`model.mtp`, drafts for `ds4lab.mtp`)."""
    from .. import gguf
    from .mtp import load_mtp
    from .weights import load_weights

    model_file = gguf.open(path)
    head = None if mtp is None else load_mtp(mtp, model_file.config)
    return Model(load_weights(model_file), numerics=numerics, source=str(path), mtp=head)
