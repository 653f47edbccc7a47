"""Type stubs of kvevict._ext, the nanobind module over kvevict's C++
batched API. Internal: use kvevict.BatchedPolicy, kvevict.ops and
kvevict.SequencePolicy. Arrays are anything DLPack can carry (NumPy arrays,
torch tensors, nanobind arrays); ``stream`` is a cudaStream_t as an integer
(0: the legacy default stream), ignored for host memory."""

import enum
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

class PolicyKind(enum.IntEnum):
    h2o = 0
    recent_window = 1
    random = 2
    exact_greedy = 3

class GroupReduce(enum.IntEnum):
    sum = 0
    mean = 1
    max = 2

class DecodeInput(enum.IntEnum):
    """observe_evict takes probs, head_scores, logits; the others read the cache (their own calls)."""
    probs = 0
    head_scores = 1
    logits = 2
    queries = 3
    key_norms = 4
    key_diff = 5

class PrefillInput(enum.IntEnum):
    """prefill takes probs..key_norms; prefill_snapkv the window_* ones; prefill_key_diff key_diff."""
    probs = 0
    sums = 1
    queries = 2
    none = 3
    key_norms = 4
    window_probs = 5
    window_logits = 6
    window_queries = 7
    key_diff = 8

class Elem(enum.IntEnum):
    float32 = 0
    float16 = 1
    bfloat16 = 2

class CacheLayout(enum.IntEnum):
    bhsd = 0
    bshd = 1
    paged_nhd = 2
    paged_hnd = 3

class LseBase(enum.IntEnum):
    natural = 0
    base2 = 1

class SnapPooling(enum.IntEnum):
    max = 0
    mean = 1

