"""Tree verification through Hugging Face models (specdec_ext.models): tiny random models built from configs.

For every family, after a random prompt prefill with a different length per row, one tree forward must give, for
every node, the logits of running its root-to-node path alone with plain causal attention (no cache, SDPA), both
through the tree kernel (attention implementation "specdec_tree") and through the 4-D mask fallback.
"""

from __future__ import annotations

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from specdec_ext import ops  # noqa: E402
from specdec_ext.models import (TREE_ATTENTION, TreeKVCache, extend, tree_attention_mask,  # noqa: E402
                                tree_forward, use_tree_attention, uses_attention_interface)
from specdec_ext.ops import reference as ref  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

V = 101
_SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=V, head_dim=64)

# name -> (config class, model class, extra config); head_dim must be one the kernel supports (64 here, 80 for Phi3)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"query_pre_attn_scalar": 48}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"hidden_size": 160, "num_attention_heads": 2, "num_key_value_heads": 1,
                                               "head_dim": 80, "pad_token_id": 0, "bos_token_id": 1,
                                               "eos_token_id": 2}),
}


def make_model(family: str, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    config_cls, model_cls, extra = FAMILIES[family]
    kwargs = {**_SMALL, **extra, **overrides}
    config = getattr(transformers, config_cls)(**kwargs)
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = getattr(transformers, model_cls)(config)
    return model.to(dtype).eval()


def random_tree(gen: torch.Generator, B: int, N: int) -> torch.Tensor:
    """parents[B, N]: each node's parent drawn uniformly among the earlier nodes."""
    parents = torch.full((B, N), -1, dtype=torch.int64)
    for i in range(1, N):
        parents[:, i] = torch.randint(0, i, (B,), generator=gen)
    return parents


def root_path(parents_row: list[int], node: int) -> list[int]:
    path = []
    while node != -1:
        path.append(node)
        node = parents_row[node]
    return path[::-1]


@torch.no_grad()
def path_logits(model, prompts: list[torch.Tensor], tokens: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
    """Reference: for every row b and node i, the last logits of running prompt_b + (root-to-i tokens) alone with
    plain causal attention (SDPA, no cache). One forward per leaf covers all its ancestors."""
    B, N = tokens.shape
    out = torch.full((B, N, model.config.vocab_size), float("nan"))
    saved = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        for b in range(B):
            prow = parents[b].tolist()
            leaves = [i for i in range(N) if i not in prow]
            for leaf in leaves:
                path = root_path(prow, leaf)
                seq = torch.cat([prompts[b], tokens[b, path]])[None]
                logits = model(seq).logits[0].float()
                P = prompts[b].numel()
                for k, node in enumerate(path):
                    out[b, node] = logits[P + k]
    finally:
        model.set_attn_implementation(saved)
    return out


def random_prompts(gen: torch.Generator, lengths: list[int]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Prompts of the given lengths and their right-padded [B, max] matrix."""
    prompts = [torch.randint(0, V, (n,), generator=gen) for n in lengths]
    padded = torch.zeros(len(lengths), max(lengths), dtype=torch.int64)
    for b, p in enumerate(prompts):
        padded[b, : p.numel()] = p
    return prompts, padded


class CountCalls:
    def __init__(self, monkeypatch, name: str):
        self.calls = 0
        original = getattr(ops, name)

        def counted(*args, **kwargs):
            self.calls += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(ops, name, counted)


@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_tree_forward_equals_each_path_alone(family, B, monkeypatch):
    gen = torch.Generator().manual_seed(1000 + 7 * B + len(family))
    model = make_model(family)
    N = 11
    prompt_lens = [5, 12, 8][:B]
    prompts, padded = random_prompts(gen, prompt_lens)
    tokens = torch.randint(0, V, (B, N), generator=gen)
    parents = random_tree(gen, B, N)
    expected = path_logits(model, prompts, tokens, parents)

    # Kernel route: the model set to "specdec_tree"; the tree kernel must actually run (once per layer).
    assert uses_attention_interface(model)
    assert use_tree_attention(model) and model.config._attn_implementation == TREE_ATTENTION
    counter = CountCalls(monkeypatch, "tree_attention")
    cache = TreeKVCache(model.config, B, 40)
    with torch.no_grad():
        extend(model, cache, padded, torch.tensor(prompt_lens))
        assert cache.lengths.tolist() == prompt_lens
        calls_before = counter.calls
        got = tree_forward(model, cache, tokens, parents)
    assert counter.calls - calls_before == model.config.num_hidden_layers
    assert cache.lengths.tolist() == prompt_lens  # the tree is not committed
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)

    # Fallback route: the same model under plain SDPA, given the additive 4-D mask.
    model.set_attn_implementation("sdpa")
    cache = TreeKVCache(model.config, B, 40)
    with torch.no_grad():
        extend(model, cache, padded, torch.tensor(prompt_lens))
        calls_before = counter.calls
        fallback = tree_forward(model, cache, tokens, parents)
    assert counter.calls == calls_before
    torch.testing.assert_close(fallback, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("packed", [False, True])
def test_dense_and_packed_masks_and_eager_fallback_agree(packed):
    gen = torch.Generator().manual_seed(5)
    model = make_model("llama", seed=3)
    B, N = 2, 40  # N > 32: two mask words per node
    prompts, padded = random_prompts(gen, [3, 9])
    tokens = torch.randint(0, V, (B, N), generator=gen)
    parents = random_tree(gen, B, N)
    expected = path_logits(model, prompts, tokens, parents)
    use_tree_attention(model)
    cache = TreeKVCache(model.config, B, 64)
    with torch.no_grad():
        extend(model, cache, padded, torch.tensor([3, 9]))
        got = tree_forward(model, cache, tokens, parents, packed=packed)
        # The kernel route can be skipped on request: the 4-D mask through the attention function's SDPA delegate.
        delegated = tree_forward(model, cache, tokens, parents, use_kernel=False)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(delegated, expected, atol=1e-4, rtol=1e-4)
    model.set_attn_implementation("eager")
    cache = TreeKVCache(model.config, B, 64)
    with torch.no_grad():
        extend(model, cache, padded, torch.tensor([3, 9]))
        eager = tree_forward(model, cache, tokens, parents)
    torch.testing.assert_close(eager, expected, atol=1e-4, rtol=1e-4)


def test_bfloat16_tree_forward():
    gen = torch.Generator().manual_seed(11)
    model32 = make_model("qwen2", seed=4)
    model16 = make_model("qwen2", seed=4, dtype=torch.bfloat16)
    B, N = 3, 9
    prompt_lens = [6, 2, 10]
    prompts, padded = random_prompts(gen, prompt_lens)
    tokens = torch.randint(0, V, (B, N), generator=gen)
    parents = random_tree(gen, B, N)
    expected = path_logits(model32, prompts, tokens, parents)  # float32 truth
    low = path_logits(model16, prompts, tokens, parents)  # plain bf16 causal forward of each path
    outs = {}
    for route in ("kernel", "fallback"):
        if route == "kernel":
            use_tree_attention(model16)
        else:
            model16.set_attn_implementation("sdpa")
        cache = TreeKVCache(model16.config, B, 32, dtype=torch.bfloat16)
        assert cache.storage.dtype == torch.bfloat16
        with torch.no_grad():
            extend(model16, cache, padded, torch.tensor(prompt_lens))
            outs[route] = tree_forward(model16, cache, tokens, parents).float()
    ref_err = (low - expected).abs().max().item()
    for route, got in outs.items():
        err = (got - expected).abs().max().item()
        assert err <= 2 * ref_err + 1e-3, (route, err, ref_err)


def test_plain_forwards_are_sdpa_exactly():
    """Without tree metadata the "specdec_tree" implementation is transformers' SDPA: identical logits for a
    prefill and a decoding step with HF's own DynamicCache."""
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, V, (2, 9), generator=gen)
    nxt = torch.randint(0, V, (2, 1), generator=gen)
    results = []
    for impl in ("sdpa", TREE_ATTENTION):
        model = make_model("mistral", seed=1)
        if impl == TREE_ATTENTION:
            assert use_tree_attention(model)
        with torch.no_grad():
            out = model(ids, use_cache=True)
            step = model(nxt, cache=out.cache, use_cache=True)
        results.append((out.logits, step.logits))
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])


