"""A byte-level BPE tokenizer trained on the corpus (Hugging Face ``tokenizers``, saved as a
``PreTrainedTokenizerFast`` so ``AutoTokenizer.from_pretrained`` loads it with the models).

Byte-level: every string encodes (no unknown token) and decodes back exactly. One special token, ``<|endoftext|>``
(id 0), ends each document and serves as EOS and padding.
"""

from __future__ import annotations

__all__ = ["EOS_TOKEN", "train_tokenizer"]

EOS_TOKEN = "<|endoftext|>"


def train_tokenizer(texts: list[str], vocab_size: int, min_frequency: int = 2):
    """A byte-level BPE ``PreTrainedTokenizerFast`` with ``vocab_size`` ids (256 bytes + EOS + merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 258:
        raise ValueError(f"vocab_size must be >= 258 (256 bytes, EOS and one merge), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[EOS_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN,
                                   bos_token=EOS_TOKEN, model_max_length=1 << 30)
