"""ds4lab: a research toolkit for DeepSeek V4 Flash as the ds4 engine runs it."""

from __future__ import annotations

from ._blas import preload_openblas
from ._cuda_graphs import set_graph_limits

preload_openblas()
set_graph_limits()

from . import gguf
from .config import ModelConfig
from .errors import Ds4labError, ModelFileError
from .generation import generate, stream
from .model import load
from .synth import make_model

__all__ = ["Ds4labError", "ModelConfig", "ModelFileError", "generate", "gguf", "load", "make_model", "stream"]
__version__ = "0.1.0"
