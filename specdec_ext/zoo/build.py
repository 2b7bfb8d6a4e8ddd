"""``specdec zoo build``: the whole small family from the Python standard library's source — offline, on a CPU,
with the library's own training commands.

Stages (each prints progress; each finished stage is recorded under ``OUT/.build`` so ``--resume`` skips it, and
long stages checkpoint every 100 steps so ``--resume`` also continues inside one)::

    corpus     the standard library's .py files, ~2% held out by path hash     (corpus.py)
    tokenizer  byte-level BPE on the training files                            (tokenizer.py)
    target     a Llama LM pre-trained on the token stream, rounded to bf16     (train_target below)
    target_long  (specs with target_long_steps) the target continued on long windows
    draft      a small Llama distilled from the target (KL on its logits)      (train/draft_lm.py)
    parallel_draft  the draft's first layer(s) adapted to draft K tokens in one forward on the target's own
               text (train_parallel_draft below: self_distill, then train/draft_lm.py with parallel=K)
    medusa     Medusa-1 heads sharing the target's lm_head                     (train/medusa.py)
    eagle1     EAGLE-1 draft (feature regression + token KL)                   (train/eagle.py)
    eagle3     EAGLE-3 draft, fused features, training-time test, draft vocab  (train/eagle.py)
    evaluate   the saved family reloaded from disk: greedy identity and accepted lengths on held-out files
    card       card.json + README.md (data, sizes, training time, losses, accepted lengths, test floors)

Drafters train against the target *as shipped* (reloaded from its bf16 files), so what they learnt is what runs.
"""

from __future__ import annotations

import copy
import datetime
import json
import os
import platform
import sys
import time

import torch
import torch.nn.functional as F

from specdec_ext.drafters.shapes import CPU_SHAPES
from specdec_ext.hardware import cpu_model
from specdec_ext.models.safe_files import read_json
from specdec_ext.zoo.corpus import python_sources, read_sources, split_sources, stdlib_dir
from specdec_ext.zoo.spec import ZooSpec

__all__ = ["build_zoo", "reevaluate_family", "target_config", "new_target", "train_target", "train_parallel_draft",
           "FLOOR_RATIO"]

FLOOR_RATIO = 0.85  # test floor = 85% of the accepted length measured at build time


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def target_config(spec: ZooSpec, tokenizer):
    from transformers import LlamaConfig, MiniMaxConfig, Qwen2Config

    eos = tokenizer.eos_token_id
    common = dict(vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, num_hidden_layers=spec.num_layers,
                  intermediate_size=spec.intermediate_size, num_attention_heads=spec.num_heads,
                  num_key_value_heads=spec.num_kv_heads, max_position_embeddings=spec.max_positions,
                  rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=eos, eos_token_id=eos, pad_token_id=eos,
                  rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta})
    if spec.architecture == "qwen2":
        return Qwen2Config(**common)
    if spec.architecture == "minimax":
        # one expert, always chosen: MiniMax's MoE block is then a dense SwiGLU MLP; block_size is its own
        # (training) forward's Lightning chunk
        return MiniMaxConfig(**common, head_dim=spec.hidden_size // spec.num_heads, layer_types=spec.layer_types,
                             num_local_experts=1, num_experts_per_tok=1, block_size=256)
    return LlamaConfig(**common)


def new_target(spec: ZooSpec, tokenizer):
    """An untrained target of ``spec``'s architecture and shape (seeded by ``spec.seed``)."""
    import warnings

    from transformers import AutoModelForCausalLM

    torch.manual_seed(spec.seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_config(target_config(spec, tokenizer))


def train_target(model, stream: list[int], seq_len: int, cfg, spec: ZooSpec):
    """``(model, result)``: ``model`` trained with next-token cross-entropy on ``seq_len``-token windows of the
    stream (the first stage from :func:`new_target`; the long stage continues the first's model)."""
    from specdec_ext.train.data import windows
    from specdec_ext.train.loop import train_loop

    def loss_fn(toks, mask):
        logits = model(input_ids=toks, attention_mask=mask.long()).logits
        y = toks[:, 1:].masked_fill(~mask[:, 1:], -100)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), y.reshape(-1),
                               ignore_index=-100)
        return loss, int(mask[:, 1:].sum())

    signature = {"layers": spec.num_layers, "hidden_size": spec.hidden_size, "vocab_size": spec.vocab_size,
                 "seq_len": seq_len}
    result = train_loop(model, loss_fn, windows(stream, seq_len), cfg, name="target", signature=signature)
    return model.eval(), result