def assert_mask_fallback_matches_paths(model, monkeypatch, seed: int, prompt_lens: list[int], N: int) -> None:
    """After a prefill of ``prompt_lens``, one random tree per row through tree_forward without the kernel (never
    called) gives every node the logits of its root-to-node path run alone."""
    gen = torch.Generator().manual_seed(seed)
    B = len(prompt_lens)
    prompts, padded = random_prompts(gen, prompt_lens)
    tokens = torch.randint(0, V, (B, N), generator=gen)
    parents = random_tree(gen, B, N)
    expected = path_logits(model, prompts, tokens, parents)
    counter = CountCalls(monkeypatch, "tree_attention")
    cache = TreeKVCache(model.config, B, 24)
    with torch.no_grad():
        extend(model, cache, padded, torch.tensor(prompt_lens))
        got = tree_forward(model, cache, tokens, parents)
    assert counter.calls == 0
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_model_without_attention_interface_uses_the_mask_fallback(monkeypatch):
    """GPT-Neo computes attention itself (no AttentionInterface): use_tree_attention declines and tree_forward
    hands it the additive 4-D mask; same logits as each path alone."""
    config = transformers.GPTNeoConfig(vocab_size=V, max_position_embeddings=64, hidden_size=64, num_layers=2,
                                       num_heads=4, attention_types=[[["global"], 2]], intermediate_size=128)
    torch.manual_seed(0)
    model = transformers.GPTNeoForCausalLM(config).eval()
    assert not uses_attention_interface(model)
    assert not use_tree_attention(model)
    assert_mask_fallback_matches_paths(model, monkeypatch, seed=8, prompt_lens=[4, 7, 1], N=7)


