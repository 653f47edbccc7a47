"""kvevict.hf on every device: a small Llama with random weights (2 layers,
4 query heads, 2 KV heads, head_dim 16; built from a config, nothing
downloaded) generates on the CPU and, where there is a GPU, on CUDA, where
the cache's tensors, the slot tables and the policy calls all live on the
GPU. The same checks as test_transformers.py makes on SmolLM2 (which needs
the GGUF of a PyPI package the GPU machine lacks): with a budget covering
the sequence the tokens are the dynamic cache's; at 20% every layer holds
budget + 1 slots per head at every step and keeps what the C++
per-sequence policy keeps when fed the same attention or keys."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import kvevict as kv  # noqa: E402
import kvevict.hf as kvhf  # noqa: E402
import hf_replay  # noqa: E402

PROMPT, NEW_TOKENS, HEAD_DIM = 40, 16, 16


@pytest.fixture(scope="module", params=["cpu", "cuda"])
def tiny(request):
    if request.param == "cuda" and not (kv.cuda_available and torch.cuda.is_available()):
        pytest.skip("needs the CUDA backend and a GPU")
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=HEAD_DIM, max_position_embeddings=256,
        initializer_range=0.2,  # decisive logits: greedy tokens do not hinge on rounding
        bos_token_id=1, eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval().to(request.param)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    ids = torch.randint(2, 128, (2, PROMPT), generator=torch.Generator().manual_seed(1)).to(request.param)
    return model, ids


def generate(model, ids, cache=None, attn="kvevict", **kw):
    return hf_replay.generate(model, ids, NEW_TOKENS, cache, attn, min_new_tokens=NEW_TOKENS, **kw)


@pytest.mark.parametrize("batch", [1, 2])
def test_budget_covering_the_sequence_gives_the_dynamic_cache_tokens(tiny, batch):
    model, ids = tiny
    ids = ids[:batch]
    config = kv.H2OConfig(28, 28)
    assert config.budget >= PROMPT + NEW_TOKENS  # nothing is ever evicted
    expected = generate(model, ids, attn="eager")
    cache = kvhf.KVEvictCache(config)
    got = generate(model, ids, cache)
    assert got.device == ids.device and all(layer.keys.device == ids.device for layer in cache.layers)
    assert torch.equal(got, expected)


def test_twenty_percent_budget_holds_budget_plus_one_slots_and_keeps_what_the_cpp_policy_keeps(tiny):
    model, ids = tiny
    config = kv.H2OConfig.from_ratios(PROMPT + NEW_TOKENS, 0.1, 0.1)
    assert PROMPT > config.budget  # the prompt is compressed
    cache = kvhf.KVEvictCache(config, record=True)
    watch = hf_replay.Watch(cache, config.budget + 1, HEAD_DIM)
    out = generate(model, ids, cache, logits_processor=transformers.LogitsProcessorList([watch]))
    steps = out.shape[1] - PROMPT
    assert steps == NEW_TOKENS and len(watch.positions) == steps  # one check per forward
    hf_replay.replay_attention(cache, watch, config, PROMPT, steps)


@pytest.mark.parametrize("scores", ["key_norms", "key_diff"])
def test_key_scored_steps_keep_what_the_cpp_policy_keeps(tiny, scores):
    model, ids = tiny
    total = PROMPT + NEW_TOKENS
    config = kv.H2OConfig.key_norm(total // 10, total // 10, 2)
    cache = kvhf.KVEvictCache(config, scores=scores, record=True)
    watch = hf_replay.Watch(cache, config.budget + 1, HEAD_DIM)
    out = generate(model, ids, cache, logits_processor=transformers.LogitsProcessorList([watch]))
    hf_replay.replay_keys(cache, watch, config, PROMPT, out.shape[1] - PROMPT, scores)


@pytest.mark.parametrize("fmt", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("scores", ["attention", "key_norms", "key_diff"])
def test_fp8_slots_hold_codes_and_keep_what_the_cpp_policy_keeps_on_them(tiny, fmt, scores):
    # The slots hold fp8 codes of x / scale; a policy reads them as code x
    # scale: the replay quantizes the recorded keys itself and runs the C++
    # per-sequence policy on an fp8 CacheView with the same scale.
    model, ids = tiny
    total = PROMPT + NEW_TOKENS
    if scores == "attention":
        config = kv.H2OConfig.from_ratios(total, 0.1, 0.1)
        cache = kvhf.KVEvictCache(config, record=True, kv_dtype=fmt, k_scale=0.37, v_scale=0.29)
    else:
        config = kv.H2OConfig.key_norm(total // 10, total // 10, 2)
        cache = kvhf.KVEvictCache(config, scores=scores, record=True, kv_dtype=fmt, k_scale=0.37, v_scale=0.29)
    watch = hf_replay.Watch(cache, config.budget + 1, HEAD_DIM)
    out = generate(model, ids, cache, logits_processor=transformers.LogitsProcessorList([watch]))
    steps = out.shape[1] - PROMPT
    assert all(layer.keys.dtype == fmt and layer.values.dtype == fmt for layer in cache.layers)
    assert cache.kv_bytes() * 4 == sum(2 * layer.keys.numel() * 4 for layer in cache.layers)  # a float32 model's quarter
    if scores == "attention":
        hf_replay.replay_attention(cache, watch, config, PROMPT, steps)
    else:
        hf_replay.replay_keys(cache, watch, config, PROMPT, steps, scores, kv_dtype=fmt, k_scale=0.37)


def test_fp8_codes_decode_close_to_the_full_precision_cache(tiny):
    # With a budget covering the sequence nothing is evicted. The prompt's
    # logits are the full-precision cache's exactly (its attention runs in
    # the model's dtype); the prompt rows the slots hold afterwards decode
    # to within one e4m3 rounding of the model's.
    model, ids = tiny
    config = kv.H2OConfig(28, 28)
    full = model(ids, **kvhf.generate_kwargs(kvhf.KVEvictCache(config))).logits
    fp8_cache = kvhf.KVEvictCache(config, kv_dtype=torch.float8_e4m3fn, k_scale=0.05, v_scale=0.05)
    fp8 = model(ids, **kvhf.generate_kwargs(fp8_cache)).logits
    assert torch.equal(full, fp8)  # the prompt's attention runs in the model's dtype
    cache = kvhf.KVEvictCache(config, kv_dtype=torch.float8_e4m3fn, k_scale=0.05, v_scale=0.05)
    reference = kvhf.KVEvictCache(config)
    generate(model, ids, cache)
    generate(model, ids, reference)
    layer, ref_layer = cache.layers[0], reference.layers[0]
    decoded = layer.keys[:, :, :PROMPT].float() * 0.05  # the prompt's rows: the same tokens in both
    want_keys = ref_layer.keys[:, :, :PROMPT].float()
    assert float((decoded - want_keys).abs().max()) <= float(want_keys.abs().max()) / 16  # e4m3: 3 mantissa bits


def test_fp8_options_are_checked():
    config = kv.H2OConfig(4, 4)
    with pytest.raises(kv.InvalidArgument, match="'kv_dtype'"):
        kvhf.KVEvictCache(config, kv_dtype=torch.int8)
    with pytest.raises(kv.InvalidArgument, match="'k_scale' = 0.0 is not a positive finite number"):
        kvhf.KVEvictCache(config, kv_dtype=torch.float8_e4m3fn, k_scale=0.0)
    with pytest.raises(kv.InvalidArgument, match="'v_scale' = nan"):
        kvhf.KVEvictCache(config, kv_dtype=torch.float8_e5m2, v_scale=float("nan"))
    with pytest.raises(kv.InvalidArgument, match="'k_scale' applies to an fp8 kv_dtype only"):
        kvhf.KVEvictCache(config, k_scale=2.0)


@pytest.mark.parametrize("mode", ["prefill", "snapkv", "key_norms"])
def test_the_prompt_is_compressed_in_the_models_own_rows(tiny, mode):
    # A layer compresses the prompt where the model put its K/V, so it never
    # holds more rows than the prompt has: at most, the last layer holds the
    # prompt's rows and its new slots while it copies them out, every other
    # layer its slots, all below the dynamic cache's whole prompt.
    model, ids = tiny
    budget = (PROMPT + NEW_TOKENS) // 5
    if mode == "key_norms":
        config, kw = kv.H2OConfig.key_norm(budget // 2, budget // 2), dict(scores="key_norms")
    else:
        config, kw = kv.H2OConfig(budget // 2, budget // 2), dict(prompt_compression=mode,
                                                                  snap=kv.SnapKV(window=8) if mode == "snapkv" else None)
    cache = kvhf.KVEvictCache(config, **kw)
    with torch.no_grad():
        model(ids, **kvhf.generate_kwargs(cache))
    B, H, layers, P = ids.shape[0], 2, 2, config.budget + 1
    row = 2 * B * H * HEAD_DIM * 4  # K and V of one slot of every head, float32
    assert cache.kv_bytes() == layers * P * row
    assert cache.peak_kv_bytes() == PROMPT * row + P * row + (layers - 1) * P * row
    assert cache.peak_kv_bytes() < cache.dynamic_kv_bytes() == layers * PROMPT * row


def test_sampling_is_reproducible(tiny):
    model, ids = tiny
    config = kv.H2OConfig.from_ratios(PROMPT + NEW_TOKENS, 0.1, 0.1)
    first, second = hf_replay.sample_twice(model, ids, NEW_TOKENS, config, HEAD_DIM)
    assert torch.equal(first, second)


def test_beam_search_with_a_budget_covering_the_sequence_gives_the_dynamic_cache_beams(tiny):
    model, ids = tiny
    config = kv.H2OConfig(28, 28)  # nothing is ever evicted: every reorder must move the right rows
    kw = dict(num_beams=3, num_return_sequences=2, early_stopping=False)
    expected = generate(model, ids, attn="eager", **kw)
    got = generate(model, ids, kvhf.KVEvictCache(config), **kw)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("decoding", ["beams", "samples"])
def test_beams_and_returned_sequences_at_twenty_percent_keep_what_each_lineage_keeps(tiny, decoding):
    model, ids = tiny
    config = kv.H2OConfig.from_ratios(PROMPT + NEW_TOKENS, 0.1, 0.1)
    cache = kvhf.KVEvictCache(config, record=True)
    watch = hf_replay.Watch(cache, config.budget + 1, HEAD_DIM)
    kw = dict(num_beams=3, num_return_sequences=2, early_stopping=False) if decoding == "beams" else \
        dict(do_sample=True, top_k=20, num_return_sequences=3)  # fmt: skip
    torch.manual_seed(7)
    out = generate(model, ids, cache, logits_processor=transformers.LogitsProcessorList([watch]), **kw)
    assert out.shape[0] == ids.shape[0] * kw["num_return_sequences"]
    selects = [r for r in cache.layers[0].records if r["kind"] == "select"]
    if decoding == "beams":  # the beams were reordered, and not always in place
        assert len(selects) >= NEW_TOKENS - 1
        assert any(not torch.equal(r["indices"], torch.arange(r["indices"].numel())) for r in selects)
    else:
        assert not selects
    hf_replay.replay_lineages(cache, watch, config, PROMPT)


def test_the_batch_grows_and_shrinks_through_the_cache(tiny):
    model, ids = tiny
    config = kv.H2OConfig.from_ratios(PROMPT + NEW_TOKENS, 0.1, 0.1)
    cache = kvhf.KVEvictCache(config)
    generate(model, ids, cache)
    before = [(l.policy.positions.cpu().clone(), l.policy.scores.cpu().clone(), l.keys.clone()) for l in cache.layers]
    cache.batch_repeat_interleave(2)  # 0, 0, 1, 1
    cache.batch_select_indices(torch.tensor([3, 0, 1]))  # 1, 0, 0
    for layer, (positions, scores, keys) in zip(cache.layers, before):
        rows = torch.tensor([1, 0, 0])
        assert layer.policy.num_seqs == 3
        assert torch.equal(layer.policy.positions.cpu(), positions[rows])
        assert torch.equal(layer.policy.scores.cpu(), scores[rows])
        assert torch.equal(layer.keys, keys[rows.to(keys.device)])
    with pytest.raises(kv.OutOfRange, match="argument 'indices'"):
        cache.batch_select_indices(torch.tensor([3]))
    # The reshaped cache decodes on: a forward of the three sequences.
    step = torch.full((3, 1), 5, dtype=ids.dtype, device=ids.device)
    with torch.no_grad():
        model(step, use_cache=True, **kvhf.generate_kwargs(cache))  # cache= or past_key_values=, by version
    assert cache.get_seq_length() == PROMPT + NEW_TOKENS


def test_after_prompt_grow_keeps_the_compressed_context_and_grows_by_the_question_and_answer(tiny):
    """kvpress's protocol: the context is compressed to the budget, then the
    question (one forward of several tokens) and the answer join the kept
    rows without eviction. The tokens equal those of transformers' own
    DynamicCache holding the same kept rows, fed the question one token at
    a time with eager attention."""
    model, ids = tiny
    B, question_len = ids.shape[0], 8
    context = ids[:, : PROMPT - question_len]
    L = context.shape[1]
    config = kv.H2OConfig.from_ratios(L, 0.1, 0.1)
    cache = kvhf.KVEvictCache(config, after_prompt="grow")
    model.set_attn_implementation("kvevict")
    with torch.no_grad():
        model(context, use_cache=True, **kvhf.generate_kwargs(cache))
    kept = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    assert all(k.shape[2] == config.budget for k, _ in kept) and config.budget < L
    got = generate(model, ids, cache)[:, PROMPT:]
    assert all(layer.keys.shape[2] == config.budget + question_len + NEW_TOKENS - 1 for layer in cache.layers)
    assert cache.get_seq_length() == PROMPT + NEW_TOKENS - 1

    ref = transformers.DynamicCache()
    for i, (k, v) in enumerate(kept):
        ref.update(k, v, i)
    model.set_attn_implementation("eager")
    position, want, token = L, [], None
    with torch.no_grad():
        for t in range(question_len + NEW_TOKENS - 1):
            step = ids[:, PROMPT - question_len + t][:, None] if t < question_len else token[:, None]
            positions = torch.full((B, 1), position, dtype=torch.long, device=ids.device)
            logits = model(step, position_ids=positions, use_cache=True, **kvhf.generate_kwargs(ref)).logits
            position += 1
            if t >= question_len - 1:
                token = logits[:, -1].argmax(-1)
                want.append(token)
    assert torch.equal(got, torch.stack(want, dim=1))


def test_after_prompt_is_checked():
    config = kv.H2OConfig.key_norm(4, 4)
    with pytest.raises(kv.InvalidArgument, match="argument 'after_prompt' = 'keep'"):
        kvhf.KVEvictCache(config, after_prompt="keep")
    with pytest.raises(kv.InvalidArgument, match="after_prompt='grow' evicts nothing after the prompt"):
        kvhf.KVEvictCache(config, scores="key_norms", after_prompt="grow")