@torch.no_grad()
def heldout_loss(model, seqs: list[list[int]], batch: int = 4) -> float:
    """Mean next-token cross-entropy (nats per token) on ``seqs``."""
    total, n = 0.0, 0
    for i in range(0, len(seqs), batch):
        toks = torch.tensor(seqs[i: i + batch])
        logits = model(input_ids=toks).logits.float()
        total += float(F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), toks[:, 1:].reshape(-1),
                                       reduction="sum"))
        n += toks[:, 1:].numel()
    return total / max(n, 1)


def train_parallel_draft(target, draft_lm, seqs: list[list[int]], spec: ZooSpec, cfg, progress: bool = True):
    """``(model, result, distilled)``: the parallel draft of ``spec``'s recipe: ``draft_lm`` cut to its first
    ``parallel_draft_layers`` layers, trained by ``cfg`` to draft ``parallel_draft_tokens`` tokens in one forward on
    the windows the steps read, their last ``parallel_draft_self_distill`` tokens rewritten by ``target``
    (``distilled`` of them; 0 with self-distillation off: the windows as they are)."""
    from specdec_ext.train.data import self_distill
    from specdec_ext.train.draft_lm import first_layers, train_draft_lm

    if spec.parallel_draft_layers:
        draft_lm = first_layers(draft_lm, spec.parallel_draft_layers)
    data, distilled = seqs, 0
    if spec.parallel_draft_self_distill:
        data = self_distill(target, seqs, prompt_len=spec.drafter_seq_len - spec.parallel_draft_self_distill,
                            new_tokens=spec.parallel_draft_self_distill, seed=spec.seed, progress=progress,
                            max_sequences=cfg.steps * cfg.batch_size)
        distilled = len(data)
    model, result = train_draft_lm(target, data, cfg, model=draft_lm, parallel=spec.parallel_draft_tokens)
    return model, result, distilled


def _params(module) -> int:
    return sum(p.numel() for p in module.parameters())


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def _bf16_copy(module):
    return copy.deepcopy(module).to(torch.bfloat16)


class _Stages:
    """Runs named stages once: a finished stage's record (``OUT/.build/<name>.json``) is reused with resume."""

    def __init__(self, out: str, resume: bool):
        self.dir = os.path.join(out, ".build")
        os.makedirs(self.dir, exist_ok=True)
        self.resume = resume
        self.records: dict[str, dict] = {}
        self.t0 = time.perf_counter()

    def run(self, name: str, fn) -> dict:
        path = os.path.join(self.dir, f"{name}.json")
        if self.resume and os.path.isfile(path):
            self.records[name] = read_json(path, f"zoo build --resume ({name})")
            _log(f"== {name}: done earlier (resume), skipped")
            return self.records[name]
        _log(f"== {name} (build time so far {time.perf_counter() - self.t0:.0f} s)")
        resumed = self.resume and os.path.isdir(os.path.join(self.dir, name))  # a checkpoint of an interrupted run
        w0, c0 = time.perf_counter(), time.process_time()
        record = fn() or {}
        if resumed:
            record["resumed"] = True  # wall / CPU seconds below cover this run only; train_seconds covers all runs
        record["wall_seconds"] = round(time.perf_counter() - w0, 1)
        record["cpu_seconds"] = round(time.process_time() - c0, 1)
        with open(path, "w") as f:
            json.dump(record, f, indent=1)
        self.records[name] = record
        _log(f"== {name}: {record['wall_seconds']} s wall, {record['cpu_seconds']} s CPU")
        return record


