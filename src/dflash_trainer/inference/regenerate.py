"""Regenerate the assistant turns of a chat data set with the target (``dflash-train generate``).

A DFlash drafter learns to predict what the *target* would say, so its training data should be the
target's own outputs, not the text some other model wrote. For every chat record this module replays
the conversation and replaces each assistant turn, in order, by the target's continuation of
everything before it (earlier assistant turns already replaced):

    prompt_k = chat_template(messages[:k] with assistant turns regenerated, add_generation_prompt=True)
    assistant_k = decode(target.generate(prompt_k), skip_special_tokens=True)

Records are batched: each round generates the next assistant turn of every conversation in the batch
with one HF ``model.generate`` call (KV cache, LEFT padding plus an attention mask, stopping at the
generation config's eos ids). HF derives the position ids from the attention mask
(``cumsum - 1``), so a left-padded prompt sees the same positions as alone: in float32, greedy
batched and unbatched logits are bit-identical (tested). In bfloat16 the batched matmuls round
differently (one ulp, about 0.06 at logit 14), which can flip an exact tie between two tokens;
that is rounding, not padding, and it is inherent to low-precision batching.

``commands/generate.py`` writes what ``regenerate_into`` hands it resumably and atomically.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sized
from dataclasses import dataclass

from ..data.records import BadRecord, Record
from ..errors import UserError

# Skip reasons (stable strings: they are the keys of the report's "skipped" section).
SKIP_PRETOKENIZED = "pre-tokenized (no messages to regenerate)"
SKIP_EMPTY = "empty generation"
SKIP_TOO_LONG = "prompt plus max_new_tokens longer than the target's context"
SKIP_TEMPLATE = "chat template failed"


@dataclass(frozen=True)
class Skipped:
    """An input record that produced no output record, and why."""

    source: str  # "file:line"
    reason: str


@dataclass
class GenerationStats:
    """Counters a caller may pass in to learn what the generation did."""

    turns: int = 0  # assistant turns regenerated
    new_tokens: int = 0  # tokens generated, eos excluded
    truncated_turns: int = 0  # turns that hit max_new_tokens before an eos
    generate_calls: int = 0


def source_of(record: Record | BadRecord) -> str:
    """``"file:line"`` of an input record: the key that output records carry and resume matches."""
    return f"{record.source}:{record.line}"


def eos_ids(model, tokenizer) -> list[int]:
    """The generation config's eos ids (a list in chat models: e.g. <|endoftext|> and <|im_end|>)."""
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        raise UserError("the target has no eos token in its generation config or tokenizer: generation cannot stop")
    return [eos] if isinstance(eos, int) else list(eos)