@pytest.mark.parametrize("head_dim", [16, 32, 48])
def test_head_size_the_kernel_lacks_uses_the_mask_fallback(head_dim, monkeypatch):
    """A Llama whose head size the kernel is not compiled for (here 16 / 32 / 48): use_tree_attention declines,
    so tree verification goes through the 4-D mask (no error, same logits as each path alone)."""
    model = make_model("llama", head_dim=head_dim)
    assert uses_attention_interface(model)
    assert not use_tree_attention(model)
    assert_mask_fallback_matches_paths(model, monkeypatch, seed=9, prompt_lens=[5, 2], N=6)


@pytest.mark.parametrize("use_kernel", [True, False])
def test_chain_without_parents_skips_build_tree_and_matches(use_kernel, monkeypatch):
    """parents=None (a chain: prefill, extend, draft-model steps) gives the same logits as the explicit chain and
    never calls build_tree, whose [B, N, N] paths would cost O(N^2) memory on a long prompt."""
    model = make_model("llama")
    use_tree_attention(model)
    gen = torch.Generator().manual_seed(10)
    B, N = 2, 9
    prompts, padded = random_prompts(gen, [4, 6])
    tokens = torch.randint(0, V, (B, N), generator=gen)
    prefix = torch.tensor([4, 6])
    results = []
    for parents in (ops.chain_parents(B, N), None):
        cache = TreeKVCache(model.config, B, 24)
        with torch.no_grad():
            extend(model, cache, padded, prefix)
            counter = CountCalls(monkeypatch, "build_tree")
            results.append(tree_forward(model, cache, tokens, parents, prefix, use_kernel=use_kernel))
        assert counter.calls == (1 if parents is not None else 0)
    torch.testing.assert_close(results[1], results[0], atol=0, rtol=0)


