"""The family's model card: ``card.json`` (machine-readable: the tests read their floors from it) and ``README.md``
(the same facts for people)."""

from __future__ import annotations

import json
import os

__all__ = ["write_card", "render_card"]

_ROLE = {"ngram": "prompt lookup (no model)", "suffix": "suffix decoding (no model)", "draft-model": "draft LM, chain",
         "parallel-draft": "parallel draft LM, chain from one forward",
         "medusa": "Medusa-1 heads",
         "eagle1": "EAGLE-1 draft, chain", "eagle2": "EAGLE-1 draft, EAGLE-2 dynamic tree",
         "eagle3": "EAGLE-3 draft, dynamic tree",
         "early-exit": "the target's first layers + an adapter, chain (self-speculation)"}


def _parallel_draft_what(spec: dict) -> str:
    layers = spec.get("parallel_draft_layers")  # (absent from cards of builds before the recipe had it: all)
    distilled = spec.get("parallel_draft_self_distill")
    return (("the draft LM" if not layers else f"the draft LM's first {layers} layer(s)")
            + f" adapted to draft {spec.get('parallel_draft_tokens')} tokens in one forward (PARD: mask tokens after "
            "the context, a new vocabulary row)"
            + (f", on windows whose last {distilled} tokens the target rewrote" if distilled else ""))


def write_card(out: str, card: dict) -> None:
    with open(os.path.join(out, "card.json"), "w") as f:
        json.dump(card, f, indent=1)
    with open(os.path.join(out, "README.md"), "w") as f:
        f.write(render_card(card))