class _Generator:
    """Batched generation of prompt strings with fixed settings; the one place that calls ``model.generate``."""

    def __init__(self, model, tokenizer, *, max_new_tokens, temperature, top_p, seed, stats, engine=None):
        import torch

        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if temperature < 0 or not 0 < top_p <= 1:
            raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, got {temperature}, {top_p}")
        self.torch, self.model, self.tokenizer = torch, model, tokenizer
        self.max_new_tokens, self.seed, self.stats = max_new_tokens, seed, stats
        self.engine, self.temperature, self.top_p = engine, temperature, top_p
        self.eos = eos_ids(model, tokenizer)
        pad = tokenizer.pad_token_id
        self.pad = self.eos[0] if pad is None else pad  # padded slots are masked out, any id works
        self.context = getattr(model.config, "max_position_embeddings", None)
        if temperature == 0:
            # Neutral sampling fields, so a model whose generation config samples (e.g. Qwen3's
            # temperature 0.6) neither warns nor changes anything under greedy decoding.
            self.kwargs = dict(do_sample=False, temperature=1.0, top_p=1.0, top_k=None)
        else:
            # HF would otherwise apply its global default top_k=50 on top of top_p; keep a top_k only
            # when the target's own generation config asks for one.
            self.kwargs = dict(
                do_sample=True,
                temperature=temperature,
                top_p=top_p,
                top_k=getattr(model.generation_config, "top_k", None) or 0,
            )

    def encode(self, messages: list[dict]) -> list[int]:
        """Token ids of the chat prompt that asks for the next assistant turn after ``messages``."""
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        # The template already holds every special token the model expects; add none.
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def fits(self, ids: list[int]) -> bool:
        return self.context is None or len(ids) + self.max_new_tokens <= self.context

    def generate(self, prompts: list[list[int]]) -> list[str]:
        """One ``model.generate`` call over left-padded ``prompts``; decoded texts, cut at the first eos.

        input_ids, attention_mask: [n, max_len], pad on the left so every row's next token is at the end.
        With an ``engine`` (``serving.engines``: vLLM, an OpenAI-compatible server) the same token ids
        go to it instead, ``max_new_tokens`` always sent; seeded by (seed, call index) as well.
        """
        if self.engine is not None:
            seed = self.seed * 1_000_003 + self.stats.generate_calls
            done = self.engine.complete(prompts, self.max_new_tokens, self.temperature, self.top_p, seed)
            self.stats.generate_calls += 1
            for _, n, cut in done:
                self.stats.turns += 1
                self.stats.new_tokens += n
                self.stats.truncated_turns += cut
            return [text for text, _, _ in done]
        torch = self.torch
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in prompts], dtype=torch.long)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], dtype=torch.long)
        device = self.model.device
        # Seed each call from (seed, call index) inside a forked RNG: sampling is reproducible for the
        # same input and batch size, and the caller's global RNG state is left untouched.
        devices = (
            [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
        )
        with torch.random.fork_rng(devices=devices), torch.inference_mode():
            torch.manual_seed(self.seed * 1_000_003 + self.stats.generate_calls)
            out = self.model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=self.max_new_tokens,
                eos_token_id=self.eos,
                pad_token_id=self.pad,
                use_cache=True,
                **self.kwargs,
            )
        self.stats.generate_calls += 1
        texts = []
        for row in out[:, width:].tolist():
            end = next((i for i, t in enumerate(row) if t in self.eos), None)
            self.stats.turns += 1
            self.stats.new_tokens += len(row) if end is None else end
            self.stats.truncated_turns += end is None
            texts.append(self.tokenizer.decode(row[:end], skip_special_tokens=True))
        return texts


def _regenerate_batch(records: list[Record], gen: _Generator) -> list[dict | Skipped]:
    """Regenerate every assistant turn of ``records`` (one batch), round by round; results in input order.

    Round r generates, in one call, the r-th assistant turn of every conversation that has one, so the
    prompt of each turn already holds that conversation's earlier regenerated turns.
    """
    messages = [[dict(m) for m in r.messages] for r in records]
    todo = [[i for i, m in enumerate(ms) if m["role"] == "assistant"] for ms in messages]
    failed: dict[int, str] = {}
    for rnd in range(max(len(t) for t in todo)):
        rows, prompts = [], []
        for j, turns in enumerate(todo):
            if j in failed or rnd >= len(turns):
                continue
            try:
                ids = gen.encode(messages[j][: turns[rnd]])
            except Exception as exc:  # any template error is this record's problem, not the run's
                failed[j] = f"{SKIP_TEMPLATE}: {type(exc).__name__}"
                continue
            if not gen.fits(ids):
                failed[j] = SKIP_TOO_LONG
                continue
            rows.append(j)
            prompts.append(ids)
        for j, text in zip(rows, gen.generate(prompts) if rows else []):
            if not text.strip():
                failed[j] = SKIP_EMPTY  # nothing to learn from; later turns would build on nothing
            messages[j][todo[j][rnd]]["content"] = text
    results: list[dict | Skipped] = []
    for j, record in enumerate(records):
        if j in failed:
            results.append(Skipped(source_of(record), failed[j]))
        else:
            # The input's other keys first, so "messages" and "source" always hold what this module wrote.
            results.append({**record.extra, "messages": messages[j], "source": source_of(record)})
    return results


