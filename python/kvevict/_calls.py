"""The call table: every call of the extension on a batched state, described
once, and the two routes generated from it.

Each :class:`Call` names an operation, its arguments after ``(state,
desc)`` with their schema types (``Tensor!`` for what the call mutates,
``Tensor?`` for what may be None, ``SymInt``, ``float``; a default after
``=``), the extension function and the order it takes its arguments in,
and what the call returns (a victims / freed / reclaimable / moves array
allocated for it). From that one row come

- the direct route, :data:`direct`\\ ``.<name>(policy, *args, out=None,
  stream=None)``: what :class:`kvevict.BatchedPolicy` calls for every
  operation. Eagerly it calls the extension itself (NumPy arrays, torch
  CPU or CUDA tensors: the least overhead a call can have); while
  ``torch.compile`` traces, it calls the torch op instead, the one place
  the two routes fork;
- the ``torch.library`` op ``torch.ops.kvevict.<name>`` (:func:`register_ops`,
  called by :mod:`kvevict.ops`): its schema, its CPU and CUDA kernel, and
  its fake kernel, so the schema of a call is written here and nowhere
  else.

The functions are generated as Python source (``exec``) rather than
interpreted from the table per call, so that a call costs what a hand
written one does. A new call, or a new argument, is a change of this
table (and of the extension function it names).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable, Dict, List, Optional, Tuple

from . import _ext
from ._arrays import for_ext


@dataclass(frozen=True)
class Arg:
    name: str
    type: str  # schema type: Tensor, Tensor!, Tensor?, SymInt, float
    default: str = ""  # Python source of the default, "" for none

    @property
    def tensor(self) -> bool:
        return self.type.startswith("Tensor")

    @property
    def mutated(self) -> bool:
        return self.type == "Tensor!"


@dataclass(frozen=True)
class Call:
    """One operation on a batched state."""

    name: str  # torch.ops.kvevict.<name>, and direct.<name>
    args: Tuple[Arg, ...]  # after (state, desc)
    ext: str  # the extension function
    ext_args: Tuple[str, ...]  # its arguments, in its order: names, or Python expressions
    out: str = ""  # "", "victims", "freed", "reclaimable", "moves"
    checked: str = ""  # the call a deferred (CUDA) refusal names; default: name
    workspace: bool = False  # CUDA: sized by a first call with workspace None
    doc: str = ""


def _args(spec: str) -> Tuple[Arg, ...]:
    """'Tensor! k_cache, SymInt layout, Tensor? active=None' as Args."""
    out = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        type_, rest = part.split(" ", 1)
        name, _, default = rest.partition("=")
        out.append(Arg(name.strip(), type_, default.strip()))
    return tuple(out)


_ACTIVE = "Tensor? active=None"
_KEYS = "Tensor k_cache, Tensor? page_table, Tensor? scales, SymInt layout, " + _ACTIVE
_PROMPT = "Tensor lengths, SymInt max_length"
_CACHE_MOVED = "Tensor! k_cache, Tensor! v_cache, Tensor? page_table, Tensor? scales, SymInt layout"
_PREFILL_TAIL = ("layout", "k_cache", "v_cache", "page_table", "scales", "reclaimable", "active", "workspace", "stream")

CALLS: Tuple[Call, ...] = (
    Call("init", (), "init", ("desc", "state", "stream"),
         doc="Initialises a state tensor of ``Descriptor(spec).state_bytes`` bytes."),
    Call("reset", _args(_ACTIVE + ", Tensor? streams=None"), "reset", ("desc", "state", "active", "streams", "stream"),
         doc="Forgets the active sequences; ``streams`` (int64): random's new request streams."),
    Call("fork", _args("Tensor sources, Tensor? destinations=None, Tensor? streams=None"), "fork",
         ("desc", "state", "sources", "destinations", "streams", "workspace", "stream"), workspace=True,
         doc="Forks: each destination (entry i of ``destinations``, a list or flags; None: every sequence) becomes "
             "a copy of sequence ``sources[i]`` as it was before the call (slots, scores, anchors, history, "
             "length); ``streams`` (int64): random's new request streams, else the destination index."),
    Call("append", _args(_ACTIVE), "append", ("desc", "state", "active", "stream"),
         doc="Append without K/V: the caller writes each head's row to its next slot."),
    Call("append_kv",
         _args(_CACHE_MOVED + ", Tensor k_new, Tensor v_new, " + _ACTIVE),
         "append_kv", ("desc", "state", "layout", "k_cache", "v_cache", "page_table", "scales", "k_new", "v_new",
                       "active", "stream"),
         checked="append",
         doc="Append fused with the scatter of k_new/v_new [B, Hkv, D] into each head's next slot."),
    Call("observe_evict", _args("SymInt input, Tensor x, Tensor? lse, float scale, SymInt base, " + _ACTIVE),
         "observe_evict", ("desc", "state", "input", "x", "lse", "scale", "base", "victims", "active", "stream"),
         out="victims",
         doc="Observe + evict from probabilities, per-KV-head increments or logits + LSE (input: an "
             "_ext.DecodeInput); returns the freed slot per (sequence, head), int32 [B, Hkv], -1 for none."),
    Call("step", _args("SymInt input, Tensor x, Tensor? lse, float scale, SymInt base, " + _ACTIVE),
         "step", ("desc", "state", "input", "x", "lse", "scale", "base", "victims", "active", "stream"),
         out="victims",
         doc="The one-launch decode step: append + observe + evict from probabilities, per-KV-head increments or "
             "logits + LSE over slots [0, count + 1), the new K/V rows already in the next slots; returns the "
             "freed slots, int32 [B, Hkv]."),
    Call("observe_evict_queries",
         _args("Tensor queries, Tensor lse, float scale, SymInt base, Tensor k_cache, Tensor v_cache, "
               "Tensor? page_table, Tensor? scales, SymInt layout, " + _ACTIVE),
         "observe_evict_queries", ("desc", "state", "queries", "lse", "scale", "base", "layout", "k_cache", "v_cache",
                                   "page_table", "scales", "victims", "active", "stream"),
         out="victims", checked="observe_evict",
         doc="Observe + evict from queries + LSE (logits recomputed from the cached keys), and exact_greedy's "
             "step; returns the freed slots, int32 [B, Hkv]."),
    Call("observe_evict_key_norms", _args(_KEYS), "observe_evict_key_norms",
         ("desc", "state", "layout", "k_cache", "page_table", "scales", "victims", "active", "stream"),
         out="victims", checked="observe_evict",
         doc="Observe + evict from the key cache alone: each occupied slot's score becomes -||k||_2 of its "
             "cached key (h2o: with decay 0, ``H2OConfig.key_norm``); returns the freed slots, int32 [B, Hkv]."),
    Call("observe_evict_key_diff", _args(_KEYS), "observe_evict_key_diff",
         ("desc", "state", "layout", "k_cache", "page_table", "scales", "victims", "active", "stream"),
         out="victims", checked="observe_evict",
         doc="Observe + evict by KeyDiff from the key cache alone: each occupied slot's score becomes -cos(k, "
             "the running anchor of the cached keys) (h2o with decay 0, a state made with head_dim); returns "
             "the freed slots, int32 [B, Hkv]."),
    Call("prefill",
         _args(_PROMPT + ", SymInt input, Tensor? x, Tensor? lse, float scale, SymInt base, " + _CACHE_MOVED + ", "
               + _ACTIVE),
         "prefill", ("desc", "state", "lengths", "max_length", "input", "x", "lse", "scale", "base") + _PREFILL_TAIL,
         out="reclaimable", workspace=True,
         doc="Batched prefill compression (input: an _ext.PrefillInput: probs, sums, queries, none, key_norms); "
             "returns the reclaimable trailing pages per sequence, int32 [B]."),
    Call("prefill_key_norms", _args(_PROMPT + ", " + _CACHE_MOVED + ", " + _ACTIVE), "prefill",
         ("desc", "state", "lengths", "max_length", "_PrefillInput.key_norms", "None", "None", "1.0",
          "_LseBase.natural") + _PREFILL_TAIL,
         out="reclaimable", checked="prefill", workspace=True,
         doc="Batched prefill compression scored by the norms of the prompt's cached keys (position p scores "
             "-||k|| of slot p; h2o: with decay 0, ``H2OConfig.key_norm``); returns the reclaimable trailing "
             "pages per sequence, int32 [B]. The same as ``prefill`` with input key_norms."),
    Call("prefill_key_diff", _args(_PROMPT + ", " + _CACHE_MOVED + ", " + _ACTIVE), "prefill_key_diff",
         ("desc", "state", "lengths", "max_length") + _PREFILL_TAIL,
         out="reclaimable", checked="prefill", workspace=True,
         doc="Batched KeyDiff prefill compression (prompts only; no attention input): position p of (sequence, "
             "head) scores -cos(k_p, anchor), the anchor the sum of that head's unit prompt keys, so the keys "
             "least like the others are kept beside the sinks and the recent window. Any h2o config; returns "
             "the reclaimable trailing pages per sequence, int32 [B]."),
    Call("prefill_snapkv",
         _args(_PROMPT + ", SymInt input, Tensor x, Tensor? lse, float scale, SymInt base, SymInt pool_width, "
               "SymInt pooling, " + _CACHE_MOVED + ", " + _ACTIVE),
         "prefill_snapkv", ("desc", "state", "lengths", "max_length", "_snap_input(input)", "x", "lse", "scale",
                            "base", "pool_width", "pooling") + _PREFILL_TAIL,
         out="reclaimable", checked="prefill", workspace=True,
         doc="Batched SnapKV prefill compression (h2o): each prompt scored by the attention of its last "
             "``window`` rows, ``window = x.shape[2]``; input 0 window probs [B, Hq, window, >= max_length], 1 "
             "window logits (same shape) with ``lse`` [B, Hq, window], 2 window queries [B, Hq, window, "
             "head_dim] with ``lse``; pooling 0 max, 1 mean over ``pool_width`` (odd) positions. Returns the "
             "reclaimable trailing pages per sequence, int32 [B]."),
    Call("prefill_exact_greedy",
         _args(_PROMPT + ", Tensor queries, Tensor? lse, float scale, SymInt base, " + _CACHE_MOVED + ", " + _ACTIVE),
         "prefill_exact_greedy", ("desc", "state", "lengths", "max_length", "queries", "lse", "scale", "base",
                                  "layout", "k_cache", "v_cache", "page_table", "scales", "reclaimable", "active",
                                  "stream"),
         out="reclaimable", checked="prefill",
         doc="exact_greedy's batched prefill compression (host): each prompt joins the history and is reduced "
             "greedily to the budget, judged with the queries of its last row [B, Hq, head_dim] (``lse`` is not "
             "read); returns the reclaimable trailing pages per sequence, int32 [B]."),
    Call("append_tokens", _args("SymInt tokens, " + _ACTIVE), "append_tokens",
         ("desc", "state", "tokens", "active", "stream"),
         doc="Appends ``tokens`` positions to every active sequence (multi-token step)."),
    Call("evict_to",
         _args("SymInt target, " + _CACHE_MOVED + ", Tensor? queries=None, Tensor? lse=None, float scale=1.0, "
               "SymInt base=0, " + _ACTIVE),
         "evict_to", ("desc", "state", "target", "layout", "k_cache", "v_cache", "page_table", "scales", "queries",
                      "lse", "scale", "base", "freed", "active", "stream"),
         out="freed",
         doc="evict_to(target) with the kept rows compacted in the cache (exact_greedy: with the step's queries "
             "and LSE); returns the tokens freed, int32 [B, Hkv]."),
    Call("evict_to_moves", _args("SymInt target, " + _ACTIVE), "evict_to_moves",
         ("desc", "state", "target", "moves", "move_counts", "active", "stream"),
         out="moves", checked="evict_to",
         doc="evict_to(target) reporting the row moves instead of making them: (moves int32 [B, Hkv, capacity, "
             "2] of (from, to), move_counts int32 [B, Hkv])."),
)

# The extension's other calls on a state, direct only (no torch op: they
# read the state back to the host or raise).
HOST_CALLS: Tuple[Call, ...] = (
    Call("status_word", (), "status_word", ("desc", "state", "stream")),
    Call("check", _args("str call='check'"), "check", ("desc", "state", "stream", "call")),
)

# ---- what the outputs are, for both routes ---------------------------------------------------------

# name: (shape from (B, H, C), fill) per array; "moves" is two arrays.
_OUTPUTS: Dict[str, Tuple[Tuple[str, str, int], ...]] = {
    "": (),
    "victims": (("victims", "(B, H)", -1),),
    "freed": (("freed", "(B, H)", 0),),
    "reclaimable": (("reclaimable", "(B,)", 0),),
    "moves": (("moves", "(B, H, C, 2)", -1), ("move_counts", "(B, H)", 0)),
}

_SNAP_INPUTS = (_ext.PrefillInput.window_probs, _ext.PrefillInput.window_logits, _ext.PrefillInput.window_queries)


def _snap_input(input: int) -> Any:
    """prefill_snapkv's input code (0 probs, 1 logits, 2 queries) as the extension's PrefillInput."""
    if not 0 <= input <= 2:
        raise _ext.InvalidArgument(
            f"kvevict::python::prefill: argument 'input' = {input} is not 0 (window probs), 1 (window logits) "
            "or 2 (window queries)"
        )
    return _SNAP_INPUTS[input]


_GLOBALS: Dict[str, Any] = {
    "_ext": _ext,
    "_a": for_ext,
    "_snap_input": _snap_input,
    "_PrefillInput": _ext.PrefillInput,
    "_LseBase": _ext.LseBase,
}


def _ext_call(call: Call, desc: str, state: str, stream: str, workspace: str) -> str:
    """The extension call's source, the table's arguments converted."""
    tensors = {a.name for a in call.args if a.tensor} | {o[0] for o in _OUTPUTS[call.out]}
    parts = []
    for e in call.ext_args:
        if e == "desc":
            parts.append(desc)
        elif e == "state":
            parts.append(f"_a({state})")
        elif e == "stream":
            parts.append(stream)
        elif e == "workspace":
            parts.append(workspace)
        elif e in tensors:
            parts.append(f"_a({e})")
        else:
            parts.append(e)
    return f"_ext.{call.ext}({', '.join(parts)})"


def _params(call: Call) -> str:
    return ", ".join(a.name + (f"={a.default}" if a.default else "") for a in call.args)


def _returns(call: Call) -> str:
    names = [o[0] for o in _OUTPUTS[call.out]]
    return "None" if not names else names[0] if len(names) == 1 else "(" + ", ".join(names) + ")"


def _compile(source: str, name: str, extra: Dict[str, Any]) -> Callable[..., Any]:
    scope = dict(_GLOBALS, **extra)
    exec(compile(source, f"<kvevict._calls {name}>", "exec"), scope)
    return scope[name]


# ---- the direct route ------------------------------------------------------------------------------


def _policy_shape(shape: str) -> str:
    """An output's shape in terms of the policy's attributes."""
    for letter, attr in (("B", "p.num_seqs"), ("H", "p.num_kv_heads"), ("C", "p.capacity")):
        shape = shape.replace(letter, attr)
    return shape


def _call_lines(call: Call, desc: str, state: str, on_cuda: str, torch_mod: str, device: str) -> List[str]:
    """The extension call of a route, stream in ``s``: on CUDA a call with a
    workspace first asks its size (workspace None), then passes one."""
    lines = []
    if call.workspace:
        lines.append("    workspace = None")
        lines.append(f"    if {on_cuda}:")
        lines.append(f"        n = {_ext_call(call, desc, state, 's', 'None')}")
        lines.append(f"        workspace = {torch_mod}.empty(max(n, 1), dtype={torch_mod}.uint8, device={device})")
    lines.append(f"    {_ext_call(call, desc, state, 's', '_a(workspace)')}")
    return lines


def _direct_source(call: Call) -> str:
    """direct.<name>(p, *args, out=None, stream=None) for a BatchedPolicy p."""
    params = _params(call)
    op_args = ", ".join(a.name for a in call.args)
    outs = _OUTPUTS[call.out]
    lines = [f"def {call.name}(p{', ' + params if params else ''}, out=None, stream=None):"]
    # p._is_compiling: torch.compiler.is_compiling for a torch state, else None.
    lines.append("    if p._is_compiling is not None and p._is_compiling():")
    lines.append(f"        return p._ops().{call.name}(p.state, p.descriptor{', ' + op_args if op_args else ''})")
    for i, (name, shape, fill) in enumerate(outs):
        own = f"p._new_int32({_policy_shape(shape)}, {fill})"
        lines.append(f"    {name} = {own if i or call.out == 'moves' else f'out if out is not None else {own}'}")
    if call.name != "init":
        lines.append(f"    if p._cuda: p._unchecked.add({call.checked or call.name!r})")
    lines.append("    s = p._stream(stream) if p._cuda else 0")
    lines += _call_lines(call, "p._desc", "p.state", "p._cuda", "p._torch", "p.device")
    lines.append(f"    return {_returns(call)}")
    return "\n".join(lines) + "\n"


def _host_source(call: Call) -> str:
    params = _params(call)
    lines = [f"def {call.name}(p{', ' + params if params else ''}, stream=None):",
             f"    return {_ext_call(call, 'p._desc', 'p.state', 'p._stream(stream)', 'None')}"]
    return "\n".join(lines) + "\n"


direct = SimpleNamespace(
    **{c.name: _compile(_direct_source(c), c.name, {}) for c in CALLS},
    **{c.name: _compile(_host_source(c), c.name, {}) for c in HOST_CALLS},
)
"""The direct route of every call: ``direct.<name>(policy, *args, out=None, stream=None)``."""


# ---- the torch.library route --------------------------------------------------------------------


def schema(call: Call) -> str:
    """The op's schema, from the table: '(Tensor(a0!) state, SymInt[] desc, ...) -> Tensor'."""
    parts = ["Tensor(a0!) state", "SymInt[] desc"]
    for i, a in enumerate(call.args, start=2):
        type_ = f"Tensor(a{i}!)" if a.mutated else a.type
        parts.append(f"{type_} {a.name}" + (f"={a.default}" if a.default else ""))
    n = len(_OUTPUTS[call.out])
    returns = "()" if n == 0 else "Tensor" if n == 1 else "(" + ", ".join(["Tensor"] * n) + ")"
    return f"({', '.join(parts)}) -> {returns}"


