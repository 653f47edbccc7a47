"""kvevict: KV-cache eviction policies (H2O, recent window + sinks, random,
exact greedy) for NumPy arrays and PyTorch tensors.

A thin layer over kvevict's C++ batched API: every decision comes from the
C++ library (the host backend for NumPy arrays and torch CPU tensors, the
CUDA kernels for torch CUDA tensors), so Python, C++ and CUDA engines make
the same decisions bit for bit. See docs/python.md.

- :class:`BatchedPolicy`: one layer's policy for a ragged batch;
- :class:`CacheView`: your K/V buffers (bhsd, bshd, paged);
- configs: :class:`H2OConfig`, :class:`RecentWindowConfig`,
  :class:`RandomConfig`, :class:`ExactGreedyConfig`; :class:`SnapKV`, the
  parameters of SnapKV's prompt scoring (:meth:`BatchedPolicy.prefill_snapkv`);
- ``kvevict.ops``: the same calls as ``torch.ops.kvevict`` custom ops;
- ``kvevict.hf``: an evicting cache for Hugging Face transformers;
- :class:`SequencePolicy`: the per-sequence host API (one call per sequence).
"""

from ._ext import (
    CUDA as cuda_available,
    BudgetError,
    CudaError,
    Error,
    InvalidArgument,
    NonFiniteError,
    OutOfRange,
    StateError,
)
from .cache import CacheView
from .config import ExactGreedyConfig, H2OConfig, PolicyConfig, RandomConfig, RecentWindowConfig, SnapKV
from .policy import BatchedPolicy
from .sequence import SequencePolicy

__version__ = "0.1.0"

__all__ = [
    "BatchedPolicy",
    "BudgetError",
    "CacheView",
    "CudaError",
    "Error",
    "ExactGreedyConfig",
    "H2OConfig",
    "InvalidArgument",
    "NonFiniteError",
    "OutOfRange",
    "PolicyConfig",
    "RandomConfig",
    "RecentWindowConfig",
    "SequencePolicy",
    "SnapKV",
    "StateError",
    "cuda_available",
]