def render_card(card: dict) -> str:
    spec, tr, ev = card["spec"], card["training"], card["evaluation"]
    corpus = tr["corpus"]
    hybrid = spec.get("architecture") == "minimax"
    kind = ("MiniMax hybrid target (Lightning attention layers beside softmax attention, as MiniCPM-SALA)" if hybrid
            else "Llama-style target")
    lines = [
        f"# {card['name']}: the specdec_ext model family",
        "",
        f"A small {kind} with every kind of drafter the library supports, trained offline on a CPU by "
        "`specdec zoo build` (the library's own training commands) from the Python standard library's source. "
        "It exists so that the demo, the benchmarks and the tests run on real trained models on any machine, "
        "without a download. It writes Python-like code; it is not a useful assistant.",
        "",
        "## Data",
        f"- Corpus: the `.py` files of the Python {corpus['python']} standard library (tests, IDLE, lib2to3, "
        f"site-packages left out): {corpus['train_files']} training files ({corpus['train_chars'] / 1e6:.1f} M "
        f"characters, {tr['target']['train_stream_tokens'] / 1e6:.2f} M tokens); {len(corpus['heldout_files'])} files "
        "held out for evaluation (CRC-32 of the path = 0 mod 50).",
        f"- Tokenizer: byte-level BPE, {tr['tokenizer']['vocab_size']} ids, `<|endoftext|>` (id 0) ends each file "
        "and is EOS / padding.",
        "",
        "## Members (bf16 safetensors, official layouts)",
        "",
        "| member | what | parameters | size on disk | training steps | loss first -> last |",
        "|---|---|---:|---:|---:|---|",
    ]
    what = {
        "target": (f"MiniMax, {spec['num_layers']} layers: softmax attention every {spec['attention_every']} "
                   f"layers from layer 0, Lightning attention in the others" if hybrid else
                   f"Llama, {spec['num_layers']} layers")
                  + f", hidden {spec['hidden_size']}, {spec['num_heads']} heads "
                  f"({spec['num_kv_heads']} KV), SwiGLU {spec['intermediate_size']}"
                  + (" (one MoE expert)" if hybrid else "") + f", tied embeddings, {spec['max_positions']} positions",
        "draft": f"Llama draft LM, {spec['draft_layers']} layers, hidden {spec['draft_hidden']}, KL-distilled",
        "parallel_draft": _parallel_draft_what(spec),
        "medusa": f"Medusa-1, {spec['medusa_heads']} heads (1 ResBlock each) sharing the target's lm_head",
        "eagle1": "EAGLE-1: fc + 1 decoder layer; uses the target's embeddings and lm_head"
                  + (f"; drafts over the {spec['eagle1_vocab']} most frequent ids (draft_vocab.json)"
                     if spec.get("eagle1_vocab") else ""),
        "eagle3": f"EAGLE-3: fused features of 3 target layers, training-time test, draft vocabulary "
                  f"{spec['eagle3_vocab']}",
        "early_exit": f"early-exit adapter: 1 decoder layer after {spec.get('early_exit_layer')} target layer(s), "
                      "read by the target's norm and lm_head; drafts over the EAGLE-1 ids",
    }
    for m, info in card["members"].items():
        t = tr[m]
        lines.append(f"| {m} | {what[m]} | {info['params'] / 1e6:.2f} M | {info['bytes'] / 1e6:.1f} MB | "
                     f"{t['steps']} | {t['first_loss']:.3f} -> {t['last_loss']:.3f} |")
    held = tr["target"].get("heldout_loss")
    long = tr.get("target_long") or {}
    held_long = "" if long.get("heldout_loss") is None else (
        f" (on {long['seq_len']}-token windows: {long['heldout_loss_before']:.3f} before the long-context stage, "
        f"{long['heldout_loss']:.3f} after)")
    lines += [
        "",
        f"Total: {card['total_bytes'] / 1e6:.1f} MB. Target held-out loss: "
        f"{'n/a' if held is None else f'{held:.3f} nats/token'}{held_long}. Losses: the target's is next-token "
        "cross-entropy; the draft LM's is KL to the target; Medusa's the weighted "
        f"{'KL of its heads to the target' if spec.get('medusa_soft_labels') else 'CE of its heads'}; EAGLE's "
        "feature regression + KL (EAGLE-1) or the KL summed over training-time-test steps (EAGLE-3).",
        "",
        "## Training",
        f"Built {card['built']} on {card['machine']['cpu']} ({card['machine']['cores']} cores, torch "
        f"{card['machine']['torch']}, {card['machine']['torch_threads']} torch thread(s) in the last run): "
        f"{card['build_seconds']['wall'] / 60:.1f} min wall-clock, {card['build_seconds']['cpu'] / 60:.1f} min "
        "of CPU time (all threads). Per stage:",
        "",
        "| stage | wall s | CPU s | training s (all runs) | note |",
        "|---|---:|---:|---:|---|",
    ]
    for k, r in tr.items():
        note = "resumed after an interruption: wall / CPU cover the last run" if r.get("resumed") else ""
        cpu = "not recorded" if r.get("cpu_seconds") is None else r["cpu_seconds"]
        lines.append(f"| {k} | {r['wall_seconds']} | {cpu} | {r.get('train_seconds', '')} | {note} |")
    for note in card.get("notes", []):
        lines += ["", note]
    build = "specdec zoo build --out my_family" + (" --spec hybrid" if hybrid else "")
    lines += ["", "Rebuild (no download; about the same time on 2 cores):", "", "```",
              f"{build}      # then: specdec demo --family my_family", "```", "",
              "## Measured acceptance (greedy, batch 1)",
              f"{ev['prompts']} prompts of {ev['prompt_tokens']} tokens from the held-out files, {ev['new_tokens']} "
              "new tokens each, decoded by `specdec_ext.generate` from the files above (float32 on the CPU). "
              "Mean accepted length = tokens per target forward. Tokens/s were measured during the build (the "
              "machine may have been busy): `specdec demo` and `specdec bench` measure speed properly.",
              "",
              "| drafter | shape | mean accepted length | test floor | acceptance at depth 1, 2, 3 | greedy identical |",
              "|---|---|---:|---:|---|---|"]
    floors = card["floors"]["mean_accepted_length"]
    for name, r in ev["drafters"].items():
        if name == "plain":
            continue
        shape = ", ".join(f"{k}={v}" for k, v in spec["drafters"][name].items())
        depth = ", ".join(f"{x:.2f}" for x in r["acceptance_by_depth"][:3])
        lines.append(f"| {name} ({_ROLE[name]}) | {shape} | {r['mean_accepted_length']:.2f} | {floors[name]:.2f} | "
                     f"{depth} | {'yes' if r['greedy_identical'] else 'NO'} |")
    lines += ["", f"The floors ({card['floors']['ratio']:.0%} of the measured values) are what "
              "`python_tests/test_zoo_family.py` asserts, so a regression in training or decoding fails loudly.", ""]
    return "\n".join(lines)
