"""Type stubs of kvevict._ext, the nanobind module over kvevict's C++
batched API. Internal: use kvevict.BatchedPolicy, kvevict.ops and
kvevict.SequencePolicy. Arrays are anything DLPack can carry (NumPy arrays,
torch tensors, nanobind arrays); ``stream`` is a cudaStream_t as an integer
(0: the legacy default stream), ignored for host memory."""

from typing import Any, Dict, List, Optional, Sequence, Tuple

Array = Any

CUDA: bool
"""Whether this build has the CUDA backend (nvcc was found when it was built)."""
STATUS_CLEAR: int
"""The value of a clear status word."""
STATE_HEADER_BYTES: int
"""Bytes before the kvevict state in a state array (the status word's place)."""

class Error(Exception): ...
class InvalidArgument(Error, ValueError): ...
class BudgetError(InvalidArgument): ...
class OutOfRange(InvalidArgument, IndexError): ...
class NonFiniteError(InvalidArgument): ...
class StateError(Error, RuntimeError): ...
class CudaError(Error, RuntimeError): ...

class Descriptor:
    """A batched policy's shape and configuration: (kind, num_seqs,
    num_kv_heads, num_q_heads, capacity, a, b, c, seed_lo, seed_hi,
    history_max_tokens, history_head_dim), validated by the C++ library."""

    def __init__(self, values: Sequence[int]) -> None: ...
    @property
    def state_bytes(self) -> int: ...
    @property
    def budget(self) -> int: ...
    @property
    def values(self) -> List[int]: ...

def init(desc: Descriptor, state: Array, stream: int = 0) -> None: ...
def reset(desc: Descriptor, state: Array, active: Optional[Array] = None, streams: Optional[Array] = None, stream: int = 0) -> None: ...
def append(desc: Descriptor, state: Array, active: Optional[Array] = None, stream: int = 0) -> None: ...
def append_kv(
    desc: Descriptor, state: Array, layout: int, k_cache: Array, v_cache: Array, page_table: Optional[Array],
    k_new: Array, v_new: Array, active: Optional[Array] = None, stream: int = 0,
) -> None: ...
def observe_evict(
    desc: Descriptor, state: Array, input: int, x: Array, lse: Optional[Array], scale: float, base: int,
    victims: Optional[Array], active: Optional[Array] = None, stream: int = 0,
) -> None: ...
def observe_evict_queries(
    desc: Descriptor, state: Array, queries: Array, lse: Array, scale: float, base: int, layout: int,
    k_cache: Array, v_cache: Array, page_table: Optional[Array], victims: Optional[Array],
    active: Optional[Array] = None, stream: int = 0,
) -> None: ...
def observe_evict_key_norms(
    desc: Descriptor, state: Array, layout: int, k_cache: Array, page_table: Optional[Array],
    victims: Optional[Array], active: Optional[Array] = None, stream: int = 0,
) -> None:
    """Observe + evict from the key norms of k_cache (read only; no V)."""

def observe_evict_key_diff(
    desc: Descriptor, state: Array, layout: int, k_cache: Array, page_table: Optional[Array],
    victims: Optional[Array], active: Optional[Array] = None, stream: int = 0,
) -> None:
    """Observe + evict by KeyDiff from k_cache (read only; no V): an h2o state made with head_dim."""

def append_tokens(desc: Descriptor, state: Array, tokens: int, active: Optional[Array] = None, stream: int = 0) -> None: ...
def evict_to(
    desc: Descriptor, state: Array, target: int, layout: int, k_cache: Array, v_cache: Array,
    page_table: Optional[Array], queries: Optional[Array], lse: Optional[Array], scale: float, base: int,
    freed: Optional[Array], active: Optional[Array] = None, stream: int = 0,
) -> None: ...
def evict_to_moves(
    desc: Descriptor, state: Array, target: int, moves: Array, move_counts: Array, active: Optional[Array] = None,
    stream: int = 0,
) -> None: ...
def prefill(
    desc: Descriptor, state: Array, lengths: Array, max_length: int, input: int, x: Optional[Array],
    lse: Optional[Array], scale: float, base: int, layout: int, k_cache: Array, v_cache: Array,
    page_table: Optional[Array], reclaimable_pages: Optional[Array], active: Optional[Array] = None,
    workspace: Optional[Array] = None, stream: int = 0,
) -> int:
    """input: 0 probs, 1 column sums, 2 queries + lse, 3 none, 4 the norms of
    the cached keys (x None). Host: compresses and returns 0. CUDA: with
    workspace None returns the workspace bytes needed and runs nothing;
    otherwise runs and returns 0."""

