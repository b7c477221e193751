from pathlib import Path

import pytest

from turbine.frontend.models.tokenizer import TextTokenizer
from turbine.model.prepare import prepare


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The embedded SmolLM2-135M-Instruct folder (built and cached on first use)."""
    return prepare()


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path) -> TextTokenizer:
    return TextTokenizer.from_dir(model_dir)