def test_fallback_mask_matches_reference_definition():
    gen = torch.Generator().manual_seed(3)
    B, N, S = 3, 6, 20
    parents = random_tree(gen, B, N)
    prefix = torch.tensor([0, 5, 14])
    dense = ops.tree_ancestor_mask(parents)
    mask = tree_attention_mask(prefix, ops.tree_ancestor_mask(parents, packed=True), S)
    additive = tree_attention_mask(prefix, dense, S, dtype=torch.float16)
    assert mask.shape == (B, 1, N, S) and mask.dtype == torch.bool
    for b in range(B):
        p = int(prefix[b])
        want = torch.zeros(N, S, dtype=torch.bool)
        want[:, :p] = True
        want[:, p:p + N] = ref.unpack_tree_mask(dense, N)[b]
        assert torch.equal(mask[b, 0], want)
        assert torch.equal(additive[b, 0] == 0, want)
        assert bool((additive[b, 0][~want] == torch.finfo(torch.float16).min).all())


def test_past_key_values_spelling_is_accepted():
    """transformers 5.24 deprecates past_key_values in favour of cache; a forward with either spelling fills our
    cache the same way (tree_forward itself uses the model's own spelling)."""
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, V, (1, 6), generator=gen)
    model = make_model("llama")
    caches = []
    for kw in ("cache", "past_key_values"):
        cache = TreeKVCache(model.config, 1, 16)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model(ids, use_cache=True, **{kw: cache})
        caches.append(cache)
    assert caches[0].lengths.tolist() == caches[1].lengths.tolist() == [6]
    assert torch.equal(caches[0].storage, caches[1].storage)


# ---------------------------------------------------------------------------------------------------------------
# Bad input.


def test_tree_that_does_not_fit_names_the_argument():
    model = make_model("llama")
    use_tree_attention(model)
    cache = TreeKVCache(model.config, 2, 16)
    tokens = torch.zeros(2, 5, dtype=torch.int64)
    parents = ops.chain_parents(2, 5)
    with pytest.raises(ValueError, match=r"prefix_lens\[1\] = 12 .*max_len = 16"):
        tree_forward(model, cache, tokens, parents, torch.tensor([3, 12]))
    with pytest.raises(ValueError, match=r"prefix_lens\[0\] = -1"):
        tree_forward(model, cache, tokens, parents, torch.tensor([-1, 0]))
    with pytest.raises(ValueError, match="does not fit"):
        tree_forward(model, cache, torch.zeros(2, 17, dtype=torch.int64), ops.chain_parents(2, 17), 0)


def test_mismatched_batch_sizes_and_shapes():
    model = make_model("qwen2")
    use_tree_attention(model)
    cache = TreeKVCache(model.config, 2, 16)
    tokens = torch.zeros(3, 4, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"batch size 3 .*batch_size = 2"):
        tree_forward(model, cache, tokens, ops.chain_parents(3, 4))
    with pytest.raises(ValueError, match="tokens and parents"):
        tree_forward(model, cache, tokens[:2], ops.chain_parents(2, 5))
    with pytest.raises(ValueError, match=r"prefix_lens must be a number or a \[2\] tensor"):
        tree_forward(model, cache, tokens[:2], ops.chain_parents(2, 4), torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match=r"parents\[1, 2\] = 5"):
        tree_forward(model, cache, tokens[:2], torch.tensor([[-1, 0, 1, 2], [-1, 0, 5, 1]]))
    with pytest.raises(TypeError, match="TreeKVCache"):
        tree_forward(model, transformers.DynamicCache(), tokens[:2], ops.chain_parents(2, 4))
    # An ordinary forward with the wrong batch size is caught by the cache.
    with pytest.raises(ValueError, match=r"batch size or model config"), torch.no_grad():
        model(torch.zeros(3, 2, dtype=torch.int64), cache=cache, use_cache=True)


