"""The models a benchmark runs on, behind one small interface (:class:`BenchModels`).

* :func:`from_zoo`: the project's model family (``specdec_ext.zoo.load_family``), the default;
* :func:`from_dirs`: a local Hugging Face target and, optionally, a draft LM / Medusa heads / EAGLE drafts;
* :func:`tiny_random`: randomly initialised tiny Llama models (CI, tests, ``--tiny``): timings and acceptance
  from these mean nothing; they exercise the whole suite in seconds.

Prompts come from held-out text (the zoo's held-out Python files, a user's ``--prompts-file``, or, as a last
resort, this package's own source files) through the target's tokenizer; without a tokenizer (tiny random models)
they are synthetic token sequences with repeated phrases.
"""

from __future__ import annotations

import copy
import glob
import os
import random
from dataclasses import dataclass, field
from typing import Callable

import torch

from specdec_ext.drafters import DraftModelDrafter
from specdec_ext.models.config import text_config

__all__ = ["BenchModels", "RANDOM_SIZES", "from_dirs", "from_zoo", "num_params", "random_llama", "tiny_random"]

DEFAULT_DRAFT_TOKENS = 4


def num_params(model) -> int:
    return sum(p.numel() for p in model.parameters()) if model is not None else 0


QUANT_SUFFIXES = {"-int8": "int8", "-int4": "int4"}  # e2e method suffix -> draft_quant
NETWORKLESS_DRAFTERS = ("ngram", "suffix")
# The target on int8 (int4) weights drafting for itself (DraftModelDrafter.from_target), chains of this many tokens:
# on the family 3 / 4 / 6 draft tokens gave 1.56 / 1.68 / 1.78x plain in int8 (4 prompts, 64 new tokens, one run).
SELF_QUANT = {"self-int8": "int8", "self-int4": "int4"}
SELF_QUANT_DRAFT_TOKENS = 6


