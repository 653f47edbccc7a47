"""pytest's header names the versions a run used (two transformers
releases are tested: the current one and the oldest 5.x supported)."""

import importlib

import pytest


def pytest_report_header(config):
    versions = []
    for name in ("numpy", "torch", "transformers", "kvevict"):
        try:
            module = importlib.import_module(name)
            versions.append(f"{name} {getattr(module, '__version__', '?')}")
        except ImportError:
            versions.append(f"{name} absent")
    import kvevict

    versions.append(f"kvevict CUDA backend {'built' if kvevict.cuda_available else 'not built'}")
    return "versions: " + ", ".join(versions)


@pytest.fixture
def cuda_torch():
    """torch, for a test that compares the CUDA backend with the host; skips
    without the CUDA backend or a GPU."""
    torch = pytest.importorskip("torch")
    import kvevict

    if not (kvevict.cuda_available and torch.cuda.is_available()):
        pytest.skip("needs the CUDA backend and a GPU")
    return torch
