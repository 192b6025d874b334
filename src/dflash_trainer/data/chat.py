"""Token ids and a loss mask for one conversation, from the tokenizer's own chat template.

The loss mask is 1 on what the assistant says: its content and the end-of-turn token(s) the template
emits right after it (``<|im_end|>``, ``<|eot_id|>``, ...), so the drafter learns to predict where a
turn stops. It is found without any per-model code, for any template that is *prefix-stable*:

1. For each assistant message ``i``, render ``messages[:i]`` with ``add_generation_prompt=True`` (the
   prompt that ends with the assistant header) and ``messages[:i+1]`` without it. The characters
   between the two renders are what the assistant "generated" in turn ``i``.
2. Trailing whitespace of that span is dropped: it is the separator the template writes *after* the
   end-of-turn token (``"<|im_end|>\\n"``), which a model never generates because decoding stops at
   the end-of-turn token.
3. The full conversation is rendered and tokenized once, with offsets; a token is masked when its
   character span overlaps an assistant span. Tokenizing once (instead of per turn) guarantees the
   ids are exactly those a model sees for the whole text.

A template that rewrites earlier turns when later ones are added (e.g. one that drops old reasoning,
or emits something different for the last message) is not prefix-stable; such conversations raise
``ValueError``, which ``documents.load_documents`` counts as a bad record.
"""

from __future__ import annotations

from jinja2 import TemplateError


def _render(tokenizer, messages: list[dict], add_generation_prompt: bool) -> str:
    """The template's text for ``messages``; any template failure becomes a ``ValueError``."""
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except (TemplateError, TypeError, ValueError) as e:
        raise ValueError(f"chat template failed: {type(e).__name__}: {e}") from e
    if not isinstance(text, str):  # some tokenizer wrappers return a list for batched input
        raise ValueError(f"chat template returned {type(text).__name__}, expected str")
    return text


def assistant_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """``(full_text, spans)``: the rendered conversation and the ``[start, end)`` character spans of
    the assistant turns (content plus end-of-turn token(s), trailing whitespace dropped), in order.

    Raises ``ValueError`` when the template fails or is not prefix-stable."""
    full = _render(tokenizer, messages, add_generation_prompt=False)
    spans: list[tuple[int, int]] = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = _render(tokenizer, messages[:i], add_generation_prompt=True)
        turn = _render(tokenizer, messages[: i + 1], add_generation_prompt=False)
        # Both checks are needed: the prompt must be a prefix of the turn, and the turn of the whole
        # conversation, or the character span would point at different text in `full`.
        if not turn.startswith(prompt):
            raise ValueError(
                f"chat template is not prefix-stable: the generation prompt before message {i} is not a "
                "prefix of the conversation rendered through that assistant message"
            )
        if not full.startswith(turn):
            raise ValueError(
                f"chat template is not prefix-stable: the conversation rendered through message {i} is "
                "not a prefix of the whole conversation"
            )
        start, end = len(prompt), len(prompt) + len(turn[len(prompt) :].rstrip())
        if end > start:
            spans.append((start, end))
    return full, spans


def tokenize_conversation(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """``(input_ids, loss_mask)``, both ``[T]``, of ``messages`` (``[{"role", "content"}]``) rendered
    with ``tokenizer``'s chat template; ``loss_mask`` is 1 on assistant tokens only (see the module
    docstring). Needs a fast tokenizer (character offsets).

    Special tokens written by the template (``<|im_start|>``...) are tokenized as special tokens, and no
    BOS/EOS is added (``add_special_tokens=False``): templates that want a BOS write it themselves.
    Raises ``ValueError`` for a failing or non-prefix-stable template."""
    text, spans = assistant_spans(tokenizer, messages)
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    input_ids = list(encoding["input_ids"])
    offsets = encoding["offset_mapping"]
    loss_mask = [0] * len(input_ids)
    # Tokens and spans are both sorted by position: one walk over the tokens, one pointer into spans.
    k = 0
    for t, (start, end) in enumerate(offsets):
        while k < len(spans) and spans[k][1] <= start:
            k += 1
        if k < len(spans) and start < spans[k][1] and end > spans[k][0]:
            loss_mask[t] = 1
    return input_ids, loss_mask