def _train_cfg(spec: ZooSpec, out: str, stage: str, steps: int, lr: float, batch: int, warmup: int, progress: bool,
               resume: bool):
    from specdec_ext.train.loop import TrainConfig

    return TrainConfig(steps=steps, lr=lr, batch_size=batch, seed=spec.seed, device="cpu", warmup=warmup,
                       schedule="cosine", weight_decay=0.0, checkpoint_dir=os.path.join(out, ".build", stage),
                       checkpoint_every=100, resume=resume, progress=progress)


def _summary(result) -> dict:
    s = result.summary()
    return {"steps": s["steps"], "first_loss": round(s["first_loss"], 4), "last_loss": round(s["last_loss"], 4),
            "tokens": s["tokens"], "train_seconds": s["seconds"]}


def build_zoo(out: str, spec: ZooSpec, resume: bool = False, progress: bool = True, corpus_root: str | None = None,
              threads: int | None = None, target_only: bool = False) -> dict:
    """Builds the family into ``out``; returns the card (also written to ``out/card.json`` and ``README.md``).

    ``target_only``: the corpus, tokenizer and target stages only, and the training and held-out texts written as a
    user's data (``out/data/train.jsonl``, ``out/data/heldout.jsonl``: one ``{"text": file}`` record per source
    file) for the training commands to read; the card then holds the spec and those stages' records."""
    from transformers import AutoTokenizer, GenerationConfig

    from specdec_ext.models.causal_lm import load_causal_lm
    from specdec_ext.models.checkpoints import save_eagle, save_medusa
    from specdec_ext.models.draft_vocab import draft_vocab_ids, read_draft_vocab, write_draft_vocab
    from specdec_ext.models.early_exit import save_early_exit
    from specdec_ext.train.draft_lm import train_draft_lm
    from specdec_ext.train.eagle import train_eagle
    from specdec_ext.train.early_exit import train_early_exit
    from specdec_ext.train.medusa import train_medusa
    from specdec_ext.zoo.card import write_card
    from specdec_ext.zoo.evaluate import evaluate_drafters, heldout_prompts
    from specdec_ext.zoo.family import load_family
    from specdec_ext.train.data import document_stream, encode_texts, windows
    from specdec_ext.zoo.tokenizer import train_tokenizer

    if threads:
        torch.set_num_threads(threads)
    os.makedirs(out, exist_ok=True)
    stages = _Stages(out, resume)
    root = corpus_root or stdlib_dir()
    files = python_sources(root, spec.max_files)
    train_files, held_files = split_sources(files, spec.corpus_part)
    if not held_files:  # a small corpus (--quick): hold out the last file
        held_files = files[-1:]
        train_files = [f for f in train_files if f not in held_files]
    texts = read_sources(train_files, root)
    held_texts = read_sources(held_files, root)
    tdir = os.path.join(out, "target")

    def corpus():
        return {"root": root, "python": platform.python_version(), "files": len(files),
                "train_files": len(train_files), "heldout_files": held_files,
                "train_chars": sum(map(len, texts))}

    stages.run("corpus", corpus)

    def tokenizer():
        tok = train_tokenizer(texts, spec.vocab_size)
        tok.save_pretrained(tdir)
        return {"vocab_size": len(tok)}

    stages.run("tokenizer", tokenizer)
    tok = AutoTokenizer.from_pretrained(tdir, local_files_only=True)
    # the documents as they are, each followed by EOS, cut into windows below (load_corpus packs text the same way)
    stream = document_stream(encode_texts(tok, texts, add_special_tokens=False), tok.eos_token_id)
    held_stream = document_stream(encode_texts(tok, held_texts, add_special_tokens=False), tok.eos_token_id)
    _log(f"corpus: {len(texts)} training files, {len(stream)} tokens ({sum(map(len, texts)) / len(stream):.2f} "
         f"characters per token); {len(held_texts)} held-out files, {len(held_stream)} tokens")

    def save_target(model):
        bf = _bf16_copy(model)
        bf.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id,
                                                bos_token_id=tok.eos_token_id)
        bf.save_pretrained(tdir)
        tok.save_pretrained(tdir)

    def target():
        cfg = _train_cfg(spec, out, "target", spec.target_steps, spec.target_lr, spec.target_batch,
                         spec.target_warmup, progress, resume)
        model, result = train_target(new_target(spec, tok), stream, spec.target_seq_len, cfg, spec)
        save_target(model)
        return {**_summary(result), "params": _params(model), "train_stream_tokens": len(stream)}

    stages.run("target", target)
    held_long = windows(held_stream, spec.target_long_seq_len)[:16] if spec.target_long_steps else []

    def target_long():
        model = load_causal_lm(tdir, torch.float32)
        before = round(heldout_loss(model, held_long, batch=1), 4) if held_long else None
        cfg = _train_cfg(spec, out, "target_long", spec.target_long_steps, spec.target_long_lr,
                         spec.target_long_batch, max(1, spec.target_long_steps // 10), progress, resume)
        model, result = train_target(model, stream, spec.target_long_seq_len, cfg, spec)
        save_target(model)
        return {**_summary(result), "seq_len": spec.target_long_seq_len, "batch": spec.target_long_batch,
                "heldout_windows": len(held_long), "heldout_loss_before": before}

    if spec.target_long_steps:
        stages.run("target_long", target_long)
    target_model = load_causal_lm(tdir, torch.float32).eval()
    held_seqs = windows(held_stream, spec.target_seq_len)[:64]
    # the held-out losses of the target as saved (after the long stage when there is one)
    stages.records["target"]["heldout_loss"] = round(heldout_loss(target_model, held_seqs), 4) if held_seqs else None
    if held_long:
        stages.records["target_long"]["heldout_loss"] = round(heldout_loss(target_model, held_long, batch=1), 4)
    if target_only:
        return _target_card(out, spec, stages, texts, held_texts)
    seqs = windows(stream, spec.drafter_seq_len)

    def drafter_cfg(stage, steps):
        return _train_cfg(spec, out, stage, steps, spec.drafter_lr, spec.drafter_batch, max(1, steps // 20),
                          progress, resume)

    def draft():
        model, result = train_draft_lm(target_model, seqs, drafter_cfg("draft", spec.draft_steps),
                                       num_layers=spec.draft_layers, hidden_size=spec.draft_hidden)
        ddir = os.path.join(out, "draft")
        _bf16_copy(model).save_pretrained(ddir)
        tok.save_pretrained(ddir)
        return {**_summary(result), "params": _params(model)}

    def parallel_draft():  # PARD's recipe: adapt the trained draft LM rather than train one from scratch
        draft_lm = load_causal_lm(os.path.join(out, "draft"), torch.float32)
        cfg = _train_cfg(spec, out, "parallel_draft", spec.parallel_draft_steps, spec.parallel_draft_lr,
                         spec.drafter_batch, max(1, spec.parallel_draft_steps // 20), progress, resume)
        model, result, distilled = train_parallel_draft(target_model, draft_lm, seqs, spec, cfg, progress)
        pdir = os.path.join(out, "parallel_draft")
        _bf16_copy(model).save_pretrained(pdir)
        tok.save_pretrained(pdir)
        return {**_summary(result), "params": _params(model), "tokens": spec.parallel_draft_tokens,
                "layers": model.config.num_hidden_layers, "self_distilled_windows": distilled}

    def medusa():
        heads, result = train_medusa(target_model, seqs, drafter_cfg("medusa", spec.medusa_steps),
                                     num_heads=spec.medusa_heads, share_lm_head=True,
                                     soft_labels=spec.medusa_soft_labels)
        save_medusa(_bf16_copy(heads), os.path.join(out, "medusa"), base_model_name_or_path="../target",
                    safetensors=True)
        return {**_summary(result), "params": _params(heads)}

    def eagle(version, steps, **kw):
        def run():
            model, result = train_eagle(target_model, seqs, drafter_cfg(f"eagle{version}", steps), version=version,
                                        **kw)
            save_eagle(_bf16_copy(model), os.path.join(out, f"eagle{version}"), base_model_name_or_path="../target",
                       safetensors=True)
            n = sum(p.numel() for k, p in model.named_parameters() if not k.startswith("embed_tokens"))
            return {**_summary(result), "params": n}
        return run

    stages.run("draft", draft)
    stages.run("parallel_draft", parallel_draft)
    stages.run("medusa", medusa)
    stages.run("eagle1", eagle(1, spec.eagle1_steps, ttt_steps=spec.eagle1_ttt_steps))

    def eagle1_vocab():  # the drafts' vocabulary ("draft_vocab": "frequent" in the drafter shapes)
        ids = draft_vocab_ids(seqs, spec.vocab_size, spec.eagle1_vocab).tolist()
        write_draft_vocab(os.path.join(out, "eagle1"), ids)
        return {"ids": len(ids)}

    stages.run("eagle1_vocab", eagle1_vocab)
    stages.run("eagle3", eagle(3, spec.eagle3_steps, draft_vocab=spec.eagle3_vocab))

    def early_exit():  # self-speculation's adapter: attention targets only (a hybrid's state has no early exit)
        cfg = _train_cfg(spec, out, "early_exit", spec.early_exit_steps, spec.early_exit_lr, spec.drafter_batch,
                         max(1, spec.early_exit_steps // 20), progress, resume)
        adapter, result = train_early_exit(target_model, seqs, cfg, exit_layer=spec.early_exit_layer)
        edir = os.path.join(out, "early_exit")
        save_early_exit(adapter, edir, base_model_name_or_path="../target", dtype=torch.bfloat16)
        write_draft_vocab(edir, read_draft_vocab(os.path.join(out, "eagle1"), "zoo build").tolist())
        return {**_summary(result), "params": _params(adapter), "exit_layer": spec.early_exit_layer}

    if not spec.hybrid:
        stages.run("early_exit", early_exit)
    # the card of a previous build must not decide the drafter shapes of this one
    spec_file = os.path.join(out, "card.json")
    with open(spec_file, "w") as f:
        json.dump({"spec": spec.to_dict()}, f)

    def evaluate():
        fam = load_family(out)
        prompts = heldout_prompts(fam.tokenizer, spec.eval_prompts, spec.eval_prompt_len, root)
        return {"prompts": len(prompts), "prompt_tokens": spec.eval_prompt_len,
                "new_tokens": spec.eval_new_tokens,
                "drafters": evaluate_drafters(fam, prompts, spec.eval_new_tokens, rounds=spec.eval_rounds),
                "rounds": spec.eval_rounds,
                "prompt_ids": prompts}  # the tests decode exactly these (held-out files differ across Pythons)

    evaluation = stages.run("evaluate", evaluate)
    members = {m: {"bytes": _dir_bytes(os.path.join(out, m)), "params": stages.records[s].get("params")}
               for m, s in (("target", "target"), ("draft", "draft"), ("parallel_draft", "parallel_draft"),
                            ("medusa", "medusa"), ("eagle1", "eagle1"), ("eagle3", "eagle3"),
                            ("early_exit", "early_exit")) if s in stages.records}
    training = {k: stages.records[k] for k in ("corpus", "tokenizer", "target", "target_long", "draft",
                                                "parallel_draft", "medusa", "eagle1", "eagle3", "early_exit")
                if k in stages.records}
    card = {
        "name": "specdec-zoo-pystdlib" + ("-hybrid" if spec.hybrid else ""),
        "built": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": _machine(),
        "spec": spec.to_dict(),
        "training": training,
        "build_seconds": {"wall": round(sum(r.get("wall_seconds", 0) for r in stages.records.values()), 1),
                          "cpu": round(sum(r.get("cpu_seconds") or 0 for r in stages.records.values()), 1)},
        "members": members,
        "total_bytes": sum(m["bytes"] for m in members.values()),
        "evaluation": evaluation,
        "floors": _floors(evaluation),
    }
    write_card(out, card)
    _log(f"== family written to {out}: {card['total_bytes'] / 1e6:.1f} MB, built in "
         f"{card['build_seconds']['wall'] / 60:.1f} min wall ({card['build_seconds']['cpu'] / 60:.1f} min CPU)")
    return card


def _machine() -> dict:
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version()}


def _write_jsonl_texts(path: str, texts: list[str]) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")


def _target_card(out: str, spec: ZooSpec, stages: _Stages, texts: list[str], held_texts: list[str]) -> dict:
    _write_jsonl_texts(os.path.join(out, "data", "train.jsonl"), texts)
    _write_jsonl_texts(os.path.join(out, "data", "heldout.jsonl"), held_texts)
    card = {
        "name": f"specdec-zoo-target-{spec.architecture}",
        "built": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": _machine(),
        "spec": spec.to_dict(),
        "training": {k: stages.records[k] for k in ("corpus", "tokenizer", "target", "target_long")
                     if k in stages.records},
        "data": {"train": "data/train.jsonl", "heldout": "data/heldout.jsonl"},
    }
    with open(os.path.join(out, "card.json"), "w") as f:
        json.dump(card, f, indent=1)
    _log(f"== target written to {out}/target, its data to {out}/data")
    return card


def _floors(evaluation: dict) -> dict:
    acc = {k: v["mean_accepted_length"] for k, v in evaluation["drafters"].items() if k != "plain"}
    return {"ratio": FLOOR_RATIO, "mean_accepted_length": {k: round(FLOOR_RATIO * v, 2) for k, v in acc.items()}}


def reevaluate_family(out: str, threads: int | None = None, rounds: int = 3) -> dict:
    """Re-measures a built family with the library's current drafter shapes (``CPU_SHAPES``) and code, on the
    card's own prompts, and rewrites ``card.json`` / ``README.md``: the evaluation, the shapes and the tests' floors.
    The weights and the training records are untouched (``specdec zoo evaluate``: after a drafter change that needs
    no retraining). ``rounds``: :func:`~specdec_ext.zoo.evaluate.evaluate_drafters`'s timed rounds."""
    from specdec_ext.zoo.card import write_card
    from specdec_ext.zoo.evaluate import evaluate_drafters
    from specdec_ext.zoo.family import load_family

    if threads is not None:
        torch.set_num_threads(threads)
    card = read_json(os.path.join(out, "card.json"), "reevaluate_family")
    old = card.get("evaluation") or {}
    prompts = old.get("prompt_ids")
    if not prompts:
        raise ValueError(f"reevaluate_family: {out}/card.json has no evaluation.prompt_ids to measure on")
    card["spec"]["drafters"] = copy.deepcopy(CPU_SHAPES)
    with open(os.path.join(out, "card.json"), "w") as f:  # the family loads its drafter shapes from the card
        json.dump(card, f, indent=1)
    fam = load_family(out)
    _log(f"== evaluating {len(prompts)} prompts x {old['new_tokens']} new tokens per drafter")
    card["evaluation"] = {**old, "drafters": evaluate_drafters(fam, prompts, old["new_tokens"], rounds=rounds),
                          "rounds": rounds}
    card["evaluation"]["evaluated"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    card["floors"] = _floors(card["evaluation"])
    write_card(out, card)
    for name, r in card["evaluation"]["drafters"].items():
        if name != "plain":
            _log(f"  {name:12s} mean accepted length {r['mean_accepted_length']:.2f}  "
                 f"greedy identical: {r['greedy_identical']}")
    return card
