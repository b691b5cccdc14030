"""Byte-level BPE tokenizer (digits split one by one); decoding drops PAD, BOS and EOS.

The shipped tokenizers name their specials "<pad>", "<bos>", "<eos>" and always start a prompt with
BOS. An imported one (builder.import_model) says which tokens play those roles, whether a prompt
starts with BOS and its chat template in a small config, `tokenizer_config.json` beside
`tokenizer.json` (`TextTokenizer.config`, keys TOKENIZER_CONFIG_KEYS).
"""
from __future__ import annotations

import functools
import json
from typing import Iterable, Sequence

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
SPECIAL_TOKENS = (PAD, BOS, EOS)
TOKENIZER_CONFIG_KEYS = ("pad_token", "bos_token", "eos_token", "add_bos_token", "chat_template")


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
    """The project's tokenizer: encode without specials, decode with PAD stripped.

    `config` (None for the shipped tokenizers) names the PAD, BOS and EOS tokens, says whether a
    prompt starts with BOS (`add_bos_token`) and holds the chat template, if any.
    """

    def __init__(self, tokenizer: Tokenizer, config: dict | None = None):
        self.tokenizer = tokenizer
        self.config = None if config is None else {k: config.get(k) for k in TOKENIZER_CONFIG_KEYS}
        if config is None:
            self.pad_id = tokenizer.token_to_id(PAD)
            self.bos_id = tokenizer.token_to_id(BOS)
            self.eos_id = tokenizer.token_to_id(EOS)
            self.add_bos, self.chat_template = True, None
        else:
            unknown = sorted(set(config) - set(TOKENIZER_CONFIG_KEYS))
            if unknown:
                raise ValueError(f"tokenizer config: unknown keys {unknown} (known: {list(TOKENIZER_CONFIG_KEYS)})")
            self.pad_id, self.bos_id, self.eos_id = (self._special_id(config, key)
                                                     for key in ("pad_token", "bos_token", "eos_token"))
            self.add_bos = bool(config.get("add_bos_token", True))
            self.chat_template = config.get("chat_template")
        self.vocab_size = tokenizer.get_vocab_size()
        # Byte-level BPE: one character of a token's name per byte, so no token covers more bytes;
        # an added token (a special like "<|im_start|>") covers the UTF-8 bytes of its text.
        added = {token.content for token in tokenizer.get_added_tokens_decoder().values()}
        self.max_token_bytes = max(len(name.encode("utf-8")) if name in added else len(name)
                                   for name in tokenizer.get_vocab())

    def _special_id(self, config: dict, key: str) -> int:
        name = config.get(key)
        token_id = None if name is None else self.tokenizer.token_to_id(name)
        if token_id is None:
            raise ValueError(f"tokenizer config: {key} {name!r} is not a token of this tokenizer")
        return token_id

    @classmethod
    def from_json(cls, json_text: str, config_text: str | None = None) -> "TextTokenizer":
        """`config_text`: the JSON of `tokenizer_config.json`, None where there is none (shipped)."""
        return cls(Tokenizer.from_str(json_text), None if config_text is None else json.loads(config_text))

    def to_json(self) -> str:
        return self.tokenizer.to_str()

    def config_json(self) -> str | None:
        """What `tokenizer_config.json` holds; None for a shipped tokenizer (no such file)."""
        return None if self.config is None else json.dumps(self.config, indent=2, sort_keys=True) + "\n"

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text of `messages` ([{"role", "content"}]) under the chat template, rendered as
        transformers' apply_chat_template renders it (sandboxed Jinja, trim_blocks, lstrip_blocks)."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        name = self.tokenizer.id_to_token
        return self._compiled_chat_template.render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=name(self.bos_id), eos_token=name(self.eos_id))

    def user_turn(self, text: str) -> str:
        """`text` as one user message under the chat template, the assistant's turn opened: the prompt
        of a single-turn chat request."""
        return self.render_chat([{"role": "user", "content": text}])

    @functools.cached_property
    def _compiled_chat_template(self):
        """Compiled once: compiling SmolLM2's template took ~2 ms, most of a chat request's cost at the front."""
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise ValueError(f"chat template: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
        return env.from_string(self.chat_template)

    @functools.cached_property
    def assistant_header(self) -> tuple[int, ...]:
        """The tokens the chat template opens an assistant turn with (its generation prompt); ()
        without a template."""
        if not self.chat_template:
            return ()
        probe = [{"role": "user", "content": "x"}]
        opened, closed = (self.encode(self.render_chat(probe, add)) for add in (True, False))
        return tuple(opened[len(closed):]) if opened[:len(closed)] == closed else ()

    def turn_starts(self, prompt_ids: Sequence[int]) -> list[int]:
        """Where the parts of a conversation's prompt after each assistant header (but the last
        one's, which ends it) begin: the turns `decode.pad_prompt` pairs one by one."""
        header, ids = list(self.assistant_header), list(prompt_ids)
        if not header:
            return []
        return [end for end in range(len(header), len(ids))
                if ids[end - 1] == header[-1] and ids[end - len(header):end] == header]

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_prompt(self, text: str) -> list[int]:
        return [self.bos_id, *self.encode(text)] if self.add_bos else self.encode(text)

    def prompt_length(self, text: str) -> int:
        """Tokens the prompt holds as served (BOS included), the unit of every length limit."""
        return len(self.encode_prompt(text))

    def decode(self, ids: Iterable[int]) -> str:
        specials = (self.pad_id, self.bos_id, self.eos_id)
        return self.tokenizer.decode([i for i in ids if i not in specials], skip_special_tokens=False)