_ANNOTATIONS = {"Tensor": "Tensor", "Tensor!": "Tensor", "Tensor?": "Optional[Tensor]", "SymInt": "int", "float": "float"}


def _kernel_source(call: Call) -> str:
    """The op's kernel, annotated (torch.library.custom_op can infer its schema from it too)."""
    params = ", ".join(f"{a.name}: {_ANNOTATIONS[a.type]}" + (f" = {a.default}" if a.default else "")
                       for a in call.args)
    outs = _OUTPUTS[call.out]
    returns = "None" if not outs else "Tensor" if len(outs) == 1 else "Tuple[Tensor, Tensor]"
    lines = [f"def {call.name}(state: Tensor, desc: List[int]{', ' + params if params else ''}) -> {returns}:"]
    lines.append("    d, B, H, C = _entry(desc)")
    if outs:
        for name, shape, fill in outs:
            lines.append(f"    {name} = torch.full({shape}, {fill}, dtype=torch.int32, device=state.device)")
    lines.append("    s = _stream(state)")
    lines += _call_lines(call, "d", "state", "state.is_cuda", "torch", "state.device")
    lines.append(f"    return {_returns(call)}")
    return "\n".join(lines) + "\n"


def _fake_source(call: Call) -> str:
    params = _params(call)
    outs = _OUTPUTS[call.out]
    lines = [f"def {call.name}(state, desc{', ' + params if params else ''}):"]
    if outs:
        lines.append("    B, H, C = _shape(desc)")
        made = [f"state.new_empty({shape}, dtype=torch.int32)" for _, shape, _ in outs]
        lines.append(f"    return {made[0] if len(made) == 1 else '(' + ', '.join(made) + ')'}")
    else:
        lines.append("    return None")
    return "\n".join(lines) + "\n"


