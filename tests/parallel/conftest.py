"""One tiny checkpoint per model for the whole session, written once and read by every rank of every test."""
import pytest

from tests.parallel import common


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-checkpoints")
    return {model: common.write_checkpoint(model, root / model) for model in common.SM}


@pytest.fixture(scope="session")
def references(checkpoints):
    """(model, fp32) -> one-process logits."""
    return {(model, fp32): common.reference_logits(model, path, fp32)
            for model, path in checkpoints.items() for fp32 in (False, True)}
