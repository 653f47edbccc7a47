"""pytest's header names the versions a run used (two transformers
releases are tested: the current one and the oldest 5.x supported)."""

import importlib


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
