"""A small pure-NumPy reference of kvevict's batched decisions, written from
the definitions in docs/semantics.md and docs/policies.md (and the random
policy's lowest-key rule), never from the extension.

Float arithmetic follows the contract where it fixes an order: increments
fold over the GQA group in ascending query head in float32, scores add in
float32, prefill column sums go in 64-row chunks, and the queries path
computes q . k in 16-byte chunks of K combined as a balanced tree. The
exponentials are NumPy's (float64, then rounded to float32), which can
differ from kvevict's own exp in the last bit of a float32 once in a long
while; decisions only differ at such near-ties, which seeded random streams
do not produce.
"""

from __future__ import annotations

import numpy as np

MASK32 = np.uint64(0xFFFFFFFF)

# ---- Philox4x32-10 (Salmon et al., SC'11) ------------------------------------


def philox4x32_10(ctr, key):
    """ctr: 4 arrays (or ints) of uint32 words, key: 2; returns the 4 output words as uint64 arrays."""
    c = [np.asarray(x, dtype=np.uint64) for x in ctr]
    k0, k1 = (np.asarray(x, dtype=np.uint64) for x in key)
    m0, m1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
    w0, w1 = np.uint64(0x9E3779B9), np.uint64(0xBB67AE85)
    for r in range(10):
        if r:
            k0 = (k0 + w0) & MASK32
            k1 = (k1 + w1) & MASK32
        p0 = m0 * c[0]  # both factors < 2^32: the product fits in uint64
        p1 = m1 * c[2]
        hi0, lo0 = p0 >> np.uint64(32), p0 & MASK32
        hi1, lo1 = p1 >> np.uint64(32), p1 & MASK32
        c = [hi1 ^ c[1] ^ k0, lo1, hi0 ^ c[3] ^ k1, lo0]
    return c


def random_step_key(seed: int, stream: int, head: int, newest: int):
    """The decode step key {r0, r1} for the step whose newest position is `newest`."""
    r = philox4x32_10(
        (newest & 0xFFFFFFFF, stream & 0xFFFFFFFF, head & 0xFFFFFFFF, ((stream >> 32) & 0xFFFFFFFF) << 1 & 0xFFFFFFFF),
        (seed & 0xFFFFFFFF, seed >> 32),
    )
    return int(r[0]), int(r[1])


def random_victim_keys(seed: int, stream: int, head: int, newest: int, positions):
    """(priority << 32) | position for each candidate position: the lowest is evicted first."""
    k = random_step_key(seed, stream, head, newest)
    p = np.asarray(positions, dtype=np.uint64)
    zero = np.zeros_like(p)
    prio = philox4x32_10((p, zero, zero, zero), k)[0]
    return (prio << np.uint64(32)) | p


def random_prefill_keys(seed: int, stream: int, head: int, positions):
    """Prefill keep keys: (draw << 32) | p with the prefill-priority draw; the highest are kept."""
    p = np.asarray(positions, dtype=np.uint64)
    n = len(p)
    draw = philox4x32_10(
        (
            p,
            np.full(n, stream & 0xFFFFFFFF, np.uint64),
            np.full(n, head, np.uint64),
            np.full(n, 1 | (((stream >> 32) & 0xFFFFFFFF) << 1 & 0xFFFFFFFF), np.uint64),
        ),
        (seed & 0xFFFFFFFF, seed >> 32),
    )[0]
    return (draw << np.uint64(32)) | p


# ---- float order and arithmetic -------------------------------------------------


def score_key(score: np.float32) -> int:
    """The (score) half of the eviction key: the same order as the floats, -0 == +0."""
    bits = int(np.float32(score).view(np.uint32))
    if bits == 0x80000000:
        bits = 0
    return (~bits & 0xFFFFFFFF) if bits & 0x80000000 else bits | 0x80000000


def eviction_key(score, position: int) -> int:
    return (score_key(score) << 32) | position


def fold_group(values: np.ndarray, reduce: str) -> np.ndarray:
    """values [g, W] float32 -> [W]: ascending query head, in float32."""
    acc = np.zeros(values.shape[1], np.float32)
    for j in range(values.shape[0]):
        acc = np.maximum(acc, values[j]) if reduce == "max" else (acc + values[j]).astype(np.float32)
    if reduce == "mean":
        acc = (acc / np.float32(values.shape[0])).astype(np.float32)
    return acc