def prefill_key_diff(
    desc: Descriptor, state: Array, lengths: Array, max_length: int, layout: int, k_cache: Array, v_cache: Array,
    page_table: Optional[Array], reclaimable_pages: Optional[Array], active: Optional[Array] = None,
    workspace: Optional[Array] = None, stream: int = 0,
) -> int:
    """KeyDiff prefill (prompts only): position p scores -cos(k_p, the sum of
    its head's unit prompt keys), read from k_cache alone. Workspace and
    return value as prefill."""

def prefill_snapkv(
    desc: Descriptor, state: Array, lengths: Array, max_length: int, input: int, x: Array, lse: Optional[Array],
    scale: float, base: int, pool_width: int, pooling: int, layout: int, k_cache: Array, v_cache: Array,
    page_table: Optional[Array], reclaimable_pages: Optional[Array], active: Optional[Array] = None,
    workspace: Optional[Array] = None, stream: int = 0,
) -> int:
    """SnapKV prefill (h2o): input 0 window probs [B][Hq][window][>= M], 1
    window logits [B][Hq][window][>= M] with lse [B][Hq][window], 2 window
    queries [B][Hq][window][head_dim] with lse; the window is x's extent in
    dimension 2, pooling 0 max, 1 mean. Workspace and return value as
    prefill."""

def status_word(desc: Descriptor, state: Array, stream: int = 0) -> int: ...
def check(desc: Descriptor, state: Array, stream: int = 0, call: str = "check") -> None: ...
def state_offsets(desc: Descriptor, state: Array) -> Dict[str, Optional[int]]: ...
def as_bfloat16(array: Array) -> Any: ...
def _bench_decode_steps(desc: Descriptor, state: Array, probs: Array, victims: Array, steps: int) -> float:
    """Benchmark hook: ns per decode step (append + observe_evict) in a C++ loop."""

def h2o_from_ratios(length: int, heavy_ratio: float, recent_ratio: float) -> Tuple[int, int]: ...
def recent_window_from_ratio(length: int, ratio: float, sinks: int) -> Tuple[int, int]: ...

class _SequencePolicy:
    budget: int
    def append(self, b: int) -> int: ...
    def observe_probs(self, b: int, probs: Array) -> None: ...
    def observe_head_scores(self, b: int, scores: Array) -> None: ...
    def observe_logits(self, b: int, logits: Array, lse: Array, scale: float = 1.0, base: int = 0) -> None: ...
    def observe_key_norms(self, b: int, layout: int, k_cache: Array, page_table: Optional[Array] = None) -> None: ...
    def observe_key_diff(self, b: int, layout: int, k_cache: Array, page_table: Optional[Array] = None) -> None: ...
    def skip_observe(self, b: int) -> None: ...
    def evict(self, b: int) -> List[int]: ...
    def prefill_column_sums(self, b: int, length: int, column_sums: Array) -> int: ...
    def prefill_key_norms(
        self, b: int, length: int, layout: int, k_cache: Array, v_cache: Array, page_table: Optional[Array] = None
    ) -> Tuple[int, int]: ...
    def prefill_key_diff(
        self, b: int, length: int, layout: int, k_cache: Array, v_cache: Array, page_table: Optional[Array] = None
    ) -> Tuple[int, int]:
        """KeyDiff prefill (h2o; the others raise): the prompt scored by
        -cos(k_p, the sum of its head's unit keys)."""
    def prefill_snapkv(
        self, b: int, length: int, input: int, x: Array, lse: Optional[Array], scale: float, base: int,
        pool_width: int, pooling: int, layout: int, k_cache: Array, v_cache: Array,
        page_table: Optional[Array] = None,
    ) -> Tuple[int, int]:
        """SnapKV prefill (h2o; the others raise): input 0 window probs
        [Hq][window][>= length], 1 window logits with lse [Hq][window], 2
        window queries [Hq][window][head_dim] with lse; pooling 0 max, 1 mean."""
    def reset(self, b: int) -> None: ...
    def length(self, b: int) -> int: ...
    def positions(self) -> Any: ...
    def counts(self) -> Any: ...
    def scores(self) -> Any: ...

class SequenceH2O(_SequencePolicy):
    def __init__(self, num_seqs: int, num_kv_heads: int, num_q_heads: int, capacity: int, a: int, b: int, c: int = 0, seed: int = 0, d: int = 0, decay: float = 1.0) -> None: ...

class SequenceRecentWindow(_SequencePolicy):
    def __init__(self, num_seqs: int, num_kv_heads: int, num_q_heads: int, capacity: int, a: int, b: int, c: int = 0, seed: int = 0, d: int = 0, decay: float = 1.0) -> None: ...

class SequenceRandom(_SequencePolicy):
    def __init__(self, num_seqs: int, num_kv_heads: int, num_q_heads: int, capacity: int, a: int, b: int, c: int = 0, seed: int = 0, d: int = 0, decay: float = 1.0) -> None: ...
