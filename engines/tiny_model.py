"""Small random Llama models, built fully offline, that vLLM (CPU backend) and transformers load.

The recipe that works on vLLM 0.32's CPU backend (docs/architecture.md "Known facts"): random
weights in safetensors, head_dim 64 (the CPU attention kernels need >= 64), a byte-level BPE
tokenizer trained with ``tokenizers`` on a few sentences, and a ChatML-style chat template. Output
is gibberish; latency and caching are real. Two sizes (``MODEL_PRESETS``), each usable as a model
name in configs and on the CLI:

- ``tiny``: hidden 128, 2 layers, 2 heads, 1 KV head. Starts fast; a cold 3,800-token prefill
  takes ~60-75 ms on the 2-core dev VM, so prefix hits barely matter. For tests.
- ``small``: hidden 512, 4 layers, 8 heads, 2 KV heads (~14M parameters). A cold 3,800-token
  prefill takes ~610-670 ms on the same VM and a cached one ~15 ms: the cold/cached ratio that
  makes routing matter, for end-to-end benchmarks.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import TypedDict


class LlamaSizes(TypedDict):
    """A preset's ``LlamaConfig`` sizes."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int


TINY_MODEL = "tiny"  # the model name that means "this tiny model" in configs and the CLI
SMALL_MODEL = "small"
# name: LlamaConfig sizes. NOTE: "tiny" must stay as it is: its cache key has no preset field.
MODEL_PRESETS: dict[str, LlamaSizes] = {
    TINY_MODEL: {
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
    },
    SMALL_MODEL: {
        "hidden_size": 512,
        "intermediate_size": 1536,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
    },
}
TINY_MODEL_VERSION = 1  # bump when the recipe changes; a stale cache is rebuilt
DEFAULT_CACHE_DIR = Path(tempfile.gettempdir()) / "kvroute-models"
SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]
DEFAULT_VOCAB_SIZE = 512
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A KV cache keeps the keys and values of every prompt token for later steps.",
    "Routers place each request where its prefix is already cached.",
    "Prefill reads the prompt; decode writes one token per step.",
    "You are a helpful assistant. Answer briefly and cite your sources.",
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000 and punctuation , . ; : ! ? ( ) [ ] { }",
]


def _train_tokenizer(out: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)


def _write_model(out: Path, preset: str, vocab_size: int, max_position: int, seed: int) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(out)
    config = LlamaConfig(
        vocab_size=vocab_size,
        **MODEL_PRESETS[preset],
        head_dim=64,
        max_position_embeddings=max_position,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
        # NOTE: transformers 5 still takes torch_dtype (as dtype) but types its configs as
        # dataclasses without it; dtype= is not understood by the 4.x that pyproject allows
        torch_dtype="bfloat16",  # type: ignore[call-arg]
    )
    torch.manual_seed(seed)
    # transformers types its ``to`` (functools.wraps of nn.Module.to) as an unbound function
    model = LlamaForCausalLM(config).to(torch.bfloat16)  # type: ignore[arg-type]
    model.save_pretrained(out, safe_serialization=True)
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id})
    )


def build_tiny_model(
    path: str | os.PathLike[str] | None = None,
    *,
    preset: str = TINY_MODEL,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    max_position: int = 8192,
    seed: int = 0,
) -> Path:
    """Build (once) a random Llama model directory of ``preset``'s size and return its path.

    Idempotent: a directory already holding a complete build of this recipe and these arguments
    is returned as is. The build writes into a temporary sibling and renames it into place, so
    concurrent callers (test workers, replicas) never see a half-written model.
    """
    if preset not in MODEL_PRESETS:
        raise ValueError(f"preset must be one of {', '.join(MODEL_PRESETS)}, got {preset!r}")
    if vocab_size < 300:
        raise ValueError(f"vocab_size must be >= 300 (256 bytes + merges), got {vocab_size}")
    if max_position < 256:
        raise ValueError(f"max_position must be >= 256, got {max_position}")
    key: dict[str, object] = {
        "version": TINY_MODEL_VERSION,
        "vocab": vocab_size,
        "pos": max_position,
        "seed": seed,
    }
    if preset != TINY_MODEL:
        key["preset"] = preset
    target = (
        Path(path)
        if path is not None
        else DEFAULT_CACHE_DIR
        / (f"{preset}-llama-v{TINY_MODEL_VERSION}-{vocab_size}-{max_position}-{seed}")
    )
    stamp = target / "kvroute-tiny.json"
    if stamp.is_file() and json.loads(stamp.read_text()) == key:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    _train_tokenizer(tmp, vocab_size)
    _write_model(tmp, preset, vocab_size, max_position, seed)
    (tmp / "kvroute-tiny.json").write_text(json.dumps(key))
    if stamp.is_file() and json.loads(stamp.read_text()) == key:  # another builder won
        _rmtree(tmp)
        return target
    if target.exists():
        _rmtree(target)
    try:
        os.replace(tmp, target)
    except OSError:  # raced with another builder that just renamed into place
        _rmtree(tmp)
        if not (stamp.is_file() and json.loads(stamp.read_text()) == key):
            raise
    return target


def resolve_model(model: str) -> str:
    """``model`` as a path vLLM loads: a preset name (``"tiny"``, ``"small"``) builds (once) and
    names that model; anything else is returned as is."""
    return str(build_tiny_model(preset=model)) if model in MODEL_PRESETS else model


def _rmtree(p: Path) -> None:
    import shutil

    shutil.rmtree(p, ignore_errors=True)


if __name__ == "__main__":
    import sys

    print(build_tiny_model(preset=sys.argv[1] if len(sys.argv) > 1 else TINY_MODEL))
