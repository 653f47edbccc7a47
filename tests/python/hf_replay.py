"""What the transformers tests share: generate with or without a kvevict
cache, watch every layer's slot table after each forward, and replay a
recorded run through the C++ per-sequence policy (kvevict.SequencePolicy),
which must keep the same positions. Works on any device: snapshots and
records are taken to the CPU."""

from __future__ import annotations

import numpy as np
import torch
import transformers

import kvevict as kv
import kvevict.hf as kvhf


def generate(model, ids, new_tokens, cache=None, attn="kvevict", **kw):
    model.set_attn_implementation(attn)
    kwargs = dict(max_new_tokens=new_tokens, do_sample=False, attention_mask=torch.ones_like(ids))
    kwargs.update(kw)
    if cache is not None:
        kwargs.update(kvhf.generate_kwargs(cache))
    with torch.no_grad():
        return model.generate(ids, **kwargs)


def sample_twice(model, ids, new_tokens, config, head_dim):
    """Two sampled generations from the same seed, each watched (budget + 1
    slots per head at every step): the token tensors of both."""
    runs = []
    for _ in range(2):
        torch.manual_seed(123)
        cache = kvhf.KVEvictCache(config)
        watch = Watch(cache, config.budget + 1, head_dim)
        runs.append(generate(model, ids, new_tokens, cache, do_sample=True, top_k=20,
                             logits_processor=transformers.LogitsProcessorList([watch])))  # fmt: skip
    return runs


class Watch(transformers.LogitsProcessor):
    """Called after every forward: snapshots each layer's slot table and
    checks that its K/V tensors hold exactly `slots` slots per head."""

    def __init__(self, cache, slots, head_dim):
        self.cache, self.slots, self.head_dim, self.positions = cache, slots, head_dim, []

    def __call__(self, input_ids, scores):
        for layer in self.cache.layers:
            B, H = layer.policy.num_seqs, layer.policy.num_kv_heads
            shape = (B, H, self.slots, self.head_dim)
            assert tuple(layer.keys.shape) == shape, layer.keys.shape
            assert tuple(layer.values.shape) == shape, layer.values.shape
            assert int(layer.policy.counts.max()) <= self.slots
        self.cache.check()  # on CUDA, a refusal recorded on the device raises here with its own message
        self.positions.append([layer.policy.positions.cpu().clone() for layer in self.cache.layers])
        return scores


def reference_policy(config, layer):
    p = layer.policy
    return kv.SequencePolicy(config, p.num_seqs, p.num_kv_heads, p.capacity, num_q_heads=p.num_q_heads)


def replay_attention(cache, watch, config, prompt_length, steps):
    """Every layer's recorded attention (the prompt's column sums, then each
    step's probabilities) through the per-sequence h2o_policy."""
    for layer_idx, layer in enumerate(cache.layers):
        ref, records = reference_policy(config, layer), layer.records
        assert records[0]["kind"] == "prompt" and len(records) == steps
        sums = records[0]["column_sums"].numpy()
        for b in range(layer.policy.num_seqs):
            ref.prefill_column_sums(b, prompt_length, np.ascontiguousarray(sums[b]))
        np.testing.assert_array_equal(ref.positions(), watch.positions[0][layer_idx].numpy(), err_msg=f"layer {layer_idx} prompt")
        for step, record in enumerate(records[1:], start=1):
            probs = record["probs"].numpy()
            for b in range(layer.policy.num_seqs):
                ref.append(b)
                ref.observe_probs(b, np.ascontiguousarray(probs[b]))
                ref.evict(b)
            np.testing.assert_array_equal(ref.positions(), watch.positions[step][layer_idx].numpy(),
                                          err_msg=f"layer {layer_idx} step {step}")  # fmt: skip


def fp8_codes(x, fmt, scale):
    """What an fp8 cache holds for rows x: x / scale rounded to the format,
    saturated to its largest finite value (as vLLM's and kvevict.hf's)."""
    top = torch.finfo(fmt).max
    return (x.float() / scale).clamp(-top, top).to(fmt)