def probability_from_logit(logit, scale: float, lse, base: str) -> np.ndarray:
    lse = np.asarray(lse, np.float64)
    natural = lse * np.log(2.0) if base == "base2" else lse
    return np.exp(np.asarray(logit, np.float64) * np.float64(np.float32(scale)) - natural).astype(np.float32)


def attention_logit(q: np.ndarray, k: np.ndarray, k_itemsize: int) -> np.float32:
    """q . k in kvevict's fixed order: float32 products summed left to right
    within chunks of 16 bytes of K, the chunk sums combined as a balanced
    binary tree over a power-of-two count padded with +0."""
    q = q.astype(np.float32)
    k = k.astype(np.float32)
    chunk = 16 // k_itemsize
    sums = []
    for c in range(0, len(k), chunk):
        s = np.float32(q[c] * k[c])
        for d in range(c + 1, min(c + chunk, len(k))):
            s = np.float32(s + np.float32(q[d] * k[d]))
        sums.append(s)
    n = 1
    while n < len(sums):
        n *= 2
    sums += [np.float32(0.0)] * (n - len(sums))
    while len(sums) > 1:
        sums = [np.float32(sums[i] + sums[i + 1]) for i in range(0, len(sums), 2)]
    return sums[0]


def column_sums(probs: np.ndarray, length: int) -> np.ndarray:
    """probs [L, L] (row i, column p) -> [L] float32 in the canonical order:
    rows in chunks of 64 aligned at multiples of 64, each summed left to
    right, the partials added in ascending chunks."""
    out = np.zeros(length, np.float32)
    for p in range(length):
        total = None
        for first in range((p // 64) * 64, length, 64):
            part = None
            for i in range(max(first, p), min(first + 64, length)):
                part = np.float32(probs[i, p]) if part is None else np.float32(part + np.float32(probs[i, p]))
            total = part if total is None else np.float32(total + part)
        out[p] = total
    return out


# ---- exact_greedy's leave-one-out error, from its definition ----------------------


def leave_one_out_errors(q, keys, values, scale, cached, members):
    """E(v) = || out(G minus v) - out(H) ||^2 for each member v (positions),
    one query; keys/values [length, D] float32 history, cached: bool [length].
    In extended precision (the C++ code uses a cancellation-free form in double)."""
    ld = np.longdouble
    logits = keys.astype(ld) @ q.astype(ld) * ld(np.float32(scale))

    def out(mask):
        m = logits[mask].max()
        w = np.exp(logits[mask] - m)
        return (w[:, None] * values[mask].astype(ld)).sum(0) / w.sum()

    full = out(np.ones(len(logits), bool))
    errors = []
    for v in members:
        g = cached.copy()
        g[v] = False
        if not g.any():
            errors.append(np.inf)
            continue
        d = out(g) - full
        errors.append(float((d * d).sum()))
    return np.array(errors, np.float64)


# ---- the batched state ---------------------------------------------------------


class RefPolicy:
    """The slot table and scores of a batched policy, stepped by the
    definitions. kind: 'h2o', 'recent_window', 'random', 'exact_greedy'."""

    def __init__(
        self, kind, B, H, Hq, capacity, *, budget, sinks=0, recent=0, reduce="sum", seed=0, head_dim=0, decay=1.0
    ):
        self.kind, self.B, self.H, self.Hq, self.capacity = kind, B, H, Hq, capacity
        self.decay = np.float32(decay)  # score <- decay * score (rounded to float32) + increment
        self.g = Hq // H
        self.budget, self.sinks, self.recent, self.reduce, self.seed = budget, sinks, recent, reduce, seed
        self.positions = np.full((B, H, capacity), -1, np.int32)
        self.scores = np.zeros((B, H, capacity), np.float32)
        self.counts = np.zeros((B, H), np.int32)
        self.next_slots = np.zeros((B, H), np.int32)
        self.lengths = np.zeros(B, np.int32)
        self.streams = list(range(B))
        # exact_greedy's history: float32 K/V rows by position.
        self.hist_k = [[{} for _ in range(H)] for _ in range(B)]
        self.hist_v = [[{} for _ in range(H)] for _ in range(B)]
        self.head_dim = head_dim

    def protected(self, p, length):
        return p < self.sinks or p >= length - self.recent

    # decode cycle ------------------------------------------------------------
    def append(self, b):
        """Returns the slot of each head."""
        slots = []
        for h in range(self.H):
            s = self.next_slots[b, h]
            assert s >= 0
            self.positions[b, h, s] = self.lengths[b]
            self.scores[b, h, s] = 0.0
            self.counts[b, h] += 1
            self.next_slots[b, h] = self.counts[b, h] if self.counts[b, h] <= self.budget else -1
            slots.append(s)
        self.lengths[b] += 1
        return slots

    def append_tokens(self, b, n):
        first = self.lengths[b]
        for h in range(self.H):
            count, nxt = self.counts[b, h], self.next_slots[b, h]
            for j in range(n):
                s = nxt if (j == 0 and nxt >= 0) else count + j
                self.positions[b, h, s] = first + j
                self.scores[b, h, s] = 0.0
            self.counts[b, h] = count + n
            self.next_slots[b, h] = count + n if count + n <= self.budget else -1
        self.lengths[b] = first + n

    def add_increments(self, b, h, inc):
        """inc [>= width] float32: this step's increment per slot."""
        full = np.zeros(self.capacity, np.float32)
        n = min(len(inc), self.capacity)
        full[:n] = inc[:n]
        occ = self.positions[b, h] >= 0
        assert not occ[n:].any(), "the input is narrower than the occupied slots"
        decayed = (self.decay * self.scores[b, h, occ]).astype(np.float32)
        self.scores[b, h, occ] = (decayed + full[occ]).astype(np.float32)

    def candidates(self, b, h):
        length = self.lengths[b]
        return [s for s in range(self.capacity) if self.positions[b, h, s] >= 0 and not self.protected(self.positions[b, h, s], length)]

    def ordered_victims(self, b, h):
        """Unprotected occupied slots, the first to evict first."""
        cand = self.candidates(b, h)
        pos = self.positions[b, h]
        if self.kind in ("h2o", "exact_greedy"):
            key = {s: eviction_key(self.scores[b, h, s], int(pos[s])) for s in cand}
        elif self.kind == "recent_window":
            key = {s: int(pos[s]) for s in cand}
        else:
            ks = random_victim_keys(self.seed, self.streams[b], h, int(self.lengths[b]) - 1, [int(pos[s]) for s in cand])
            key = {s: int(kk) for s, kk in zip(cand, ks)}
        return sorted(cand, key=lambda s: key[s])

    def free(self, b, h, s):
        self.positions[b, h, s] = -1
        self.scores[b, h, s] = 0.0
        self.counts[b, h] -= 1

    def evict(self, b):
        victims = []
        for h in range(self.H):
            v = -1
            if self.counts[b, h] > self.budget:
                order = self.ordered_victims(b, h)
                if order:
                    v = order[0]
                    self.free(b, h, v)
                    self.next_slots[b, h] = v
            victims.append(v)
        return victims

    def evict_to(self, b, target, rescore=None):
        """Frees count - target per head (rescore(b, h) re-scores before each
        exact_greedy victim) and refills the holes; returns (freed, moves per head)."""
        freed, moves = [], []
        for h in range(self.H):
            surplus = self.counts[b, h] - target
            n = max(surplus, 0)
            if self.kind == "exact_greedy":
                for _ in range(n):
                    rescore(b, h)
                    self.free(b, h, self.ordered_victims(b, h)[0])
            else:
                for s in self.ordered_victims(b, h)[:n]:
                    self.free(b, h, s)
            freed.append(n)
            mv = []
            if n:
                mv = self.refill(b, h)
            moves.append(mv)
        return freed, moves

    def refill(self, b, h):
        count = self.counts[b, h]
        span = count + 1 if count <= self.budget else count
        pos, sc = self.positions[b, h], self.scores[b, h]
        holes = [s for s in range(span) if pos[s] < 0]
        moves, n = [], 0
        for s in range(span, self.capacity):
            if n == len(holes):
                break
            if pos[s] < 0:
                continue
            to = holes[n]
            n += 1
            pos[to], sc[to] = pos[s], sc[s]
            pos[s], sc[s] = -1, 0.0
            moves.append((s, to))
        self.next_slots[b, h] = holes[n] if n < len(holes) else -1
        return moves

    # prefill -------------------------------------------------------------------
    def prefill(self, b, length, head_scores=None):
        """head_scores [H][length] float32 (h2o), or None. Returns the kept positions per head."""
        budget = self.budget
        kept_all = []
        for h in range(self.H):
            if length <= budget:
                keep = list(range(length))
            else:
                lo = min(self.sinks, length)
                hi = max(length - self.recent, lo)
                take = budget - lo - (length - hi)
                cand = list(range(lo, hi))
                if self.kind == "recent_window":
                    chosen = cand[len(cand) - take :] if take > 0 else []
                elif self.kind == "random":
                    keys = random_prefill_keys(self.seed, self.streams[b], h, cand)
                    order = sorted(range(len(cand)), key=lambda i: int(keys[i]), reverse=True)
                    chosen = sorted(cand[i] for i in order[:take])
                else:
                    order = sorted(cand, key=lambda p: eviction_key(head_scores[h][p], p), reverse=True)
                    chosen = sorted(order[:take])
                keep = list(range(lo)) + chosen + list(range(hi, length))
            kept = len(keep)
            self.positions[b, h] = -1
            self.scores[b, h] = 0.0
            self.positions[b, h, :kept] = keep
            if head_scores is not None:
                self.scores[b, h, :kept] = [head_scores[h][p] for p in keep]
            self.counts[b, h] = kept
            self.next_slots[b, h] = kept
            kept_all.append(keep)
        self.lengths[b] = length
        return kept_all


def ragged_schedule(step: int, rng, num_seqs: int):
    """Which sequences a stream's step runs: every one (None), the list
    [2, 0], or flags with sequence 1 set; with the sequences that step."""
    if step % 4 == 3:
        return np.array([2, 0], np.int32), [2, 0]
    if step % 5 == 4:
        flags = (rng.random(num_seqs) < 0.5).astype(np.uint8)
        flags[1] = 1
        return flags, [b for b in range(num_seqs) if flags[b]]
    return None, list(range(num_seqs))


# ---- one layer's K/V buffers in any layout (pure NumPy) ------------------------


class LayerCache:
    """One layer's K and V buffers of `num_seqs` x `heads` x `capacity` rows of
    `head_dim` in a layout ('bhsd', 'bshd', 'paged_nhd', 'paged_hnd'; paged
    with pages of `page` slots in shuffled order and one page no sequence
    uses), zero-filled, and the rows of logical slot (b, h, s). The caller
    wraps it in a ``kvevict.CacheView(c.k, c.v, c.layout, c.table)``."""

    def __init__(self, layout, dtype, num_seqs, heads, head_dim, capacity, rng, page=4):
        self.layout, self.dtype, self.page, self.table = layout, dtype, page, None
        if layout in ("bhsd", "bshd"):
            shape = (num_seqs, heads, capacity, head_dim) if layout == "bhsd" else (num_seqs, capacity, heads, head_dim)
        else:
            pages = -(-capacity // page)
            num_pages = pages * num_seqs + 1
            shape = (num_pages, page, heads, head_dim) if layout == "paged_nhd" else (num_pages, heads, page, head_dim)
            self.table = rng.permutation(num_pages)[: pages * num_seqs].reshape(num_seqs, pages).astype(np.int32)
        self.k = np.zeros(shape, dtype)
        self.v = np.zeros(shape, dtype)

    def copy(self):
        other = object.__new__(LayerCache)
        other.layout, other.dtype, other.page = self.layout, self.dtype, self.page
        other.table = None if self.table is None else self.table.copy()
        other.k, other.v = self.k.copy(), self.v.copy()
        return other

    def _row(self, x, b, h, s):
        if self.layout == "bhsd":
            return x[b, h, s]
        if self.layout == "bshd":
            return x[b, s, h]
        page = self.table[b, s // self.page]
        return x[page, s % self.page, h] if self.layout == "paged_nhd" else x[page, h, s % self.page]

    def k_row(self, b, h, s):
        return self._row(self.k, b, h, s)

    def v_row(self, b, h, s):
        return self._row(self.v, b, h, s)

    def row_bytes(self, which, b, h, s):
        return np.ascontiguousarray(self._row(self.k if which == "k" else self.v, b, h, s)).tobytes()


def prefill_reclaimable_pages(layout, length, budget, capacity, page):
    """Trailing pages a compressed paged prompt no longer needs:
    pages(L) - pages(min(budget + 1, capacity)), at least 0; 0 unpaged."""
    if layout in ("bhsd", "bshd"):
        return 0
    pages = lambda n: -(-n // page)  # noqa: E731
    return max(0, pages(length) - pages(min(budget + 1, capacity)))


def prefill_split(length, budget, sinks, recent):
    """A prompt of `length` tokens above the budget: (lo, hi, take), the
    positions [0, lo) and [hi, length) protected and `take` of [lo, hi)
    kept; None when the prompt fits the budget (kept whole)."""
    if length <= budget:
        return None
    lo = min(sinks, length)
    hi = max(length - recent, lo)
    return lo, hi, budget - lo - (length - hi)
