"""TreeKVCache (specdec_ext.models.kv_cache): a static Hugging Face Cache with per-row lengths.

After a tree forward, accepting a root-to-node path and compacting must leave exactly the cache that running the
accepted sequence from scratch builds (compared with transformers' own DynamicCache), and the next decoding step
from the compacted cache must give the from-scratch logits.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_hf_tree_attention import (FAMILIES, V, CountCalls, make_model, random_prompts,  # noqa: E402
                                    random_tree, root_path)

from specdec_ext import ops  # noqa: E402
from specdec_ext.models import TreeKVCache, extend, tree_forward, use_tree_attention  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@torch.no_grad()
def scratch(model, seq: torch.Tensor):
    """Logits and per-layer (keys, values) [Hkv, len, D] of running ``seq`` alone (SDPA, HF DynamicCache)."""
    saved = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        out = model(seq[None], use_cache=True)
    finally:
        model.set_attn_implementation(saved)
    return out.logits[0], [(layer.keys[0], layer.values[0]) for layer in out.cache.layers]


def test_layout_and_plain_forward_matches_dynamic_cache():
    model = make_model("llama")
    cfg = model.config
    cache = TreeKVCache(cfg, 2, 20)
    assert isinstance(cache, transformers.cache_utils.Cache)
    L, Hkv, D = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
    assert cache.storage.shape == (L, 2, 2, Hkv, 20, D) and cache.storage.is_contiguous()
    views = cache.kv_views()
    assert len(views) == 2 * L
    for l, layer in enumerate(cache.layers):
        assert layer.keys.data_ptr() == cache.storage[l, 0].data_ptr() and layer.keys.is_contiguous()
        assert layer.values.data_ptr() == cache.storage[l, 1].data_ptr()
    assert cache.get_max_length() == 20 and cache.get_seq_length() == 0

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (2, 7), generator=gen)
    nxt = torch.randint(0, V, (2, 1), generator=gen)
    with torch.no_grad():
        ours = model(ids, cache=cache, use_cache=True).logits
        ours_step = model(nxt, cache=cache, use_cache=True).logits
        theirs = model(ids, use_cache=True)
        theirs_step = model(nxt, cache=theirs.cache, use_cache=True).logits
    torch.testing.assert_close(ours, theirs.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours_step, theirs_step, atol=1e-5, rtol=1e-5)
    assert cache.lengths.tolist() == [8, 8] and cache.get_seq_length() == 8
    for l, layer in enumerate(theirs.cache.layers):
        torch.testing.assert_close(cache.storage[l, 0, :, :, :8], layer.keys, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(cache.storage[l, 1, :, :, :8], layer.values, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "gemma3"])
def test_compacted_cache_equals_cache_built_from_scratch(family, B, monkeypatch):
    gen = torch.Generator().manual_seed(50 + B + len(family))
    model = make_model(family, seed=2)
    assert use_tree_attention(model)
    N = 10
    prompt_lens = [7, 3, 11][:B]
    prompts, padded = random_prompts(gen, prompt_lens)
    tokens = torch.randint(0, V, (B, N), generator=gen)
    parents = random_tree(gen, B, N)
    cache = TreeKVCache(model.config, B, 40)
    compactions = CountCalls(monkeypatch, "compact_kv")
    with torch.no_grad():
        extend(model, cache, padded, torch.tensor(prompt_lens))
        tree_forward(model, cache, tokens, parents)
    # Accept a random root-to-node path per row (as a verifier would: root first, -1 padded).
    accepted = torch.full((B, N), -1, dtype=torch.int64)
    accept_len = torch.zeros(B, dtype=torch.int64)
    for b in range(B):
        node = int(torch.randint(0, N, (1,), generator=gen)) if b else N - 1  # row 0: the deepest-numbered node
        path = root_path(parents[b].tolist(), node)
        accepted[b, : len(path)] = torch.tensor(path)
        accept_len[b] = len(path) - 1
    cache.accept(accepted, accept_len, torch.tensor(prompt_lens))
    assert compactions.calls == 1  # one compact_kv call moves every layer's K and V
    new_lens = [prompt_lens[b] + int(accept_len[b]) + 1 for b in range(B)]
    assert cache.lengths.tolist() == new_lens

    nxt = torch.randint(0, V, (B, 1), generator=gen)
    with torch.no_grad():
        step = extend(model, cache, nxt)
    assert cache.lengths.tolist() == [n + 1 for n in new_lens]
    for b in range(B):
        path = accepted[b, : int(accept_len[b]) + 1]
        seq = torch.cat([prompts[b], tokens[b, path]])
        _, kv = scratch(model, seq)
        for l, (k, v) in enumerate(kv):
            torch.testing.assert_close(cache.storage[l, 0, b, :, : seq.numel()], k, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(cache.storage[l, 1, b, :, : seq.numel()], v, atol=1e-5, rtol=1e-5)
        logits, _ = scratch(model, torch.cat([seq, nxt[b]]))
        torch.testing.assert_close(step[b, 0], logits[-1], atol=1e-4, rtol=1e-4)


def test_greedy_verification_step_and_plain_decoding_after_compaction():
    """A whole speculative step on one row: the draft tree contains the target's greedy continuation, so greedy
    verification accepts several tokens; after accept(), a plain transformers decoding step (no tree metadata, the
    cache's own length) continues exactly like decoding from scratch."""
    gen = torch.Generator().manual_seed(9)
    model = make_model("qwen3", seed=5)
    use_tree_attention(model)
    prompt = torch.randint(0, V, (9,), generator=gen)
    greedy = [int(scratch(model, prompt)[0][-1].argmax())]
    for _ in range(4):
        greedy.append(int(scratch(model, torch.cat([prompt, torch.tensor(greedy)]))[0][-1].argmax()))
    root = greedy[0]
    # Tree: root -> (wrong, g1 -> (g2 -> (wrong, g3)))
    parents = torch.tensor([[-1, 0, 0, 2, 3, 3]])
    tokens = torch.tensor([[root, (greedy[1] + 1) % V, greedy[1], greedy[2], (greedy[3] + 1) % V, greedy[3]]])
    cache = TreeKVCache(model.config, 1, 32)
    with torch.no_grad():
        extend(model, cache, prompt[None])
        logits = tree_forward(model, cache, tokens, parents)
    accepted, accept_len, next_token = ops.verify_tree_greedy(logits, tokens, parents)
    assert accepted[0, :4].tolist() == [0, 2, 3, 5] and int(accept_len[0]) == 3
    assert int(next_token[0]) == greedy[4]
    cache.accept(accepted, accept_len, cache.lengths)
    assert cache.get_seq_length() == 9 + 4
    with torch.no_grad():
        step = model(next_token[:, None], cache=cache, use_cache=True).logits[0, -1]
    expected, kv = scratch(model, torch.cat([prompt, torch.tensor(greedy)]))
    torch.testing.assert_close(step, expected[-1], atol=1e-4, rtol=1e-4)
    for l, (k, v) in enumerate(kv):
        torch.testing.assert_close(cache.storage[l, 0, 0, :, :14], k, atol=1e-5, rtol=1e-5)


def test_rewind_and_compact_semantics():
    model = make_model("gemma")
    cache = TreeKVCache(model.config, 2, 8)
    cache.storage.copy_(torch.arange(cache.storage.numel(), dtype=torch.float32).view_as(cache.storage))
    before = cache.storage.clone()
    cache.rewind(torch.tensor([5, 2]))
    assert cache.lengths.tolist() == [5, 2]
    assert all(layer.lengths.tolist() == [5, 2] for layer in cache.layers)
    # Overlapping move: row 0 keeps positions [1, 3, 4] at 1..3; row 1 moves nothing.
    cache.compact(torch.tensor([[1, 3, 4], [0, 0, 0]]), torch.tensor([1, 2]), torch.tensor([3, 0]))
    assert cache.lengths.tolist() == [4, 2]
    want = before.clone()
    want[:, :, 0, :, 1:4] = before[:, :, 0, :, [1, 3, 4]]
    assert torch.equal(cache.storage, want)
    cache.crop(-1)
    assert cache.lengths.tolist() == [3, 1]
    cache.reset()
    assert cache.lengths.tolist() == [0, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_writes_land_at_each_layers_own_lengths(dtype):
    """``update`` writes at ``lengths[b] + j`` per row, through a flat index the first layer of a forward computes and
    the others reuse; a single layer cropped on its own (lengths no longer equal across layers) gets its own index.
    Compared with a scatter-based reference write of the same keys/values."""
    model = make_model("llama")
    cfg = model.config
    cache = TreeKVCache(cfg, 3, 12, dtype=dtype)
    gen = torch.Generator().manual_seed(0)
    L, Hkv, D = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
    want = cache.storage.clone()

    def write(lengths_per_layer, q):
        for l, layer in enumerate(cache.layers):
            k = torch.randn(3, Hkv, q, D, generator=gen).to(dtype)
            v = torch.randn(3, Hkv, q, D, generator=gen).to(dtype)
            pos = torch.tensor(lengths_per_layer[l])[:, None] + torch.arange(q)
            for b in range(3):
                want[l, 0, b, :, pos[b]] = k[b]
                want[l, 1, b, :, pos[b]] = v[b]
            layer.update(k, v)

    cache.rewind(torch.tensor([0, 4, 2]))
    write([[0, 4, 2]] * L, 3)  # one forward of 3 tokens
    write([[3, 7, 5]] * L, 2)  # the next forward continues from the advanced lengths
    cache.layers[1].crop(-2)  # layer 1 alone steps back: the layers now differ
    lens = [[5, 9, 7]] * L
    lens[1] = [3, 7, 5]
    write(lens, 1)
    assert torch.equal(cache.storage, want)
    assert cache.layers[0].lengths.tolist() == [6, 10, 8] and cache.layers[1].lengths.tolist() == [4, 8, 6]
    cache.crop(-1)  # cache-wide: every layer steps back one (they still differ)
    lens = [[5, 9, 7]] * L
    lens[1] = [3, 7, 5]
    write(lens, 2)
    assert torch.equal(cache.storage, want)
    cache.rewind(torch.tensor([1, 0, 5]))  # equal again: shared once more
    write([[1, 0, 5]] * L, 4)
    assert torch.equal(cache.storage, want) and cache._write_index.uniform


def test_cache_bad_input():
    model = make_model("llama")
    cache = TreeKVCache(model.config, 2, 8)
    with pytest.raises(ValueError, match=r"lengths .* must be in \[0, max_len = 8\]"):
        cache.rewind(torch.tensor([3, 9]))
    with pytest.raises(ValueError, match=r"lengths must be a number or a \[2\] tensor"):
        cache.rewind(torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match=r"src_positions must have shape \[B=2, L\]"):
        cache.compact(torch.zeros(3, 2, dtype=torch.int64), 0, 1)
    with pytest.raises(ValueError, match=r"src_positions\[1, 0\] = 8 is out of range"):
        cache.compact(torch.tensor([[0], [8]]), 0, 1)
    with pytest.raises(ValueError, match=r"dst_start\[0\] = 7"):
        cache.compact(torch.tensor([[0, 1], [0, 1]]), torch.tensor([7, 0]), 2)
    with pytest.raises(ValueError, match=r"accepted must have shape \[B=2, N\]"):
        cache.accept(torch.zeros(1, 4, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), 0)
    cache.rewind(torch.tensor([1, 3]))
    with pytest.raises(ValueError, match="rows have different lengths"):
        cache.get_seq_length()
    cache.rewind(7)
    with pytest.raises(ValueError, match="overflows max_len = 8"), torch.no_grad():
        model(torch.zeros(2, 2, dtype=torch.int64), cache=cache, use_cache=True)
    with pytest.raises(NotImplementedError, match="beam search"):
        cache.reorder_cache(torch.tensor([1, 0]))


def _speculative_step(model, device, prompt_lens, padded, tokens, parents, accepted, accept_len, nxt, use_kernel):
    model = model.to(device)
    cache = TreeKVCache(model.config, len(prompt_lens), 32, device=device)
    with torch.no_grad():
        extend(model, cache, padded.to(device), torch.tensor(prompt_lens))
        logits = tree_forward(model, cache, tokens.to(device), parents.to(device), use_kernel=use_kernel)
        cache.accept(accepted.to(device), accept_len.to(device), torch.tensor(prompt_lens))
        step = extend(model, cache, nxt.to(device), use_kernel=use_kernel)
    return logits.cpu(), step.cpu(), cache.storage.cpu(), cache.lengths.cpu()


@pytest.mark.parametrize("use_kernel", [True, False], ids=["kernel", "mask"])
def test_speculative_step_on_device_matches_cpu(device, use_kernel):
    """prefill -> tree forward -> accept (compact_kv) -> decoding step, on ``device``, equals the same on CPU."""
    gen = torch.Generator().manual_seed(31)
    model = make_model("llama", seed=7)
    use_tree_attention(model)
    B, N = 3, 8
    prompt_lens = [4, 9, 6]
    _, padded = random_prompts(gen, prompt_lens)
    tokens = torch.randint(0, V, (B, N), generator=gen)
    parents = random_tree(gen, B, N)
    accepted = torch.full((B, N), -1, dtype=torch.int64)
    accept_len = torch.zeros(B, dtype=torch.int64)
    for b in range(B):
        path = root_path(parents[b].tolist(), N - 1 - b)
        accepted[b, : len(path)] = torch.tensor(path)
        accept_len[b] = len(path) - 1
    nxt = torch.randint(0, V, (B, 1), generator=gen)
    args = (prompt_lens, padded, tokens, parents, accepted, accept_len, nxt, use_kernel)
    want = _speculative_step(model, "cpu", *args)
    got = _speculative_step(model, device, *args)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


def test_forwards_work_with_grad_enabled():
    """tree_forward / extend run without the caller wrapping them in torch.no_grad (the cache is inference state)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from specdec_ext import ops
    from specdec_ext.models import TreeKVCache, extend, tree_forward, use_tree_attention

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                                         vocab_size=100)).eval()
    assert use_tree_attention(model)
    assert torch.is_grad_enabled()
    cache = TreeKVCache(model.config, batch_size=1, max_len=32)
    extend(model, cache, torch.randint(0, 100, (1, 7)))
    parents = torch.tensor([[-1, 0, 0, 1]])
    tokens = torch.randint(0, 100, (1, 4))
    prefix = cache.lengths.clone()
    logits = tree_forward(model, cache, tokens, parents, prefix)
    result = ops.verify_tree_greedy(logits, tokens, parents)
    cache.accept(result.accepted, result.accept_len, prefix)
    assert int(cache.lengths[0]) == 7 + int(result.accept_len[0]) + 1


def test_add_rows_takes_a_shorter_prefill_cache():
    """A joining prefill's cache need only hold its prompts: add_rows copies its max_len slots into the first slots
    of the new rows, with their lengths, and keeps the rows already there as they were; a longer cache is refused."""
    cfg = make_model("llama").config
    cache = TreeKVCache(cfg, 1, 20, capacity=4)
    cache.storage.normal_()
    before = cache.storage.clone()
    src = TreeKVCache(cfg, 2, 6)
    src.storage.normal_()
    src.rewind(torch.tensor([6, 4]))
    cache.add_rows(src)
    assert cache.batch_size == 3 and cache.lengths.tolist()[1:] == [6, 4]
    assert torch.equal(cache.storage[:, :, :1], before)
    assert torch.equal(cache.storage[:, :, 1:, :, :6], src.storage)
    with pytest.raises(ValueError, match="max_len <= 20"):
        cache.add_rows(TreeKVCache(cfg, 1, 21))