def replay_keys(cache, watch, config, prompt_length, steps, scores, kv_dtype=None, k_scale=1.0):
    """Every layer's recorded keys (the prompt's, then each step's new one),
    in a BHSD buffer of the replay's own (fp8 codes with ``k_scale`` when
    ``kv_dtype`` is given, quantized here), through the per-sequence
    h2o_policy's key-scored prefill and steps (`scores`: "key_norms" or
    "key_diff")."""
    L = prompt_length
    for layer_idx, layer in enumerate(cache.layers):
        p, ref, records = layer.policy, reference_policy(config, layer), layer.records
        assert records[0]["kind"] == "prompt" and len(records) == steps
        prompt = records[0]["keys"]
        shape = (p.num_seqs, p.num_kv_heads, p.capacity, prompt.shape[-1])
        if kv_dtype is None:
            k = torch.zeros(shape, dtype=prompt.dtype)
            store = lambda x: x  # noqa: E731
        else:
            k = torch.zeros(shape, dtype=kv_dtype)
            store = lambda x: fp8_codes(x, kv_dtype, k_scale)  # noqa: E731
        bits = lambda t: t.view(torch.uint8) if kv_dtype is not None else t  # noqa: E731
        bits(k)[:, :, :L] = bits(store(prompt))
        view = kv.CacheView(k, k.clone(), "bhsd", **({} if kv_dtype is None else dict(k_scale=k_scale, v_scale=1.0)))
        for b in range(p.num_seqs):
            getattr(ref, f"prefill_{scores}")(b, L, view)
        np.testing.assert_array_equal(ref.positions(), watch.positions[0][layer_idx].numpy(), err_msg=f"layer {layer_idx} prompt")
        for step, record in enumerate(records[1:], start=1):
            k_new = bits(store(record["k_new"]))
            for b in range(p.num_seqs):
                position = ref.append(b)
                for h in range(p.num_kv_heads):
                    (slot,) = np.flatnonzero(ref.positions()[b, h] == position)
                    bits(k)[b, h, slot] = k_new[b, h]
                getattr(ref, f"observe_{scores}")(b, view)
                ref.evict(b)
            np.testing.assert_array_equal(ref.positions(), watch.positions[step][layer_idx].numpy(),
                                          err_msg=f"layer {layer_idx} step {step}")  # fmt: skip


def replay_lineages(cache, watch, config, prompt_length):
    """Beam search and several sequences per prompt: after every forward,
    each sequence's whole lineage (the prompt's column sums of the row it
    descends from, then each step's probabilities of the rows it passed
    through, following every recorded reorder) replayed from scratch through
    a fresh per-sequence h2o_policy must keep the positions the cache's
    policy keeps. The replay never forks: it is the reference for fork."""
    for layer_idx, layer in enumerate(cache.layers):
        p, lineages, forward = layer.policy, None, 0
        for record in layer.records:
            if record["kind"] == "prompt":
                sums = record["column_sums"].numpy()
                lineages = [[("prompt", sums[b])] for b in range(sums.shape[0])]
            elif record["kind"] == "select":
                lineages = [list(lineages[i]) for i in record["indices"].tolist()]
                continue
            else:
                probs = record["probs"].numpy()
                for b, lineage in enumerate(lineages):
                    lineage.append(("step", probs[b]))
            ref = kv.SequencePolicy(config, len(lineages), p.num_kv_heads, p.capacity, num_q_heads=p.num_q_heads)
            for b, lineage in enumerate(lineages):
                for kind, x in lineage:
                    if kind == "prompt":
                        ref.prefill_column_sums(b, prompt_length, np.ascontiguousarray(x))
                    else:
                        ref.append(b)
                        ref.observe_probs(b, np.ascontiguousarray(x))
                        ref.evict(b)
            np.testing.assert_array_equal(ref.positions(), watch.positions[forward][layer_idx].numpy(),
                                          err_msg=f"layer {layer_idx} forward {forward}")  # fmt: skip
            forward += 1
        assert forward == len(watch.positions)
