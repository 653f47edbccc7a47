"""Policy configurations, in the C++ library's terms (docs/policies.md).

Each config is a frozen dataclass; the C++ library validates it when a
policy is built (a bad one raises :class:`kvevict.BudgetError` naming the
field). ``budget`` is the number of tokens a (sequence, KV head) keeps after
an eviction; a policy needs ``capacity >= budget + 1`` slots.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Literal, Union

from . import _ext

GroupReduce = Literal["sum", "mean", "max"]


@dataclass(frozen=True)
class H2OConfig:
    """H2O (Zhang et al., 2023): the ``heavy`` tokens with the highest
    accumulated attention plus the ``recent`` newest and the first ``sinks``.
    ``reduce`` folds the query heads of a GQA group into one KV head's score.

    ``decay`` (gamma in [0, 1]) makes each step's score ``decay * score +
    attention``: 1 is H2O's accumulated attention, 0 is TOVA (the current
    query's attention alone, see :meth:`tova`), values between an
    exponential moving attention. Fed key norms instead of attention
    (:meth:`key_norm`), decay must be 0. KeyDiff's prompt compression
    (:meth:`BatchedPolicy.prefill_key_diff`, prefill only) takes any h2o
    config: ``heavy`` is then the number of least-similar keys kept."""

    heavy: int
    recent: int
    reduce: GroupReduce = "sum"
    decay: float = 1.0
    sinks: int = 0

    kind = _ext.PolicyKind.h2o

    @property
    def budget(self) -> int:
        return self.sinks + self.heavy + self.recent

    @staticmethod
    def tova(heavy: int, recent: int = 0, sinks: int = 0, reduce: GroupReduce = "mean") -> "H2OConfig":
        """TOVA (Oren et al., 2024): decay 0, so the victim is the token the
        newest query attends to least (the C++ ``tova_config``)."""
        return H2OConfig(heavy, recent, reduce, 0.0, sinks)

    @staticmethod
    def key_norm(kept: int, recent: int = 0, sinks: int = 0) -> "H2OConfig":
        """Key-norm (Devoto et al., 2024): decay 0, for
        :meth:`BatchedPolicy.observe_evict_key_norms`, whose score of a slot
        is ``-||k||_2`` of its cached key, so the policy keeps the ``kept``
        keys of the smallest L2 norm beside the ``sinks`` and the ``recent``
        window (the C++ ``key_norm_config``). The config itself is plain h2o
        (the same as ``tova(kept, recent, sinks, "sum")``): what makes it
        key-norm is the input it is observed with."""
        return H2OConfig(kept, recent, "sum", 0.0, sinks)

    def _spec_fields(self) -> Dict[str, Any]:
        if self.reduce not in ("sum", "mean", "max"):
            raise _ext.InvalidArgument(
                f"kvevict.H2OConfig: argument 'reduce' = {self.reduce!r} is not 'sum', 'mean' or 'max'"
            )
        return dict(heavy=self.heavy, recent=self.recent, reduce=getattr(_ext.GroupReduce, self.reduce),
                    decay=_float32(self.decay), sinks=self.sinks)

    @staticmethod
    def from_ratios(length: int, heavy_ratio: float, recent_ratio: float, reduce: GroupReduce = "sum") -> "H2OConfig":
        """``floor(heavy_ratio * length)`` heavy and ``floor(recent_ratio * length)``
        recent tokens (the C++ ``h2o_from_ratios``; the paper's "20%" is 0.1 + 0.1)."""
        heavy, recent = _ext.h2o_from_ratios(length, heavy_ratio, recent_ratio)
        return H2OConfig(heavy, recent, reduce)


@dataclass(frozen=True)
class RecentWindowConfig:
    """StreamingLLM (Xiao et al., 2024): the first ``sinks`` positions and the
    ``window`` newest."""

    sinks: int
    window: int

    kind = _ext.PolicyKind.recent_window

    @property
    def budget(self) -> int:
        return self.sinks + self.window

    def _spec_fields(self) -> Dict[str, Any]:
        return dict(sinks=self.sinks, window=self.window)

    @staticmethod
    def from_ratio(length: int, ratio: float, sinks: int = 4) -> "RecentWindowConfig":
        """``sinks`` sinks and the rest of ``floor(ratio * length)`` as the
        window (the C++ ``recent_window_from_ratio``)."""
        s, window = _ext.recent_window_from_ratio(length, ratio, sinks)
        return RecentWindowConfig(s, window)


@dataclass(frozen=True)
class RandomConfig:
    """Uniformly random victims among the unprotected tokens, drawn from
    Philox4x32-10 keyed by ``seed``, the request stream, the head and the
    newest position, so every device and batch schedule draws the same."""

    budget: int
    sinks: int = 0
    recent: int = 0
    seed: int = 0

    kind = _ext.PolicyKind.random

    def _spec_fields(self) -> Dict[str, Any]:
        if not 0 <= self.seed < 2**64:
            raise _ext.OutOfRange(f"kvevict.RandomConfig: argument 'seed' = {self.seed} is outside [0, 2^64)")
        return dict(budget=self.budget, sinks=self.sinks, recent=self.recent, seed=self.seed)


@dataclass(frozen=True)
class ExactGreedyConfig:
    """The one-step oracle: evicts the token whose removal changes the
    current queries' attention output least (against the whole history).
    For research and tests: it keeps a float copy of every K/V row."""

    budget: int
    recent: int = 0
    sinks: int = 0

    kind = _ext.PolicyKind.exact_greedy

    def _spec_fields(self) -> Dict[str, Any]:
        return dict(budget=self.budget, recent=self.recent, sinks=self.sinks)


PolicyConfig = Union[H2OConfig, RecentWindowConfig, RandomConfig, ExactGreedyConfig]

SnapPooling = Literal["max", "mean"]


@dataclass(frozen=True)
class SnapKV:
    """SnapKV's prompt scoring (Li et al., 2024; the C++ ``snap_window``), for
    :meth:`BatchedPolicy.prefill_snapkv` and
    :meth:`SequencePolicy.prefill_snapkv` of an h2o policy: a prompt of
    ``L`` tokens is scored by the attention of its last ``window`` rows
    only (the observation window; window row ``r`` is prompt row ``L -
    window + r``), each position's window sum pooled over ``pool_width //
    2`` neighbours on each side (``"max"``, or ``"mean"``: the sum divided
    by ``pool_width``; positions outside ``[0, L - window)`` count as
    zero), the window's own positions unpooled. The last
    ``max(recent, window)`` positions and the ``sinks`` are always kept, the
    rest of the budget by score.

    ``window`` must equal the window rows of the input passed with it (its
    dimension 2, batched), fit the budget beside the sinks and not exceed
    any prompt; ``pool_width`` is odd and positive. The C++ library checks
    them and names them ``in.snap.window``, ``in.snap.pool_width`` and
    ``in.snap.pooling``."""

    window: int = 32
    pool_width: int = 7
    pooling: SnapPooling = "max"

    @staticmethod
    def paper() -> "SnapKV":
        """The SnapKV paper's defaults: a window of 32 rows, max pooling of width 7."""
        return SnapKV(32, 7, "max")

    @staticmethod
    def kvpress() -> "SnapKV":
        """kvpress's SnapKVPress defaults: a window of 64 rows, mean pooling of width 5."""
        return SnapKV(64, 5, "mean")

    def _codes(self) -> tuple[int, Any]:
        """(pool_width, pooling) as the extension takes them (pooling an _ext.SnapPooling)."""
        if self.pooling not in ("max", "mean"):
            raise _ext.InvalidArgument(
                f"kvevict.SnapKV: argument 'pooling' = {self.pooling!r} is not 'max' or 'mean'"
            )
        return int(self.pool_width), getattr(_ext.SnapPooling, self.pooling)

    def _require_rows(self, call: str, arg: str, x: Any, dim: int) -> None:
        """The input's window rows (dimension ``dim``) are ``window``."""
        shape = tuple(getattr(x, "shape", ()))
        if len(shape) > dim and shape[dim] != self.window:
            raise _ext.InvalidArgument(
                f"kvevict.{call}: argument '{arg}' has {shape[dim]} window rows (dimension {dim}), "
                f"but snap.window = {self.window}"
            )


def _float32(x: float) -> float:
    """x as the float32 the library takes (the C++ library validates the
    value; beyond the float range it becomes an infinity, which it refuses)."""
    x = float(x)
    if x != x or abs(x) <= 3.4028234663852886e38:
        return x
    return float("inf") if x > 0 else float("-inf")


def policy_spec(
    config: PolicyConfig,
    num_seqs: int,
    num_kv_heads: int,
    num_q_heads: int,
    capacity: int,
    max_tokens: int = 0,
    head_dim: int = 0,
    first_kv_head: int = 0,
) -> "_ext.PolicySpec":
    """The typed spec of a batched policy (:class:`kvevict._ext.PolicySpec`):
    the config's fields by name with the state's shape. Its ``encode()`` is
    the ``desc`` argument of every ``torch.ops.kvevict`` op."""
    if not isinstance(config, (H2OConfig, RecentWindowConfig, RandomConfig, ExactGreedyConfig)):
        raise _ext.InvalidArgument(
            f"kvevict: argument 'config' is a {type(config).__name__}, expected H2OConfig, "
            "RecentWindowConfig, RandomConfig or ExactGreedyConfig"
        )
    return _ext.PolicySpec(config.kind, num_seqs, num_kv_heads, num_q_heads, capacity, max_tokens=max_tokens,
                           head_dim=head_dim, first_kv_head=first_kv_head, **config._spec_fields())
