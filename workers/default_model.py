"""The model `mtpserve serve` and `mtpserve generate` use when no --model is given.

The trained default model ships inside the package (workers/default_model/) once present;
until then, and for fast tests, the deterministic tiny random checkpoint is made on first use in
the user's cache directory.
"""

from __future__ import annotations

import os

SHIPPED_DIR = os.path.join(os.path.dirname(__file__), "default_model")


def cache_dir() -> str:
    from kernels.settings import settings

    return settings().cache_home


def default_model_path() -> str:
    if os.path.isfile(os.path.join(SHIPPED_DIR, "config.json")):
        return SHIPPED_DIR
    return tiny_model_path()


def tiny_model_path(seed: int = 0) -> str:
    """The tiny random checkpoint for `seed`, made once (atomically) in the cache directory."""
    from workers.tiny_model import make_tiny_model

    path = os.path.join(cache_dir(), f"tiny-model-seed{seed}")
    if not os.path.isfile(os.path.join(path, "model.safetensors.index.json")):
        tmp = f"{path}.tmp{os.getpid()}"
        make_tiny_model(tmp, seed=seed)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            os.rename(tmp, path)
        except OSError:  # another process made it first
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    return path
