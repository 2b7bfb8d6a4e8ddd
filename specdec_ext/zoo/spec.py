"""What the zoo builds: sizes, steps and drafter shapes of the small family (full and ``--quick``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from specdec_ext.zoo.corpus import CORPUS_PARTS

__all__ = ["ZooSpec", "FULL", "QUICK", "TRANSFER", "SPECS", "DRAFTER_NAMES", "DEFAULT_DRAFTERS", "ARCHITECTURES"]

ARCHITECTURES = ("llama", "qwen2")  # the target's Hugging Face class (Qwen2: Llama plus biases on q, k, v)

DRAFTER_NAMES = ("ngram", "suffix", "draft-model", "medusa", "eagle1", "eagle2", "eagle3")

# Drafter shapes for a CPU, from sweeps on the shipped family (1 thread, held-out prompts): on a CPU every
# draft-network forward costs ~1-2 ms of fixed overhead and every verified node real compute (in float32 a 13-node
# tree costs ~1.7 plain steps, in bfloat16 ~1.2), so shallow chains and small trees win: EAGLE chains of 3 beat 4-5
# (1.43x vs 1.36x), static Medusa trees of 8 tie 4 and beat 16. EAGLE-2/3 trees with calibrated scores (EagleDrafter's
# default) reach further than with raw ones: depth 5 / top-k 2 / 8 nodes was the best or within 3% of the best of
# five shapes from 6 to 16 nodes in both dtypes (EAGLE-2 2.03x in bfloat16, 1.41x in float32; 8 prompts x 128
# tokens), where raw scores had made 6 nodes the best. Re-checked after the packed products made verification
# cheaper (2026-11-29, float32, 4 prompts x 2 rounds): EAGLE-2 5/2/8 still the best of seven shapes of 6-16 nodes
# (4/2/6 and 6/2/10 within 2%), Medusa per-step trees of 12 nodes still beat 16 (1.55x vs 1.42x in bfloat16).
# Re-checked 2026-11-30 with leaner EAGLE drafts (benchmarks/python/bench_tree_sizes.py, float32 and bfloat16, 8
# prompts x 128 tokens, each size side by side with plain decoding): EAGLE-2 8 drafts still the best of 4-12 (10
# within 1%); Medusa trees of 10 nodes ahead of 12 in six paired runs (+0-5% float32, +1% bfloat16), 8 within 2%.
# Re-checked 2026-11-30 after the draft layer became one op (draft_decoder_layer: a draft level ~0.45 -> ~0.2 ms),
# which makes deeper drafts pay (8 prompts x 128 tokens, side by side with plain decoding): the EAGLE-1 chain of 6
# 2.21x fp32 / 2.25x bf16 where 3 gave 2.00x / 1.99x (5: 2.17x / 2.19x, 7: 2.17x fp32); EAGLE-2 depth 6 with 8
# drafts 2.33-2.35x fp32 / 2.18x bf16 where depth 5 gave 2.28-2.33x / 2.15x (6/2/10 within 1%, 7/2/10 and 4/2/8
# behind); EAGLE-3 stays at depth 5 (depth 6: 2.06x vs 2.11x, 1.96x vs 2.01x in two fp32 runs). Re-checked
# 2026-11-30 after the draft network became op calls (EagleStepOps), two fp32 runs: EAGLE-2 6/2/8 2.55-2.62x still
# ahead of 7/2/8 (2.48-2.52x), 6/2/10 (2.45-2.52x), 7/2/10 (2.42-2.47x), 8/2/10 and 6/3/10 (2.38-2.50x).
DEFAULT_DRAFTERS = {
    "ngram": {"num_pred_tokens": 6, "max_ngram_size": 3},
    # suffix decoding: SuffixDecoding's shapes (the paper's), as benchmarks/python/bench_suffix.py measured them
    "suffix": {"max_depth": 16, "max_nodes": 17, "spec_factor": 3.0, "min_prob": 0.1},
    "draft-model": {"num_draft_tokens": 4},
    # Medusa's per-step tree (calibrated head probabilities pick 9 of mc_sim_7b_63's choices each step): with aten's
    # products 12 nodes (mean accepted length 2.29, where the best static tree, 8 nodes, reached 1.82) beat 6, 8,
    # 10, 16, 20 and 28; with the packed products, which make each verified node cheaper, 10 nodes lead (above).
    "medusa": {"max_nodes": 10, "dynamic": True},
    # EAGLE-1 drafts over the training data's most frequent ids (FR-Spec; "frequent": the family's
    # eagle1/draft_vocab.json, ZooSpec.eagle1_vocab of them). Over the EAGLE-3 draft's 2048 ids they were 2-4% (bf16)
    # and 4-10% (fp32) faster than over all 4096, with the same accepted lengths; with the draft level one op, 1024
    # ids were another 2% faster (EAGLE-2 2.44x -> 2.50x and 2.37x -> 2.42x in two fp32 runs, mean accepted length
    # 4.38 -> 4.39; 768 ids the same speed, 512 accepted less: 4.34).
    "eagle1": {"depth": 6, "top_k": 1, "total_tokens": 6, "draft_vocab": "frequent"},  # EAGLE-1 network, chain
    "eagle2": {"depth": 6, "top_k": 2, "total_tokens": 8, "draft_vocab": "frequent"},  # EAGLE-2 dynamic tree
    "eagle3": {"depth": 5, "top_k": 2, "total_tokens": 8},  # EAGLE-3 network, dynamic tree
}


@dataclass(frozen=True)
class ZooSpec:
    # tokenizer and target (Llama: RMSNorm, RoPE, SwiGLU, GQA; tied embeddings)
    architecture: str = "llama"
    vocab_size: int = 4096
    hidden_size: int = 384
    num_layers: int = 8
    intermediate_size: int = 1024
    num_heads: int = 6
    num_kv_heads: int = 2
    max_positions: int = 4096
    rope_theta: float = 10000.0
    target_seq_len: int = 512
    target_batch: int = 4
    target_steps: int = 700
    target_lr: float = 2e-3
    target_warmup: int = 60
    # a long-context stage after the first (0 steps: none): the target continued on windows of target_long_seq_len
    # tokens, as many tokens a step as the first stage, so that it holds at the context lengths the sweep measures
    # (the family, trained on 512-token windows only, predicts its own held-out text worse with 4k tokens before it
    # than with 512: top-1 accuracy 0.354 -> 0.309 on the same tokens, 2026-12-02)
    target_long_seq_len: int = 0
    target_long_steps: int = 0
    target_long_lr: float = 3e-4
    # drafters (trained against the frozen, bf16-rounded target)
    drafter_seq_len: int = 256
    drafter_batch: int = 8
    draft_layers: int = 2
    draft_hidden: int = 256
    draft_steps: int = 400
    medusa_heads: int = 4
    medusa_steps: int = 600
    medusa_soft_labels: bool = True  # KL to the target's distributions (mean accepted length 2.21 -> 2.38 vs CE)
    # 2400 steps (3.5 passes over the corpus instead of 1.6) accepted less on the card: chain 2.99 vs 3.18, EAGLE-2
    # tree 4.16 vs 4.23 (2026-11-30)
    eagle1_steps: int = 1200
    eagle1_ttt_steps: int = 3  # training-time test (EAGLE-1 as published: 1); 400 steps of 1 accepted 1-4% less
    eagle3_steps: int = 900  # 300 accepted 8% less (mean accepted length 3.66 vs 3.97 on the benchmark prompts)
    eagle3_vocab: int = 2048
    eagle1_vocab: int = 1024  # the EAGLE-1 drafts' vocabulary: the training chunks' most frequent ids (FR-Spec)
    drafter_lr: float = 2e-3
    # evaluation on held-out files
    eval_prompts: int = 8
    eval_prompt_len: int = 64
    eval_new_tokens: int = 64
    max_files: int | None = None  # corpus files (sorted) to use; None: all
    corpus_part: str = "all"  # CORPUS_PARTS; the held-out files are the same whichever part trains
    seed: int = 0
    drafters: dict = field(default_factory=lambda: {k: dict(v) for k, v in DEFAULT_DRAFTERS.items()})

    def __post_init__(self):
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"ZooSpec.architecture must be one of {ARCHITECTURES}, got {self.architecture!r}")
        if self.corpus_part not in CORPUS_PARTS:
            raise ValueError(f"ZooSpec.corpus_part must be one of {CORPUS_PARTS}, got {self.corpus_part!r}")
        if self.target_long_steps < 0:
            raise ValueError(f"ZooSpec.target_long_steps must be >= 0, got {self.target_long_steps}")
        if self.target_long_steps and not self.target_seq_len < self.target_long_seq_len <= self.max_positions:
            raise ValueError(f"ZooSpec.target_long_seq_len must be above target_seq_len ({self.target_seq_len}) and "
                             f"at most max_positions ({self.max_positions}), got {self.target_long_seq_len}")

    @property
    def target_long_batch(self) -> int:
        """The long stage's batch: as many tokens a step as the first stage's (at least one window)."""
        return max(1, self.target_batch * self.target_seq_len // max(self.target_long_seq_len, 1))

    def to_dict(self) -> dict:
        return asdict(self)


FULL = ZooSpec()
# Seconds, not minutes: for tests and CI (the family is tiny and barely trained).
QUICK = replace(FULL, vocab_size=512, hidden_size=64, num_layers=4, intermediate_size=128, num_heads=2,
                num_kv_heads=1, max_positions=512, target_seq_len=64, target_batch=4, target_steps=40,
                target_warmup=5, drafter_seq_len=64, drafter_batch=4, draft_layers=1, draft_hidden=64,
                draft_steps=15, medusa_heads=3, medusa_steps=15, eagle1_steps=15, eagle3_steps=15, eagle3_vocab=256,
                eagle1_vocab=128,
                eval_prompts=2, eval_prompt_len=16, eval_new_tokens=16, max_files=10,
                drafters={**{k: dict(v) for k, v in DEFAULT_DRAFTERS.items()},
                          "eagle2": {"depth": 3, "top_k": 2, "total_tokens": 6},
                          "eagle3": {"depth": 3, "top_k": 2, "total_tokens": 6}})
# The transfer target (issue: drafter training that transfers): a model unlike the family, for measuring the
# training commands' defaults on a target nothing was tuned on. Qwen2 (q/k/v biases), wider and shallower, GQA 4:1,
# its own tokenizer of another size, RoPE base 1e6 and 8k positions, trained by the same recipe on the other half
# of the corpus, then continued on 4096-token windows (the context sweep's lengths). `specdec zoo build --spec
# transfer --target-only` builds it; only the target's stages run.
TRANSFER = replace(FULL, architecture="qwen2", vocab_size=6144, hidden_size=512, num_layers=6, intermediate_size=1536,
                   num_heads=8, num_kv_heads=2, max_positions=8192, rope_theta=1e6, target_long_seq_len=4096,
                   target_long_steps=60, corpus_part="odd", seed=1)
SPECS = {"family": FULL, "quick": QUICK, "transfer": TRANSFER}