@dataclass
class BenchModels:
    """``target`` (HF causal LM), ``tokenizer`` (or None), ``draft_lm`` (HF causal LM or None: no HF assisted
    baseline), ``drafter_names`` (our drafters besides plain decoding), ``make_drafter(name)`` (a fresh drafter),
    ``texts`` (held-out texts for prompts, or None: synthetic prompts) and ``info`` (recorded in the results)."""

    name: str
    target: torch.nn.Module
    tokenizer: object
    draft_lm: torch.nn.Module | None
    drafter_names: list[str]
    make_drafter: Callable[[str], object]
    texts: list[str] | None = None
    text_source: str = "synthetic"
    info: dict = field(default_factory=dict)

    @property
    def device(self) -> torch.device:
        return next(p for p in self.target.parameters() if p.is_floating_point()).device

    def quantized_methods(self) -> list[str]:
        """``<drafter>-int8`` / ``-int4`` for each drafter with a network (its weights quantised:
        ``draft_quant``), and ``self-int8`` / ``self-int4`` (the target on quantised weights as its own draft
        model)."""
        return [n + suffix for suffix in QUANT_SUFFIXES for n in self.drafter_names
                if n not in NETWORKLESS_DRAFTERS] + list(SELF_QUANT)

    def build_drafter(self, method: str):
        """A fresh drafter for an e2e method: a drafter name, or one of :meth:`quantized_methods`."""
        if method in SELF_QUANT:
            return DraftModelDrafter.from_target(self.target, SELF_QUANT[method],
                                                 num_draft_tokens=SELF_QUANT_DRAFT_TOKENS)
        if method in self.quantized_methods():
            name, suffix = method[:-5], method[-5:]
            return self.make_drafter(name, draft_quant=QUANT_SUFFIXES[suffix])
        return self.make_drafter(method)

    @property
    def vocab_size(self) -> int:
        return int(text_config(self.target.config).vocab_size)

    @property
    def max_positions(self) -> int | None:
        limit = getattr(text_config(self.target.config), "max_position_embeddings", None)
        return int(limit) if limit else None

    def describe(self) -> dict:
        cfg = text_config(self.target.config)
        out = {"name": self.name, "target_params": num_params(self.target),
               "target_layers": getattr(cfg, "num_hidden_layers", None),
               "target_hidden_size": getattr(cfg, "hidden_size", None), "vocab_size": self.vocab_size,
               "max_position_embeddings": self.max_positions,
               "dtype": str(next(self.target.parameters()).dtype).replace("torch.", ""), "device": str(self.device),
               "draft_lm_params": num_params(self.draft_lm) if self.draft_lm is not None else None,
               "drafters": list(self.drafter_names), "prompt_source": self.text_source}
        out.update(self.info)
        return out

    # ---- prompts ----------------------------------------------------------------------------------------------
    def token_stream(self) -> list[list[int]]:
        """Held-out documents as token lists (cached)."""
        if getattr(self, "_docs", None) is None:
            if self.texts and self.tokenizer is not None:
                docs = []
                for t in self.texts:
                    ids = self.tokenizer(t, add_special_tokens=False)["input_ids"]
                    if ids:
                        docs.append(list(ids))
                self._docs = docs
            else:
                self._docs = []
        return self._docs

    def prompts(self, n: int, length: int, seed: int = 0) -> tuple[list[list[int]], str]:
        """``n`` prompts of exactly ``length`` tokens and a note on how they were made.

        From held-out text: a window from the middle of each document that is long enough (different documents
        for different prompts); when fewer than ``n`` documents are long enough, windows are cut from the
        documents joined end to end (evenly spaced, non-overlapping while the text lasts)."""
        if n < 1 or length < 1:
            raise ValueError(f"prompts: n and length must be >= 1, got {n}, {length}")
        docs = self.token_stream()
        if docs:
            long_docs = [d for d in docs if len(d) >= 2 * length]
            if len(long_docs) >= n:
                rng = random.Random(seed)
                chosen = rng.sample(range(len(long_docs)), n) if seed else list(range(n))
                out = []
                for i in chosen:
                    d = long_docs[i]
                    start = len(d) // 2 - length // 2
                    out.append(d[start: start + length])
                return out, f"{self.text_source}: the middle {length} tokens of {n} held-out documents"
            joined = [t for d in docs for t in d]
            if len(joined) >= length:
                step = max(1, (len(joined) - length) // max(1, n - 1)) if n > 1 else 0
                out = [joined[i * step: i * step + length] for i in range(n)]
                overlap = " (windows overlap: the held-out text is short)" if step < length and n > 1 else ""
                return out, f"{self.text_source}: {n} windows of the joined held-out documents{overlap}"
        return _synthetic_prompts(n, length, self.vocab_size, seed), \
            "synthetic: random phrases of 3-12 tokens repeated at random (no tokenizer or held-out text)"


def _synthetic_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(1000 + seed)
    out = []
    for _ in range(n):
        phrases = [[rng.randrange(vocab) for _ in range(rng.randint(3, 12))] for _ in range(16)]
        p: list[int] = []
        while len(p) < length:
            p.extend(rng.choice(phrases) if rng.random() < 0.7 else [rng.randrange(vocab)])
        out.append(p[:length])
    return out


# ---- held-out text -------------------------------------------------------------------------------------------
def zoo_heldout_texts() -> list[str] | None:
    try:
        try:
            from specdec_ext.zoo import heldout_texts
        except ImportError:
            from specdec_ext.zoo.corpus import heldout_texts
        texts = heldout_texts()
        return list(texts) if texts else None
    except Exception:  # noqa: BLE001  (the zoo is optional for user models)
        return None


def read_prompt_files(path: str) -> list[str]:
    """A text file, or every file below a directory (UTF-8 ones), as texts."""
    files = [path] if os.path.isfile(path) else sorted(
        f for f in glob.glob(os.path.join(path, "**", "*"), recursive=True) if os.path.isfile(f))
    if not files:
        raise FileNotFoundError(f"--prompts-file {path!r}: no such file or non-empty directory")
    texts = []
    for f in files:
        try:
            with open(f, encoding="utf-8") as fh:
                t = fh.read()
        except (UnicodeDecodeError, OSError):
            continue
        if t.strip():
            texts.append(t)
    if not texts:
        raise ValueError(f"--prompts-file {path!r}: no readable UTF-8 text")
    return texts


def _own_sources() -> list[str]:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    texts = []
    for f in sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True)):
        with open(f, encoding="utf-8") as fh:
            texts.append(fh.read())
    return texts


def _texts_for(prompts_file: str | None) -> tuple[list[str] | None, str]:
    if prompts_file:
        return read_prompt_files(prompts_file), f"--prompts-file {prompts_file}"
    texts = zoo_heldout_texts()
    if texts:
        return texts, "zoo held-out Python files (specdec_ext.zoo.heldout_texts)"
    return _own_sources(), "specdec_ext's own Python sources (the zoo's held-out texts were not available)"


# ---- constructors ---------------------------------------------------------------------------------------------
def _pack(*models) -> None:
    from specdec_ext.models.fast_linear import pack_linears

    for m in models:
        if m is not None:
            pack_linears(m)


def from_zoo(path: str | None = None, device: str = "cpu", dtype: str | torch.dtype = torch.float32,
             prompts_file: str | None = None, packed_linears: bool = True,
             eagle_dtype: str | torch.dtype | None = None) -> BenchModels:
    """The project's family (``specdec_ext.zoo.load_family``); raises ``RuntimeError`` with a clear message when the
    zoo or its files are not there. ``packed_linears`` / ``eagle_dtype``: as :func:`load_family`'s."""
    try:
        from specdec_ext.zoo import load_family
    except ImportError:
        try:
            from specdec_ext.zoo.family import load_family
        except ImportError as err:
            raise RuntimeError(f"the model zoo (specdec_ext.zoo) is not available ({err}); pass --model DIR "
                               "(and --draft-model / --medusa / --eagle DIRs) or --tiny") from None
    kwargs = {"device": device, "dtype": dtype, "packed_linears": packed_linears, "eagle_dtype": eagle_dtype}
    try:
        fam = load_family(path, **kwargs) if path else load_family(**kwargs)
    except (FileNotFoundError, OSError) as err:
        raise RuntimeError(f"the model family could not be loaded: {err}") from None
    names = list(getattr(fam, "drafter_names", ("ngram", "draft-model", "medusa", "eagle1", "eagle2", "eagle3")))
    texts, source = _texts_for(prompts_file)
    return BenchModels(name="zoo", target=fam.target, tokenizer=fam.tokenizer, draft_lm=fam.draft_lm,
                       drafter_names=names, make_drafter=fam.make_drafter, texts=texts, text_source=source,
                       info={"family_path": getattr(fam, "path", None),
                             "drafter_settings": {n: _settings(fam, n) for n in names},
                             "eagle_dtype": _dtype_name(getattr(fam, "eagle1", None))})


def _dtype_name(module) -> str | None:
    p = next((q for q in module.parameters() if q.is_floating_point()), None) if module is not None else None
    return None if p is None else str(p.dtype).replace("torch.", "")


def _settings(fam, name):
    get = getattr(fam, "drafter_kwargs", None)
    try:
        return get(name) if callable(get) else None
    except Exception:  # noqa: BLE001
        return None


