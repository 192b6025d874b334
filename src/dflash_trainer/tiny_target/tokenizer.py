"""Byte-level BPE tokenizer of the tiny target, with chat and DFlash special tokens.

Special tokens (ids 0..3, in this order, so they are stable across rebuilds):
    <|endoftext|>  end of a document; also the padding token
    <|im_start|>   start of a chat turn (ChatML), followed by the role and a newline
    <|im_end|>     end of a chat turn; generation stops here in chat mode
    <|MASK|>       the DFlash mask token that fills draft-block slots 1..B-1
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

END_OF_TEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
MASK = "<|MASK|>"
SPECIAL_TOKENS = [END_OF_TEXT, IM_START, IM_END, MASK]

# ChatML, the format of Qwen's instruct models. `add_generation_prompt` opens an assistant turn.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE on ``texts``; the 256 byte symbols are always in the vocabulary."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def wrap_for_transformers(tok: Tokenizer) -> PreTrainedTokenizerFast:
    """A ``transformers`` fast tokenizer that ``AutoTokenizer.from_pretrained`` reloads as is."""
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=END_OF_TEXT,
        pad_token=END_OF_TEXT,
        mask_token=MASK,
        additional_special_tokens=[IM_START, IM_END],
        clean_up_tokenization_spaces=False,
        model_max_length=2048,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast
