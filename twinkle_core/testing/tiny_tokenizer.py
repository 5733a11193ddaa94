"""The tiny models' tokenizer: a byte-level BPE trained on the corpus, saved as a Hugging Face tokenizer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from twinkle_core.testing.tiny_architectures import TINY_MAX_MODEL_LEN, check_arch
from twinkle_core.testing.tiny_corpus import PROSE, TINY_CHAT_TEMPLATE, tiny_corpus

if TYPE_CHECKING:  # pragma: no cover - typing only
    from tokenizers import Tokenizer

__all__ = ["QWEN_TOKENIZER_ARCHS", "TINY_SPECIAL_TOKENS", "VOCAB_SIZE", "save_tiny_tokenizer", "train_tiny_tokenizer"]

#: ``<|endoftext|>`` (id 0, padding), ``<|im_start|>`` (id 1), ``<|im_end|>`` (id 2, end of turn).
TINY_SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

#: The BPE vocabulary the trainer aims for, special tokens included.
VOCAB_SIZE = 768

#: Architectures whose tokenizer copies ``transformers``' ``Qwen2Tokenizer`` pipeline
#: (``AutoTokenizer`` maps Qwen3.5's text model to a tokenizer of that pipeline too).
QWEN_TOKENIZER_ARCHS = frozenset({"qwen2", "qwen3_5", "qwen3_5_moe", "qwen3_next"})


def train_tiny_tokenizer(arch: str = "llama") -> Tokenizer:
    """Train the byte-level BPE tokenizer of a tiny model.

    The ``llama`` variant uses the GPT-2 style byte-level pipeline (no
    normaliser, so every string round-trips exactly). The ``qwen2`` and
    ``qwen3_5`` variants copy the pipeline (NFC normaliser, split regex, byte-level decoder) from
    ``transformers``' own ``Qwen2Tokenizer``, because ``AutoTokenizer``
    rebuilds any ``qwen2`` tokenizer around that pipeline and would otherwise
    encode differently from the trained one.

    Args:
        arch: one of :data:`TINY_ARCHS`.

    Returns:
        A ``tokenizers.Tokenizer`` with :data:`TINY_SPECIAL_TOKENS` at ids 0, 1, 2.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    check_arch(arch)
    tokenizer = Tokenizer(models.BPE(unk_token=None, byte_fallback=False, fuse_unk=False))
    if arch in QWEN_TOKENIZER_ARCHS:
        from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

        reference: Any = Qwen2Tokenizer()._tokenizer
        tokenizer.normalizer = reference.normalizer
        tokenizer.pre_tokenizer = reference.pre_tokenizer
        tokenizer.decoder = reference.decoder
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(TINY_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(tiny_corpus() + PROSE, trainer=trainer)
    for index, token in enumerate(TINY_SPECIAL_TOKENS):
        if tokenizer.token_to_id(token) != index:  # pragma: no cover - tokenizers contract
            raise RuntimeError(f"special token {token!r} did not get id {index}")
    return tokenizer


def save_tiny_tokenizer(tokenizer: Tokenizer, arch: str, folder: Path) -> None:
    """Save a trained tokenizer as a Hugging Face tokenizer folder.

    Args:
        tokenizer: the trained tokenizer.
        arch: one of :data:`TINY_ARCHS` (selects ``tokenizer_class``).
        folder: where to write ``tokenizer.json`` and ``tokenizer_config.json``.
    """
    from transformers import PreTrainedTokenizerFast

    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=TINY_MAX_MODEL_LEN,
        padding_side="left",
    )
    wrapped.save_pretrained(str(folder))
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config.update(
        {
            "tokenizer_class": "Qwen2Tokenizer" if arch in QWEN_TOKENIZER_ARCHS else "PreTrainedTokenizerFast",
            "bos_token": None,
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "unk_token": None,
            "add_bos_token": False,
            "add_eos_token": False,
            "add_prefix_space": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": TINY_MAX_MODEL_LEN,
            "chat_template": TINY_CHAT_TEMPLATE,
        }
    )
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    # Keep the template in one place (tokenizer_config.json), not also in a side file.
    (folder / "chat_template.jinja").unlink(missing_ok=True)