def regenerate_batches(
    records: Iterable[Record | BadRecord],
    model,
    tokenizer,
    *,
    max_new_tokens: int,
    batch_size: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    progress: bool = True,
    total: int | None = None,
    stats: GenerationStats | None = None,
    engine=None,
) -> Iterator[list[dict | Skipped]]:
    """Like ``regenerate_records``, one list per batch of ``batch_size`` chat records (for writers that flush).
    ``engine``: generate through it (``serving.engines``) instead of ``model.generate``.

    Each list holds, in input order, the output records of the batch and a ``Skipped`` for every input
    record that gave none (bad records, pre-tokenized records, empty generations, prompts too long).
    ``total`` sizes the progress bar (input records, skipped ones included).
    """
    from tqdm import tqdm

    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    gen = _Generator(
        model,
        tokenizer,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        stats=stats if stats is not None else GenerationStats(),
        engine=engine,
    )
    bar = tqdm(total=total, unit="rec", desc="generate", disable=not progress, dynamic_ncols=True)

    def flush(pending: list) -> list[dict | Skipped]:
        chat = [r for r in pending if isinstance(r, Record)]
        done = iter(_regenerate_batch(chat, gen) if chat else [])
        out = [next(done) if isinstance(r, Record) else r for r in pending]
        bar.update(len(out))
        return out

    pending: list[Record | Skipped] = []  # input order; skipped records wait so the order is kept
    n_chat = 0
    try:
        for record in records:
            if isinstance(record, BadRecord):
                pending.append(Skipped(source_of(record), f"bad record: {record.reason}"))
            elif record.messages is None:
                pending.append(Skipped(source_of(record), SKIP_PRETOKENIZED))
            else:
                pending.append(record)
                n_chat += 1
            if n_chat == batch_size:
                yield flush(pending)
                pending, n_chat = [], 0
        if pending:
            yield flush(pending)
    finally:
        bar.close()


@dataclass
class Regeneration:
    """What ``regenerate_into`` did: ``generated`` output records handed to the writer, ``skipped``
    input records (reason -> their ``"file:line"``, in input order), the generation's counters and the
    seconds it took."""

    generated: int
    skipped: dict[str, list[str]]
    stats: GenerationStats
    seconds: float


def regenerate_into(
    records: Iterable[Record | BadRecord],
    model,
    tokenizer,
    write: Callable[[list[dict]], None],
    *,
    max_new_tokens: int,
    batch_size: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    progress: bool = True,
    total: int | None = None,
    engine=None,
) -> Regeneration:
    """``regenerate_batches`` handed to a writer: ``write(output records)`` once per batch (the list may
    be empty when every record of the batch was skipped), before the next batch is generated, so a
    writer that flushes there loses at most the batch in flight. Skipped records are counted by reason."""
    stats = GenerationStats()
    skipped: dict[str, list[str]] = {}
    generated = 0
    start = time.perf_counter()
    for batch in regenerate_batches(
        records,
        model,
        tokenizer,
        max_new_tokens=max_new_tokens,
        batch_size=batch_size,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        progress=progress,
        total=total,
        stats=stats,
        engine=engine,
    ):
        written = []
        for item in batch:
            if isinstance(item, Skipped):
                skipped.setdefault(item.reason, []).append(item.source)
            else:
                written.append(item)
        write(written)
        generated += len(written)
    return Regeneration(generated, skipped, stats, time.perf_counter() - start)


def regenerate_records(
    records: Iterable[Record | BadRecord],
    model,
    tokenizer,
    *,
    max_new_tokens: int,
    batch_size: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    progress: bool = True,
    on_skip: Callable[[Skipped], None] | None = None,
    stats: GenerationStats | None = None,
) -> Iterator[dict]:
    """Output records: each chat record with every assistant turn regenerated by the target.

    records: ``Record``/``BadRecord`` as ``data.records.iter_records`` yields them.
    Greedy when ``temperature == 0``, else sampling with ``temperature``/``top_p``, seeded by ``seed``.
    An output record is the input's extra keys plus ``"messages"`` (regenerated) and ``"source"``
    (``"file:line"`` of the input). Records that give no output are passed to ``on_skip``.
    """
    total = len(records) if isinstance(records, Sized) else None
    for batch in regenerate_batches(
        records,
        model,
        tokenizer,
        max_new_tokens=max_new_tokens,
        batch_size=batch_size,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        progress=progress,
        total=total,
        stats=stats,
    ):
        for item in batch:
            if isinstance(item, Skipped):
                if on_skip is not None:
                    on_skip(item)
            else:
                yield item
