
import pytest
import torch


# Tiny models gain nothing from a second thread, and OpenMP spinning under any
# other load on the 2 cores makes each small matmul ~10x slower.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tokenizer():
    from tests.helpers.tiny_models import tiny_tokenizer

    return tiny_tokenizer()


@pytest.fixture(scope="session")
def families(tmp_path_factory, tokenizer):
    """Per architecture: a tiny target, two minions close to it, one unrelated."""
    from tests.helpers.tiny_models import make_family

    root = tmp_path_factory.mktemp("families")
    return {arch: make_family(root, arch, tokenizer=tokenizer) for arch in ("llama", "qwen2", "mistral")}