def test_sliding_window_exceeded_is_refused():
    model = make_model("mistral", sliding_window=8)
    use_tree_attention(model)
    cache = TreeKVCache(model.config, 1, 32)
    with pytest.raises(NotImplementedError, match="sliding window"):
        tree_forward(model, cache, torch.zeros(1, 4, dtype=torch.int64), ops.chain_parents(1, 4), 6)


def test_attention_function_metadata_routes():
    """The registered function on its own: kwargs metadata, the context-variable route (for a model that would drop
    unknown kwargs) and the metadata-free route (transformers' SDPA, bit for bit)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from specdec_ext.models import tree_attention_forward, tree_metadata

    gen = torch.Generator().manual_seed(12)
    model = make_model("llama")
    module = model.model.layers[0].self_attn
    B, H, Hkv, N, S, D = 2, 4, 2, 5, 16, 64
    q = torch.randn(B, H, N, D, generator=gen)
    k = torch.randn(B, Hkv, S, D, generator=gen)
    v = torch.randn(B, Hkv, S, D, generator=gen)
    prefix = torch.tensor([3, 9])
    parents = random_tree(gen, B, N)
    mask = ops.tree_ancestor_mask(parents, packed=True)
    expected = ref.tree_attention(q, k, v, prefix, mask, D ** -0.5).transpose(1, 2)
    out, weights = tree_attention_forward(module, q, k, v, None, scaling=D ** -0.5, specdec_prefix_lens=prefix,
                                          specdec_tree_mask=mask)
    assert weights is None and out.shape == (B, N, H, D)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    with tree_metadata(prefix, mask):
        out_ctx, _ = tree_attention_forward(module, q, k, v, None, scaling=D ** -0.5)
    torch.testing.assert_close(out_ctx, expected, atol=1e-5, rtol=1e-5)
    # No metadata: SDPA with the given mask, exactly.
    dense = tree_attention_mask(prefix, mask, S)
    plain, _ = tree_attention_forward(module, q, k, v, dense, scaling=D ** -0.5)
    assert torch.equal(plain, sdpa_attention_forward(module, q, k, v, dense, scaling=D ** -0.5)[0])
    torch.testing.assert_close(plain, expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="or neither"):
        tree_attention_forward(module, q, k, v, None, specdec_prefix_lens=prefix)
    with pytest.raises(NotImplementedError, match="softcap"):
        tree_attention_forward(module, q, k, v, None, softcap=30.0, specdec_prefix_lens=prefix,
                               specdec_tree_mask=mask)


def test_long_prefill_takes_the_mask_route(monkeypatch):
    """extend() of more than extend_kernel_max_tokens(device) tokens (a long prompt) runs the 4-D mask through SDPA,
    not the tree kernel; logits equal a plain forward's, per row, for prompts of different lengths."""
    from specdec_ext.models.tree_forward import extend_kernel_max_tokens

    gen = torch.Generator().manual_seed(21)
    longest = extend_kernel_max_tokens("cpu")
    model = make_model("qwen3", seed=6, max_position_embeddings=longest + 64)
    use_tree_attention(model)
    lens = [longest + 6, longest - 10]
    prompts, padded = random_prompts(gen, lens)
    counter = CountCalls(monkeypatch, "tree_attention")
    cache = TreeKVCache(model.config, 2, longest + 32)
    with torch.no_grad():
        got = extend(model, cache, padded, torch.tensor(lens))
    assert counter.calls == 0 and cache.lengths.tolist() == lens
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        for b, p in enumerate(prompts):
            torch.testing.assert_close(got[b, : lens[b]], model(p[None]).logits[0], atol=1e-4, rtol=1e-4)
