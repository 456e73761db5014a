import os
from pathlib import Path

import pytest

# The tests run tiny models: one torch thread is faster than two on 2 cores, and far faster when
# other jobs share them (thread synchronisation dominates such small matmuls). Set before torch loads.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

REPO_ROOT = Path(__file__).resolve().parents[1]
# The public AIME/AMC/MATH-500 files some loader tests read. They are not redistributed in this repository
# (and the hub is out of reach offline): CI's checkout has them beside the clone; elsewhere point
# POISE_SHARED_DATA at a folder holding them (aime25/, math500/, ... as in CI).
SHARED_DATA = Path(os.environ.get("POISE_SHARED_DATA", REPO_ROOT.parent / "shared" / "data"))
SHARED_DATA_ABSENT = ("the public AIME/AMC/MATH-500 files are not in this repository and not beside it "
                      "(../shared/data): set POISE_SHARED_DATA to a folder holding them")
needs_shared_data = pytest.mark.skipif(not SHARED_DATA.is_dir(), reason=SHARED_DATA_ABSENT)
BUNDLED_MODEL = REPO_ROOT / "poise_trl" / "data" / "tiny-qwen3"


@pytest.fixture(scope="module")
def single_thread():
    """Tiny tensors gain nothing from threads, and on a shared 2-core machine they contend
    (for runs where OMP_NUM_THREADS was set to more than 1 before pytest started)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_random_model_dir(tmp_path_factory) -> Path:
    """An untrained 2-layer Qwen3 with the toy tokenizer: same code paths, seconds to build."""
    from poise_trl.run.toy import build_model, build_tokenizer

    path = tmp_path_factory.mktemp("tiny-random-qwen3")
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed=0, hidden_size=32, num_layers=2)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def random_model_dir(tmp_path_factory) -> Path:
    """An untrained 2-layer Qwen3 with the toy tokenizer, for the vLLM server tests: its rollouts differ (the
    trained tiny model's often coincide), so every step learns. The bundled model's head size: vLLM's CPU
    attention has no kernel for `tiny_random_model_dir`'s (8)."""
    from poise_trl.run.toy import build_model, build_tokenizer

    path = tmp_path_factory.mktemp("random-qwen3")
    tokenizer = build_tokenizer()
    build_model(tokenizer, seed=0, hidden_size=128, num_layers=2).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def bundled_model_dir() -> Path:
    if not (BUNDLED_MODEL / "model.safetensors").exists():
        pytest.skip("the bundled tiny model is not built (poise toy build)")
    return BUNDLED_MODEL
