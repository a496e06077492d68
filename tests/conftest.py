"""Shared fixtures: the tiny-a oracle GGUF, decompressed once per machine into pytest's cache."""

from __future__ import annotations

import gzip
import hashlib
import os
import platform
import shutil
from pathlib import Path

import pytest
from hypothesis import settings

import ds4lab  # noqa: F401  (first: it loads OpenBLAS before anything imports MLX)

# Property tests draw the same examples on every machine (a failure reproduces anywhere);
# HYPOTHESIS_PROFILE=explore draws fresh ones.
settings.register_profile("derandomized", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "derandomized"))

# The suite runs on every core (pytest-xdist, `--dist loadgroup` in pyproject.toml), test by
# test, except these modules: their module- and session-scoped fixtures take tens of seconds
# (the oracle's forced run, fitted MTP heads, requantized files, the JupyterLab server), so
# each stays on one worker instead of being built on every worker its tests land on.
ONE_WORKER_MODULES = {"test_model_oracle", "test_mtp", "test_requantize", "test_browser"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        module = item.module.__name__ if item.module is not None else ""
        if module in ONE_WORKER_MODULES:
            item.add_marker(pytest.mark.xdist_group(module))


@pytest.fixture(scope="session")
def nvrtc():
    """NVRTC from the dev extra's wheels, as MLX's CUDA back-end runs it (`kernel_cache.Nvrtc`)."""
    if (platform.system(), platform.machine()) != ("Linux", "x86_64"):
        pytest.skip("the NVRTC wheel is for Linux x86_64")
    from ds4lab.model import kernel_cache

    return kernel_cache.default_nvrtc()


REPO_ROOT = Path(__file__).resolve().parent.parent
TINY_A_GZ = REPO_ROOT.parent / "shared" / "oracle" / "tiny-a" / "model.gguf.gz"
TINY_A_SHA256 = "3961a6e7281d6aafe95bb2761f9633455416404ec75c83b1ce8068bd44b84ecf"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


@pytest.fixture(scope="session")
def tiny_a_gguf(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Path of the decompressed tiny-a oracle GGUF (132 MB), checked against its sha256."""
    if not TINY_A_GZ.is_file():
        pytest.fail(
            f"oracle GGUF not found at {TINY_A_GZ}: the tests need the shared/ folder next to the repository",
            pytrace=False,
        )
    cache = getattr(request.config, "cache", None)   # None under -p no:cacheprovider
    folder = Path(cache.mkdir("oracle")) if cache is not None else tmp_path_factory.mktemp("oracle")
    path = folder / "tiny-a.gguf"
    if path.is_file() and _sha256(path) == TINY_A_SHA256:
        return path
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    with gzip.open(TINY_A_GZ) as src, open(partial, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    digest = _sha256(partial)
    if digest != TINY_A_SHA256:
        partial.unlink()
        pytest.fail(f"{TINY_A_GZ} decompresses to sha256 {digest}, expected {TINY_A_SHA256}", pytrace=False)
    partial.replace(path)
    return path


@pytest.fixture(scope="session")
def tiny_a_reader(tiny_a_gguf: Path):
    """gguf-py's own reader of the oracle GGUF: the reference the tests compare against."""
    import gguf

    return gguf.GGUFReader(tiny_a_gguf)


@pytest.fixture(scope="session")
def synth_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("synth")


@pytest.fixture(scope="session")
def tiny_q2(synth_dir: Path) -> Path:
    """The `tiny` preset (tiny-a's shape), q2 experts, seed 0."""
    from ds4lab.synth import make_model

    return make_model(synth_dir / "tiny-q2.gguf", "tiny", "q2", seed=0)[0]


@pytest.fixture(scope="session")
def small_q4_mtp(synth_dir: Path) -> tuple[Path, Path]:
    """The `small` preset (a different shape), Q4_K experts, with its MTP file."""
    from ds4lab.synth import make_model

    main, mtp = make_model(synth_dir / "small-q4.gguf", "small", "q4", mtp=True, seed=3, vocab_rows=512)
    return main, mtp


@pytest.fixture
def on_cpu():
    """Run a test on MLX's CPU device: the bit-exact numerics are the CPU path's."""
    import mlx.core as mx

    before = mx.default_device()
    mx.set_default_device(mx.cpu)
    yield
    mx.set_default_device(before)


@pytest.fixture
def batched(monkeypatch):
    """The GPU's batched schedule on the CPU (no CUDA: the fast path stays off), the state's
    window and RoPE rows kept lazy as there."""
    from ds4lab.model import numerics, rope, state

    for module in (numerics, state, rope):
        monkeypatch.setattr(module, "batch_invariant_device", lambda: False)


@pytest.fixture(scope="module")
def tiny_weights():
    """The tiny preset's q2 weights, random, in memory (the fast-path tests' model)."""
    from ds4lab.config import preset
    from ds4lab.model.random_weights import random_weights

    return random_weights(preset("tiny"), "q2", seed=5)


# Two shapes and seeds, one strength: the successor-structure tests hold on each (tuned to none).
STRUCTURED = (("tiny", 2, 9), ("small", 2, 3))
SUCCESSOR = 0.5


@pytest.fixture(scope="session")
def structured_models(synth_dir: Path) -> list[dict]:
    """Models with language-like structure (`make_model(successor=SUCCESSOR)`, 128 vocabulary
    rows), each with its MTP file: dicts of main, head, rows (the ids in use), succ (the map),
    and the arguments they were made with."""
    import numpy as np

    from ds4lab import gguf
    from ds4lab.synth import make_model, successor_map

    made = []
    for preset, n_layer, seed in STRUCTURED:
        args = {"preset_name": preset, "n_layer": n_layer, "seed": seed, "vocab_rows": 128}
        main, head = make_model(synth_dir / f"{preset}{n_layer}-s{seed}-succ.gguf", mtp=True, successor=SUCCESSOR,
                                **args)
        model_file = gguf.open(main)
        rows = np.flatnonzero(np.abs(model_file.dequantize("token_embd.weight")).sum(axis=1))
        made.append({"main": main, "head": head, "rows": rows, "args": args,
                     "succ": successor_map(model_file.config.n_vocab, rows, seed)})
    return made
