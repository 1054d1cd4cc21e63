"""Worker fixtures: a migrated SQLite store per test and the test model loaded once per session."""

from __future__ import annotations

import pytest

from canvasq.core.settings import Settings
from canvasq.core.store import Store
from tests.harness.backends import model_for_tests


@pytest.fixture(scope="session")
def bundle():
    import torch

    from canvasq.model.loading import load_bundle

    torch.set_num_threads(1)
    return load_bundle(model_for_tests(), device="cpu")


@pytest.fixture
def wstore(tmp_path):
    st = Store(f"sqlite:///{tmp_path / 'w.sqlite'}")
    st.upgrade()
    yield st
    st.dispose()


@pytest.fixture
def wsettings(tmp_path):
    return Settings(
        database_url=f"sqlite:///{tmp_path / 'w.sqlite'}",
        model=model_for_tests(),
        decode_batch_size=4,
        max_attempts=3,
        device="cpu",
    )
