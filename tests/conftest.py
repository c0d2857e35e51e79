import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "default",
    deadline=None,
    max_examples=40,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> str:
    """A tiny random model + tokenizer saved as a model directory (the CLI's --model)."""
    import tiny

    return str(tiny.save(tmp_path_factory.mktemp("tiny-model")))
