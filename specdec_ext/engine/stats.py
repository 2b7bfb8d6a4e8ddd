"""What an engine (or a generation) did: :class:`DecodeStats`, counts and host wall times per phase."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["DecodeStats", "reached_fractions"]


def reached_fractions(accept_hist: list[int]) -> list[float]:
    """``[d - 1]``: the fraction of row-steps that accepted at least d drafts, d = 1 .. len - 1, from
    ``accept_hist[k]`` = row-steps that accepted exactly k (all 0.0 for an empty histogram)."""
    total = sum(accept_hist)
    out, running = [], total
    for d in range(1, len(accept_hist)):
        running -= accept_hist[d - 1]
        out.append(running / total if total else 0.0)
    return out


@dataclass
class DecodeStats:
    """What a generation did. A *row-step* is one row taking part in one step (B = 1: a step)."""

    batch_size: int = 1  # rows of the largest batch a step ran
    new_tokens: int = 0  # tokens emitted, all rows
    steps: int = 0  # speculative steps
    target_forwards: int = 0  # target forwards in the decode loop (one per step); the prefill is counted apart
    prefill_forwards: int = 0  # prefill forwards (one per group of joining rows with a prompt of 2+ tokens)
    draft_forwards: int = 0  # draft model forwards (drafters that have a model)
    row_steps: int = 0  # sum over steps of the rows still generating (= rows in the step's batch, when retiring)
    retirements: int = 0  # steps after which finished rows were dropped from the batch
    joins: int = 0  # steps before which requests joined the batch
    accept_hist: list[int] = field(default_factory=list)  # [d] = row-steps that accepted d draft tokens
    drafts: int = 0  # row-steps whose tree held a draft (vLLM's spec_decode_num_drafts)
    draft_tokens: int = 0  # draft nodes proposed over all row-steps, padding excluded (num_draft_tokens)
    prefill_s: float = 0.0
    draft_s: float = 0.0  # drafter.propose + drafter.observe + drafter.retire
    verify_s: float = 0.0  # target forward + verification + cache compaction + the read-back
    bookkeeping_s: float = 0.0  # host work: stop / budget cuts, context update, joins and retirements
    total_s: float = 0.0  # the whole generation (Engine: from creation to the last step)

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per row-step (= tokens per target forward at B = 1): 1 + mean accepted drafts."""
        return self.new_tokens / self.row_steps if self.row_steps else 0.0

    @property
    def accepted_tokens(self) -> int:
        """Draft tokens the verification accepted over all row-steps (vLLM's ``spec_decode_num_accepted_tokens``;
        as there, counted before a stop token, a stop string or the budget cut a row's run, so it equals
        ``new_tokens - row_steps`` only when nothing was cut)."""
        return sum(d * n for d, n in enumerate(self.accept_hist))

    @property
    def accepted_by_position(self) -> list[int]:
        """``[i]``: row-steps that accepted the draft at depth i + 1 (and so every one before it)."""
        return [sum(self.accept_hist[d:]) for d in range(1, len(self.accept_hist))]

    @property
    def acceptance_by_depth(self) -> list[float]:
        """``[d - 1]``: fraction of row-steps that accepted at least d draft tokens, d = 1, 2, ..."""
        return reached_fractions(self.accept_hist)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s > 0 else 0.0

    def summary(self) -> str:
        loop = self.draft_s + self.verify_s + self.bookkeeping_s
        pct = (lambda x: 100.0 * x / loop) if loop > 0 else (lambda x: 0.0)
        return (f"{self.new_tokens} tokens in {self.total_s:.3f} s: {self.tokens_per_s:.1f} tokens/s | mean accepted "
                f"length {self.mean_accepted_length:.2f} | {self.target_forwards} target forwards (+"
                f"{self.prefill_forwards} prefill) | time: draft {pct(self.draft_s):.0f}% verify "
                f"{pct(self.verify_s):.0f}% bookkeeping {pct(self.bookkeeping_s):.0f}% (prefill "
                f"{self.prefill_s:.3f} s)")