def from_dirs(model: str, draft_model: str | None = None, medusa: str | None = None, eagle: str | None = None,
              eagle3: str | None = None, tokenizer: str | None = None, device: str = "cpu",
              dtype: str | torch.dtype | None = None, num_draft_tokens: int = DEFAULT_DRAFT_TOKENS,
              prompts_file: str | None = None, ngram: bool = True, packed_linears: bool = True,
              eagle_dtype: str | torch.dtype | None = None) -> BenchModels:
    """User models from local directories. Drafters: n-gram (always, unless ``ngram=False``), ``draft-model``
    (chain of ``num_draft_tokens``), ``medusa`` (``mc_sim_7b_63`` tree), ``eagle`` / ``eagle3`` (EAGLE-2
    dynamic trees with the library defaults). ``packed_linears``: prepare the target and the draft LM with
    :func:`~specdec_ext.models.fast_linear.pack_linears` (every method, ours and Hugging Face's, then multiplies
    with packed weights). ``eagle_dtype``: the EAGLE drafts' dtype
    (:func:`~specdec_ext.models.checkpoints.resolve_eagle_dtype`; default the target's)."""
    from specdec_ext.drafters import DraftModelDrafter, EagleDrafter, MedusaDrafter, NgramDrafter
    from specdec_ext.generate import load_model
    from specdec_ext.models.checkpoints import resolve_eagle_dtype

    for flag, path in (("--model", model), ("--draft-model", draft_model), ("--medusa", medusa),
                       ("--eagle", eagle), ("--eagle3", eagle3), ("--tokenizer", tokenizer)):
        if path is not None and not os.path.isdir(path):
            raise FileNotFoundError(f"{flag} {path!r} is not a directory")
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    target = load_model(model, dtype=dtype, device=device)
    draft_lm = load_model(draft_model, dtype=dtype, device=device) if draft_model else None
    edtype = resolve_eagle_dtype(eagle_dtype, next(p.dtype for p in target.parameters() if p.is_floating_point()),
                                 device)
    if packed_linears:
        _pack(target, draft_lm)
    tok = None
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer or model, local_files_only=True)
    except Exception:  # noqa: BLE001  (no tokenizer: synthetic prompts)
        tok = None
    makers: dict[str, Callable[[], object]] = {}
    if ngram:
        makers["ngram"] = lambda: NgramDrafter(num_pred_tokens=num_draft_tokens)
    if draft_lm is not None:
        makers["draft-model"] = lambda: DraftModelDrafter(draft_lm, num_draft_tokens=num_draft_tokens)
    if medusa:
        makers["medusa"] = lambda: MedusaDrafter.from_pretrained(medusa, target=target, device=device)
    if eagle:
        makers["eagle"] = lambda: EagleDrafter.from_pretrained(eagle, target=target, dtype=edtype)
    if eagle3:
        makers["eagle3"] = lambda: EagleDrafter.from_pretrained(eagle3, target=target, dtype=edtype)

    def make(name: str):
        if name not in makers:
            raise ValueError(f"unknown drafter {name!r}; available: {', '.join(makers)}")
        return makers[name]()

    texts, source = _texts_for(prompts_file) if tok is not None else (None, "synthetic")
    return BenchModels(name=os.path.basename(os.path.normpath(model)), target=target, tokenizer=tok,
                       draft_lm=draft_lm, drafter_names=list(makers), make_drafter=make, texts=texts,
                       text_source=source,
                       info={"model_dir": model, "draft_model_dir": draft_model, "medusa_dir": medusa,
                             "eagle_dir": eagle, "eagle3_dir": eagle3, "num_draft_tokens": num_draft_tokens,
                             "eagle_dtype": str(edtype).replace("torch.", "")})


def tiny_config(vocab_size: int = 256, hidden_size: int = 128, layers: int = 2, max_positions: int = 1024, **kw):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                       num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                       max_position_embeddings=max_positions, bos_token_id=None, eos_token_id=None,
                       pad_token_id=None, **kw)


def tiny_random(seed: int = 0, device: str = "cpu", max_positions: int = 1024,
                num_draft_tokens: int = DEFAULT_DRAFT_TOKENS) -> BenchModels:
    """A random 2-layer Llama target (vocabulary 256) with: a draft LM that is a copy of the target with noise on
    its weights (so drafts are often, not always, accepted), random Medusa heads and a random EAGLE-1 draft.
    Everything runs in seconds; the numbers mean nothing beyond checking the suite."""
    from transformers import LlamaForCausalLM

    from specdec_ext.drafters import DraftModelDrafter, EagleDrafter, MedusaDrafter, MedusaHeads, NgramDrafter
    from specdec_ext.models.eagle import Eagle1Model, EagleConfig

    torch.manual_seed(seed)
    cfg = tiny_config(max_positions=max_positions)
    target = LlamaForCausalLM(cfg).eval()
    draft_lm = copy.deepcopy(target)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in draft_lm.parameters():
            p.add_(0.2 * p.std() * torch.randn(p.shape, generator=g))
    H, V = cfg.hidden_size, cfg.vocab_size
    heads = MedusaHeads(2, H, V).eval()
    ecfg = EagleConfig(hidden_size=H, intermediate_size=2 * H, num_attention_heads=2, num_key_value_heads=1,
                       vocab_size=V, head_dim=64)
    eagle = Eagle1Model(ecfg, fc_bias=True).eval()
    with torch.no_grad():
        for p in list(heads.parameters()) + list(eagle.parameters()):
            p.normal_(0, 0.1)
    target, draft_lm, heads, eagle = (m.to(device) for m in (target, draft_lm, heads, eagle))
    makers = {
        "ngram": lambda: NgramDrafter(num_pred_tokens=num_draft_tokens),
        "draft-model": lambda: DraftModelDrafter(draft_lm, num_draft_tokens=num_draft_tokens),
        "medusa": lambda: MedusaDrafter(heads),
        "eagle2": lambda: EagleDrafter(eagle, depth=4, top_k=4, total_tokens=12),
    }

    def make(name: str):
        if name not in makers:
            raise ValueError(f"unknown drafter {name!r}; available: {', '.join(makers)}")
        return makers[name]()

    return BenchModels(name="tiny-random", target=target, tokenizer=None, draft_lm=draft_lm,
                       drafter_names=list(makers), make_drafter=make,
                       info={"note": "randomly initialised tiny models: numbers exercise the suite, they measure "
                                     "nothing", "num_draft_tokens": num_draft_tokens})