def register_ops(lib: Any, helpers: Dict[str, Any]) -> Tuple[Dict[str, Any], Dict[str, Callable[..., Any]]]:
    """Defines ``torch.ops.kvevict.<name>`` for every call of the table in
    ``lib`` (a ``torch.library.Library("kvevict", "DEF")``): the schema,
    the kernel (CPU and CUDA) and the fake kernel. ``helpers`` (kvevict.ops):
    _entry (desc to (Descriptor, num_seqs, num_kv_heads, capacity), one
    cache lookup a call), _shape (desc to the shape, for the fake kernels)
    and _stream. Returns the ops (the
    ``OpOverload`` of each name) and the kernels by name.

    torch.library's define + impl rather than its ``custom_op`` decorator,
    whose Python autograd, ADInplaceOrView and dynamo-disable wrappers cost
    about 10 us a call before the kernel runs: these ops have no gradient
    (torch's C++ autograd fallback passes them through) and a dynamo trace
    never enters their kernels (their fake kernels stand in)."""
    import torch
    from torch import Tensor
    from torch.library import register_fake

    helpers = dict(helpers, torch=torch, Tensor=Tensor, Optional=Optional, List=List, Tuple=Tuple)
    ops: Dict[str, Any] = {}
    kernels: Dict[str, Callable[..., Any]] = {}
    for call in CALLS:
        kernel = _compile(_kernel_source(call), call.name, helpers)
        fake = _compile(_fake_source(call), call.name, helpers)
        lib.define(call.name + schema(call))
        lib.impl(call.name, kernel, "CPU")
        lib.impl(call.name, kernel, "CUDA")
        op = getattr(torch.ops.kvevict, call.name).default
        register_fake(op, fake, lib=lib)
        op.__doc__ = kernel.__doc__ = call.doc
        ops[call.name] = op
        kernels[call.name] = kernel
    return ops, kernels
