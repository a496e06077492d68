"""Where ds4lab keeps what it generates: synthetic models and caches (0700 directories)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$DS4LAB_CACHE, else ~/.cache/ds4lab; created private (0700) since caches can hold prompts."""
    root = Path(os.environ.get("DS4LAB_CACHE") or Path.home() / ".cache" / "ds4lab")
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    return root


def synthetic_model(preset: str = "tiny", variant: str = "q2", seed: int = 0, **kwargs: object) -> Path:
    """Path of a synthetic model in the cache, written on first use (same arguments, same file).
    `kwargs` are `synth.make_model`'s (mtp, n_layer, vocab_rows, successor, ...); each one given
    names the file (`tiny-q2-s5-mtpTrue-n_layer2-successor0.5-vocab_rows128.gguf`)."""
    from .synth import make_model, mtp_path

    extra = "".join(f"-{k}{v}" for k, v in sorted(kwargs.items()) if v is not None)
    path = cache_dir() / f"{preset}-{variant}-s{seed}{extra}.gguf"
    if not path.exists() or (kwargs.get("mtp") and not mtp_path(path).exists()):
        make_model(path, preset, variant, seed=seed, **kwargs)
    return path
