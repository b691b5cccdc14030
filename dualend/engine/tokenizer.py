"""Byte-level BPE tokenizer (digits split one by one); decoding drops PAD, BOS and EOS."""
from __future__ import annotations

from typing import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
SPECIAL_TOKENS = (PAD, BOS, EOS)


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


class TextTokenizer:
    """The project's tokenizer: encode without specials, decode with PAD stripped."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.pad_id = tokenizer.token_to_id(PAD)
        self.bos_id = tokenizer.token_to_id(BOS)
        self.eos_id = tokenizer.token_to_id(EOS)
        self.vocab_size = tokenizer.get_vocab_size()
        # Byte-level BPE: one character of a token's name per byte, so no token covers more bytes.
        self.max_token_bytes = max(len(name) for name in tokenizer.get_vocab())

    @classmethod
    def from_json(cls, json_text: str) -> "TextTokenizer":
        return cls(Tokenizer.from_str(json_text))

    def to_json(self) -> str:
        return self.tokenizer.to_str()

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_prompt(self, text: str) -> list[int]:
        return [self.bos_id, *self.encode(text)]

    def prompt_length(self, text: str) -> int:
        """Tokens the prompt holds as served (BOS included), the unit of every length limit."""
        return len(self.encode_prompt(text))

    def decode(self, ids: Iterable[int]) -> str:
        specials = (self.pad_id, self.bos_id, self.eos_id)
        return self.tokenizer.decode([i for i in ids if i not in specials], skip_special_tokens=False)
