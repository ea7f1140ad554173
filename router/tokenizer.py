"""Tokenization at the ingress, done once per request: the served model's HF tokenizer and chat
template. The token ids go to the engine as they are, and the block hashes are computed from
them, so the router and the engine agree on every block."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any


class PromptTokenizer:
    def __init__(self, path: str | Path) -> None:
        from transformers import AutoTokenizer

        self.path = str(path)
        # NOTE: Any: transformers types apply_chat_template and decode as unions of every shape
        # their flags can ask for (tokenize=, return_dict=, a batch), without overloads; the
        # results are typed where they are read, below.
        self._tok: Any = AutoTokenizer.from_pretrained(self.path, local_files_only=True)
        if getattr(self._tok, "chat_template", None) is None:
            raise ValueError(f"tokenizer at {self.path} has no chat template")
        self.eos_token_id: int | None = self._tok.eos_token_id
        # Token-id prompts are valid up to the model's embedding size, which can exceed the
        # tokenizer's own vocabulary (padded embeddings, or a BPE that learned fewer merges).
        config = Path(self.path) / "config.json"
        model_vocab = json.loads(config.read_text()).get("vocab_size", 0) if config.is_file() else 0
        self._vocab_size = max(len(self._tok), int(model_vocab or 0))
        # NOTE: a fast tokenizer's Rust backend encodes the rendered chat as transformers' own
        # call does (the same added and special tokens, split_special_tokens being a backend
        # setting), ~0.1 ms sooner per 1k-token chat; transformers' call differs only where the
        # backend carries a truncation or padding of its own, which that call switches off.
        # ``encode_batch_fast`` gives the same ids without character offsets (nobody here reads
        # them): 420 -> 288 us of CPU per 1k-token chat, and it releases the GIL while it runs.
        backend = getattr(self._tok, "backend_tokenizer", None)
        plain = backend is not None and backend.truncation is None and backend.padding is None
        self._backend = backend if plain else None

    def chat(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        """Apply the chat template with the generation prompt and tokenize, as vLLM does for a
        chat: render the template to text, then encode it without adding special tokens."""
        return self._template_ids(messages, True)

    def _template_ids(
        self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool
    ) -> list[int]:
        if self._backend is None:
            out = self._tok.apply_chat_template(
                list(messages), add_generation_prompt=add_generation_prompt, tokenize=True
            )
            ids = out["input_ids"] if not isinstance(out, list) else out
            return [int(t) for t in ids]
        text: str = self._tok.apply_chat_template(
            list(messages), add_generation_prompt=add_generation_prompt, tokenize=False
        )
        return self._encode_fast(text, add_special_tokens=False)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """``text`` as token ids; ``add_special_tokens``: with the ones the tokenizer adds to a
        prompt (a BOS for Llama's), as vLLM does for a completions prompt by default."""
        if self._backend is not None:
            return self._encode_fast(text, add_special_tokens)
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens)
        return [int(t) for t in ids]

    def _encode_fast(self, text: str, add_special_tokens: bool) -> list[int]:
        assert self._backend is not None
        (encoding,) = self._backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)
        ids: list[int] = encoding.ids
        return ids

    def longest_token_chars(self) -> int | None:
        """The most characters of text one token covers, where a text's every character is in
        some token (a byte-level BPE with no normalizer: ``len(text) / this`` bounds its tokens
        from below); None for other tokenizers (a normalizer or pre-tokenizer may drop text)."""
        b = self._backend
        if b is None or b.normalizer is not None or "ByteLevel" not in repr(b.pre_tokenizer):
            return None
        # a byte-level token's string has one character per byte it covers; an added token's
        # is the text it matches
        return max(map(len, self._tok.get_vocab()))

    def message_tokens(self, roles: Sequence[str]) -> int:
        """The fewest tokens the chat template adds for one more (empty) message of any of
        ``roles``; 0 when a role adds none or the template refuses such a chat."""
        least = None
        for role in roles:
            msg = {"role": role, "content": ""}
            try:
                one, two = (len(self._template_ids([msg] * k, False)) for k in (1, 2))
            except Exception:  # a template may refuse any shape: no bound then
                return 0
            least = two - one if least is None else min(least, two - one)
        return max(least or 0, 0)

    def decode(self, token_ids: Sequence[int]) -> str:
        text: str = self._tok.decode(list(token_ids), skip_special_tokens=True)
        return text

    @property
    def vocab_size(self) -> int:
        """Token ids below this are valid prompt tokens for the served model."""
        return self._vocab_size


class IncrementalDetokenizer:
    """Streams text deltas for engines that return token ids only (the sim engine): decodes the
    whole sequence and emits what is new, holding back a trailing replacement character (an
    incomplete UTF-8 sequence across token boundaries)."""

    def __init__(self, tokenizer: PromptTokenizer) -> None:
        self._tok = tokenizer
        self._ids: list[int] = []
        self._sent = 0

    def push(self, token_ids: Sequence[int], final: bool = False) -> str:
        self._ids.extend(token_ids)
        text = self._tok.decode(self._ids)
        end = len(text) if final or not text.endswith("\ufffd") else len(text) - 1
        delta = text[self._sent : end]
        self._sent = max(self._sent, end)
        return delta