# Random-weight Llama shapes for timing runs (``--random-model``): (target, draft LM) config kwargs.
RANDOM_SIZES = {
    "125m": (dict(vocab_size=32000, hidden_size=768, num_hidden_layers=12, intermediate_size=2048,
                  num_attention_heads=12, num_key_value_heads=4, head_dim=64),
             dict(vocab_size=32000, hidden_size=256, num_hidden_layers=2, intermediate_size=704,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64)),
    "1b": (dict(vocab_size=32000, hidden_size=2048, num_hidden_layers=16, intermediate_size=8192,
                num_attention_heads=32, num_key_value_heads=8, head_dim=64),
           dict(vocab_size=32000, hidden_size=1024, num_hidden_layers=2, intermediate_size=4096,
                num_attention_heads=16, num_key_value_heads=4, head_dim=64)),
}


def random_llama(size: str = "1b", device: str = "cpu", dtype: str | torch.dtype | None = None, seed: int = 0,
                 max_positions: int = 4096, num_draft_tokens: int = DEFAULT_DRAFT_TOKENS,
                 packed_linears: bool = True) -> BenchModels:
    """A random-weight Llama target of ``size`` (``RANDOM_SIZES``: "125m", "1b" ~ 1.1B parameters) with a small
    random draft LM, random Medusa heads (sharing the target's lm_head) and a random EAGLE-1 draft, built directly
    on ``device`` in ``dtype``. **Timing only**: random drafts are (almost) never accepted, so these runs measure
    the cost of a plain step vs a speculative step (draft + tree verification) at a realistic model size, not
    speedups."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from specdec_ext.drafters import DraftModelDrafter, EagleDrafter, MedusaDrafter, MedusaHeads, NgramDrafter
    from specdec_ext.models.eagle import Eagle1Model, EagleConfig

    if size not in RANDOM_SIZES:
        raise ValueError(f"unknown random model size {size!r}; choose from {', '.join(RANDOM_SIZES)}")
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    dtype = dtype or torch.float32
    tkw, dkw = RANDOM_SIZES[size]
    common = dict(max_position_embeddings=max_positions, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            target = LlamaForCausalLM(LlamaConfig(**tkw, **common)).eval()
            draft_lm = LlamaForCausalLM(LlamaConfig(**dkw, **common)).eval()
            H = tkw["hidden_size"]
            heads = MedusaHeads(3, H, None)
            with torch.no_grad():
                for prm in heads.parameters():
                    prm.normal_(0, 0.02)
            eagle = Eagle1Model(EagleConfig(hidden_size=H, intermediate_size=tkw["intermediate_size"],
                                            num_attention_heads=tkw["num_attention_heads"],
                                            num_key_value_heads=tkw["num_key_value_heads"],
                                            vocab_size=tkw["vocab_size"], head_dim=tkw["head_dim"]), fc_bias=True)
            with torch.no_grad():
                for prm in eagle.parameters():
                    prm.normal_(0, 0.02)
    finally:
        torch.set_default_dtype(saved)
    heads, eagle = heads.eval(), eagle.eval()
    if packed_linears:
        _pack(target, draft_lm)
    makers = {
        "ngram": lambda: NgramDrafter(num_pred_tokens=num_draft_tokens),
        "draft-model": lambda: DraftModelDrafter(draft_lm, num_draft_tokens=num_draft_tokens),
        "medusa": lambda: MedusaDrafter(heads),
        "eagle2": lambda: EagleDrafter(eagle),
    }

    def make(name: str):
        if name not in makers:
            raise ValueError(f"unknown drafter {name!r}; available: {', '.join(makers)}")
        return makers[name]()

    return BenchModels(name=f"random-llama-{size}", target=target, tokenizer=None, draft_lm=draft_lm,
                       drafter_names=list(makers), make_drafter=make,
                       info={"note": "random weights: TIMING ONLY (drafts are almost never accepted; speedups and "
                                     "acceptance are meaningless, step costs are real)",
                             "num_draft_tokens": num_draft_tokens})
