"""Fixtures for the ecosystem's own clients (installed from PyPI as dev dependencies) run
unmodified against `pagedserve serve` (the session's `stack`, tests/conftest.py)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from shared.model_source import resolve_model

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="session")
def hf_dir(stack) -> Path:
    """The served model as a Hugging Face folder (config, tokenizer, safetensors): the
    conversion cache the stack's executor wrote from the bundled GGUF. Clients that need a
    tokenizer (guidellm, lm-eval) or the model itself (lm-eval's `hf`) load it from here,
    since no hub is reachable."""
    folder = resolve_model(MODEL).cache_dir
    assert (folder / "config.json").exists() and (folder / "model.safetensors").exists(), folder
    return folder


@pytest.fixture(scope="session")
def offline_env() -> dict[str, str]:
    """The environment for a client subprocess: no hub, no telemetry."""
    return dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
