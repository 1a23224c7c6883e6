"""The tiny encoder checkpoints (tests/encoder_checkpoints.py), each built once a session."""

from __future__ import annotations

import pytest

from tests.encoder_checkpoints import build_encoder_checkpoint


@pytest.fixture(scope="session")
def encoder_checkpoint(tmp_path_factory):
    cache: dict = {}

    def get(name: str):
        if name not in cache:
            cache[name] = build_encoder_checkpoint(tmp_path_factory.mktemp(name), name)
        return cache[name]

    return get
