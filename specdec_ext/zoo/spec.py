"""What the zoo builds: sizes, steps and drafter shapes of the small family (full and ``--quick``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from specdec_ext.drafters.shapes import CPU_SHAPES
from specdec_ext.zoo.corpus import CORPUS_PARTS

__all__ = ["ZooSpec", "FULL", "QUICK", "TRANSFER", "HYBRID", "QUICK_HYBRID", "SPECS", "ARCHITECTURES"]

# the target's Hugging Face class (Qwen2: Llama plus biases on q, k, v; MiniMax: Lightning attention layers beside
# softmax attention ones, the hybrid of MiniCPM-SALA's kind)
ARCHITECTURES = ("llama", "qwen2", "minimax")


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
    # MiniMax only: layer i is softmax attention where i % attention_every == 0, Lightning attention elsewhere
    # (4: three Lightning layers to one softmax layer, as MiniCPM-SALA; layer 0 must be attention, because Hugging
    # Face's own MiniMax decoding, the tests' reference, reads positions from layer 0's cache)
    attention_every: int = 4
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
    # the parallel draft (PARD): the draft LM above cut to its first parallel_draft_layers layers (0: all) and adapted
    # to predict this many tokens in one forward, on windows whose last parallel_draft_self_distill tokens the target
    # rewrote (0: the corpus as it is), as `specdec train-draft --init DRAFT --layers 1 --parallel 8` does by default.
    # (one layer: the forward that is the whole drafting costs half; the target's own text: the tokens past the first
    # are the target's, far easier to guess than the corpus's; README, "Parallel drafts")
    parallel_draft_tokens: int = 8
    parallel_draft_steps: int = 760
    parallel_draft_layers: int = 1
    parallel_draft_self_distill: int = 192
    parallel_draft_lr: float = 1e-3
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
    # the early-exit adapter of self-speculation (specdec train-self-spec): after this many target layers, a copy of
    # the next layer fine-tuned at its own rate (a trained layer needs a smaller step than a draft from scratch)
    early_exit_layer: int = 1
    early_exit_steps: int = 3360
    early_exit_lr: float = 5e-4
    # evaluation on held-out files
    eval_prompts: int = 8
    eval_prompt_len: int = 64
    eval_new_tokens: int = 64
    eval_rounds: int = 3  # timed round-robin; speedups are medians over rounds (evaluate_drafters)
    max_files: int | None = None  # corpus files (sorted) to use; None: all
    corpus_part: str = "all"  # CORPUS_PARTS; the held-out files are the same whichever part trains
    seed: int = 0
    drafters: dict = field(default_factory=lambda: {k: dict(v) for k, v in CPU_SHAPES.items()})

    def __post_init__(self):
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"ZooSpec.architecture must be one of {ARCHITECTURES}, got {self.architecture!r}")
        if self.corpus_part not in CORPUS_PARTS:
            raise ValueError(f"ZooSpec.corpus_part must be one of {CORPUS_PARTS}, got {self.corpus_part!r}")
        if self.hybrid and not 2 <= self.attention_every <= self.num_layers:
            raise ValueError(f"ZooSpec.attention_every must be in [2, num_layers={self.num_layers}] for a MiniMax "
                             f"target (some layers Lightning, some attention), got {self.attention_every}")
        if not 0 <= self.parallel_draft_layers <= self.draft_layers:
            raise ValueError(f"ZooSpec.parallel_draft_layers must be in [0, draft_layers={self.draft_layers}] (0: all "
                             f"the draft LM's layers), got {self.parallel_draft_layers}")
        if not 0 <= self.parallel_draft_self_distill < self.drafter_seq_len:
            raise ValueError(f"ZooSpec.parallel_draft_self_distill must be in [0, drafter_seq_len="
                             f"{self.drafter_seq_len}) (tokens rewritten at each window's end), got "
                             f"{self.parallel_draft_self_distill}")
        if self.target_long_steps < 0:
            raise ValueError(f"ZooSpec.target_long_steps must be >= 0, got {self.target_long_steps}")
        if self.target_long_steps and not self.target_seq_len < self.target_long_seq_len <= self.max_positions:
            raise ValueError(f"ZooSpec.target_long_seq_len must be above target_seq_len ({self.target_seq_len}) and "
                             f"at most max_positions ({self.max_positions}), got {self.target_long_seq_len}")

    @property
    def target_long_batch(self) -> int:
        """The long stage's batch: as many tokens a step as the first stage's (at least one window)."""
        return max(1, self.target_batch * self.target_seq_len // max(self.target_long_seq_len, 1))

    @property
    def layer_types(self) -> list[str] | None:
        """MiniMax's ``config.layer_types`` (None for the attention-only architectures)."""
        if not self.hybrid:
            return None
        return ["full_attention" if i % self.attention_every == 0 else "linear_attention"
                for i in range(self.num_layers)]

    @property
    def hybrid(self) -> bool:
        return self.architecture == "minimax"

    def to_dict(self) -> dict:
        return asdict(self)


FULL = ZooSpec()
# Seconds, not minutes: for tests and CI (the family is tiny and barely trained).
QUICK = replace(FULL, vocab_size=512, hidden_size=64, num_layers=4, intermediate_size=128, num_heads=2,
                num_kv_heads=1, max_positions=512, target_seq_len=64, target_batch=4, target_steps=40,
                target_warmup=5, drafter_seq_len=64, drafter_batch=4, draft_layers=1, draft_hidden=64,
                draft_steps=15, parallel_draft_tokens=4, parallel_draft_steps=15, parallel_draft_self_distill=48,
                medusa_heads=3, medusa_steps=15,
                eagle1_steps=15, eagle3_steps=15, eagle3_vocab=256, eagle1_vocab=128, early_exit_steps=15,
                eval_prompts=2, eval_prompt_len=16, eval_new_tokens=16, eval_rounds=1, max_files=10,
                drafters={**{k: dict(v) for k, v in CPU_SHAPES.items()},
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
# The hybrid member (issue: speculation on hybrid linear-attention targets): the family's sizes and recipe on
# MiniMax's classes, 3 Lightning layers to 1 softmax layer as MiniCPM-SALA, 16k positions (its linear layers make
# long prompts cheap), continued on 4096-token windows; one MLP expert (MiniMax's MoE block with one expert is a
# dense SwiGLU MLP). `specdec zoo build --spec hybrid` builds it with every drafter; `specdec demo --hybrid` runs it.
# Half the family's EAGLE steps (600 / 450): its target's forward, run at every drafter step, costs ~2x the family's on
# a CPU, and the whole build had to fit a 3-hour session on 2 cores (2026-12-03).
HYBRID = replace(FULL, architecture="minimax", max_positions=16384, target_long_seq_len=4096, target_long_steps=60,
                 eagle1_steps=600, eagle3_steps=450)
QUICK_HYBRID = replace(QUICK, architecture="minimax", attention_every=2)
SPECS = {"family": FULL, "quick": QUICK, "transfer": TRANSFER, "hybrid": HYBRID, "quick-hybrid": QUICK_HYBRID}
