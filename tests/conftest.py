from __future__ import annotations

import os

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _settings_follow_the_environment():
    """Tests change the environment (monkeypatch.setenv) and undo it: the settings the code
    reads once per process follow it during the test and are read afresh after it."""
    from kernels.settings import reload_settings

    reload_settings()
    yield
    reload_settings()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """The tiny random checkpoint, made once per test session."""
    from workers.tiny_model import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("tiny-model")), seed=0)