class PolicySpec:
    """A batched policy's kind, shape and configuration, each field by name
    (the fields a kind does not use stay 0; decay 1). ``encode()`` gives the
    integers of the torch ops' ``desc`` argument, ``decode()`` reads them
    back; the order is the C++ table's (``fields``), nobody else's."""

    fields: List[str]
    def __init__(
        self, kind: PolicyKind, num_seqs: int, num_kv_heads: int, num_q_heads: int, capacity: int, *,
        heavy: int = 0, recent: int = 0, reduce: GroupReduce = GroupReduce.sum, decay: float = 1.0, sinks: int = 0,
        window: int = 0, budget: int = 0, seed: int = 0, max_tokens: int = 0, head_dim: int = 0,
        first_kv_head: int = 0,
    ) -> None: ...
    @property
    def kind(self) -> PolicyKind: ...
    @property
    def num_seqs(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def num_q_heads(self) -> int: ...
    @property
    def capacity(self) -> int: ...
    @property
    def first_kv_head(self) -> int: ...
    @property
    def heavy(self) -> int: ...
    @property
    def recent(self) -> int: ...
    @property
    def reduce(self) -> GroupReduce: ...
    @property
    def decay(self) -> float: ...
    @property
    def sinks(self) -> int: ...
    @property
    def window(self) -> int: ...
    @property
    def budget(self) -> int: ...
    @property
    def seed(self) -> int: ...
    @property
    def max_tokens(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    def encode(self) -> List[int]: ...
    @staticmethod
    def decode(values: Sequence[int]) -> "PolicySpec": ...

class Descriptor:
    """A PolicySpec validated by the C++ library, with its state's layout."""

    def __init__(self, spec: PolicySpec) -> None: ...
    @property
    def spec(self) -> PolicySpec: ...
    @property
    def state_bytes(self) -> int: ...
    @property
    def budget(self) -> int: ...

def init(desc: Descriptor, state: Array, stream: int = 0) -> None: ...
def reset(desc: Descriptor, state: Array, active: Optional[Array] = None, streams: Optional[Array] = None, stream: int = 0) -> None: ...
def fork(
    desc: Descriptor, state: Array, sources: Array, destinations: Optional[Array] = None, streams: Optional[Array] = None,
    workspace: Optional[Array] = None, stream: int = 0,
) -> int: ...
def fork_from(
    desc: Descriptor, state: Array, source_desc: Descriptor, source: Array, sources: Array,
    destinations: Optional[Array] = None, streams: Optional[Array] = None, workspace: Optional[Array] = None,
    stream: int = 0,
) -> int: ...
def append(desc: Descriptor, state: Array, active: Optional[Array] = None, stream: int = 0) -> None: ...
def append_kv(
    desc: Descriptor, state: Array, layout: CacheLayout, k_cache: Array, v_cache: Array, page_table: Optional[Array], scales: Optional[Array],
    k_new: Array, v_new: Array, active: Optional[Array] = None, stream: int = 0,
) -> None: ...
def observe_evict(
    desc: Descriptor, state: Array, input: DecodeInput, x: Array, lse: Optional[Array], scale: float, base: LseBase,
    victims: Optional[Array], active: Optional[Array] = None, stream: int = 0,
) -> None: ...
def step(
    desc: Descriptor, state: Array, input: DecodeInput, x: Array, lse: Optional[Array], scale: float, base: LseBase,
    victims: Optional[Array], active: Optional[Array] = None, stream: int = 0,
) -> None:
    """Append + observe + evict in one call (one kernel on CUDA); the new K/V rows already in the next slots."""

def observe_evict_queries(
    desc: Descriptor, state: Array, queries: Array, lse: Array, scale: float, base: LseBase, layout: CacheLayout,
    k_cache: Array, v_cache: Array, page_table: Optional[Array], scales: Optional[Array], victims: Optional[Array],
    active: Optional[Array] = None, stream: int = 0,
) -> None: ...
def observe_evict_key_norms(
    desc: Descriptor, state: Array, layout: CacheLayout, k_cache: Array, page_table: Optional[Array], scales: Optional[Array],
    victims: Optional[Array], active: Optional[Array] = None, stream: int = 0,
) -> None:
    """Observe + evict from the key norms of k_cache (read only; no V)."""

def observe_evict_key_diff(
    desc: Descriptor, state: Array, layout: CacheLayout, k_cache: Array, page_table: Optional[Array], scales: Optional[Array],
    victims: Optional[Array], active: Optional[Array] = None, stream: int = 0,
) -> None:
    """Observe + evict by KeyDiff from k_cache (read only; no V): an h2o state made with head_dim."""

def append_tokens(desc: Descriptor, state: Array, tokens: int, active: Optional[Array] = None, stream: int = 0) -> None: ...
def evict_to(
    desc: Descriptor, state: Array, target: int, layout: CacheLayout, k_cache: Array, v_cache: Array,
    page_table: Optional[Array], scales: Optional[Array], queries: Optional[Array], lse: Optional[Array], scale: float, base: LseBase,
    freed: Optional[Array], active: Optional[Array] = None, stream: int = 0,
) -> None: ...
def evict_to_moves(
    desc: Descriptor, state: Array, target: int, moves: Array, move_counts: Array, active: Optional[Array] = None,
    stream: int = 0,
) -> None: ...
def prefill(
    desc: Descriptor, state: Array, lengths: Array, max_length: int, input: PrefillInput, x: Optional[Array],
    lse: Optional[Array], scale: float, base: LseBase, layout: CacheLayout, k_cache: Array, v_cache: Array,
    page_table: Optional[Array], scales: Optional[Array], reclaimable_pages: Optional[Array], active: Optional[Array] = None,
    workspace: Optional[Array] = None, stream: int = 0,
) -> int:
    """input: probs, sums (column sums), queries + lse, none, key_norms (the
    norms of the cached keys, x None). Host: compresses and returns 0. CUDA: with
    workspace None returns the workspace bytes needed and runs nothing;
    otherwise runs and returns 0."""

def prefill_key_diff(
    desc: Descriptor, state: Array, lengths: Array, max_length: int, layout: CacheLayout, k_cache: Array, v_cache: Array,
    page_table: Optional[Array], scales: Optional[Array], reclaimable_pages: Optional[Array], active: Optional[Array] = None,
    workspace: Optional[Array] = None, stream: int = 0,
) -> int:
    """KeyDiff prefill (prompts only): position p scores -cos(k_p, the sum of
    its head's unit prompt keys), read from k_cache alone. Workspace and
    return value as prefill."""

def prefill_snapkv(
    desc: Descriptor, state: Array, lengths: Array, max_length: int, input: PrefillInput, x: Array, lse: Optional[Array],
    scale: float, base: LseBase, pool_width: int, pooling: SnapPooling, layout: CacheLayout, k_cache: Array, v_cache: Array,
    page_table: Optional[Array], scales: Optional[Array], reclaimable_pages: Optional[Array], active: Optional[Array] = None,
    workspace: Optional[Array] = None, stream: int = 0,
) -> int:
    """SnapKV prefill (h2o): input window_probs [B][Hq][window][>= M],
    window_logits [B][Hq][window][>= M] with lse [B][Hq][window],
    window_queries [B][Hq][window][head_dim] with lse; the window is x's
    extent in dimension 2. Workspace and return value as prefill."""

def prefill_exact_greedy(
    desc: Descriptor, state: Array, lengths: Array, max_length: int, queries: Array, lse: Optional[Array],
    scale: float, base: LseBase, layout: CacheLayout, k_cache: Array, v_cache: Array, page_table: Optional[Array], scales: Optional[Array],
    reclaimable_pages: Optional[Array], active: Optional[Array] = None, stream: int = 0,
) -> None:
    """exact_greedy's prefill (host only): the prompts join the history and are
    reduced greedily to the budget, judged with the queries of each prompt's
    last row [B][Hq][head_dim] (lse is not read); the kept rows move to
    slots [0, kept)."""

def status_word(desc: Descriptor, state: Array, stream: int = 0) -> int: ...
def check(desc: Descriptor, state: Array, stream: int = 0, call: str = "check") -> None: ...
def state_offsets(desc: Descriptor, state: Array) -> Dict[str, Optional[int]]: ...
def as_bfloat16(array: Array) -> Any: ...
def as_float8(array: Array, e5m2: bool) -> Any: ...
def _bench_decode_steps(desc: Descriptor, state: Array, probs: Array, victims: Array, steps: int) -> float:
    """Benchmark hook: ns per decode step (append + observe_evict) in a C++ loop."""

def h2o_from_ratios(length: int, heavy_ratio: float, recent_ratio: float) -> Tuple[int, int]: ...
def recent_window_from_ratio(length: int, ratio: float, sinks: int) -> Tuple[int, int]: ...

class _SequencePolicy:
    budget: int
    def append(self, b: int) -> int: ...
    def observe_probs(self, b: int, probs: Array) -> None: ...
    def observe_head_scores(self, b: int, scores: Array) -> None: ...
    def observe_logits(self, b: int, logits: Array, lse: Array, scale: float = 1.0, base: LseBase = LseBase.natural) -> None: ...
    def observe_key_norms(self, b: int, layout: CacheLayout, k_cache: Array, page_table: Optional[Array] = None, scales: Optional[Array] = None) -> None: ...
    def observe_key_diff(self, b: int, layout: CacheLayout, k_cache: Array, page_table: Optional[Array] = None, scales: Optional[Array] = None) -> None: ...
    def skip_observe(self, b: int) -> None: ...
    def evict(self, b: int) -> List[int]: ...
    def prefill_column_sums(self, b: int, length: int, column_sums: Array) -> int: ...
    def prefill_key_norms(
        self, b: int, length: int, layout: CacheLayout, k_cache: Array, v_cache: Array, page_table: Optional[Array] = None, scales: Optional[Array] = None
    ) -> Tuple[int, int]: ...
    def prefill_key_diff(
        self, b: int, length: int, layout: CacheLayout, k_cache: Array, v_cache: Array, page_table: Optional[Array] = None, scales: Optional[Array] = None
    ) -> Tuple[int, int]:
        """KeyDiff prefill (h2o; the others raise): the prompt scored by
        -cos(k_p, the sum of its head's unit keys)."""
    def prefill_snapkv(
        self, b: int, length: int, input: PrefillInput, x: Array, lse: Optional[Array], scale: float, base: LseBase,
        pool_width: int, pooling: SnapPooling, layout: CacheLayout, k_cache: Array, v_cache: Array,
        page_table: Optional[Array] = None, scales: Optional[Array] = None,
    ) -> Tuple[int, int]:
        """SnapKV prefill (h2o; the others raise): input window_probs
        [Hq][window][>= length], window_logits with lse [Hq][window],
        window_queries [Hq][window][head_dim] with lse."""
    def reset(self, b: int) -> None: ...
    def length(self, b: int) -> int: ...
    def positions(self) -> Any: ...
    def counts(self) -> Any: ...
    def scores(self) -> Any: ...

class SequenceH2O(_SequencePolicy):
    def __init__(self, spec: PolicySpec) -> None: ...

class SequenceRecentWindow(_SequencePolicy):
    def __init__(self, spec: PolicySpec) -> None: ...

class SequenceRandom(_SequencePolicy):
    def __init__(self, spec: PolicySpec) -> None: ...
