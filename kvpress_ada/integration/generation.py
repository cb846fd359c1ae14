"""``generate``: answer questions about one context, question-agnostic by default."""

from __future__ import annotations

from contextlib import nullcontext

import torch

from .press_context import _cache_key

_PLACEHOLDER = "<<<kvpress_ada_question>>>"


def split_prompt(tokenizer, context: str, question: str) -> tuple[str, str]:
    """Render the chat prompt and split it where the question starts: ``(context part, question part)``."""
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": context + "\n\n" + _PLACEHOLDER}]
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        head, tail = rendered.split(_PLACEHOLDER)
        return head, question + tail
    return context, "\n\nQuestion: " + question + "\nAnswer:"


def encode(tokenizer, text: str, device) -> torch.Tensor:
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    return ids.to(device)


def eos_ids(model, tokenizer) -> set[int]:
    eos = model.generation_config.eos_token_id
    ids = set(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


@torch.inference_mode()
def greedy_continue(model, input_ids: torch.Tensor, cache, max_new_tokens: int, eos: set[int]):
    """Feed ``input_ids`` through ``model`` with ``cache``, then decode greedily; returns (token ids, cache)."""
    out = model(input_ids=input_ids, use_cache=True, **{_cache_key(model): cache})
    return greedy_decode(model, out.logits[:, -1], output_cache(out), max_new_tokens, eos)


@torch.inference_mode()
def greedy_decode(model, logits: torch.Tensor, cache, max_new_tokens: int, eos: set[int]):
    """Greedy decoding (batch 1) from next-token ``logits [1, V]``; stops at an ``eos`` id (not returned)."""
    key = _cache_key(model)
    tokens = []
    next_id = logits.argmax(-1, keepdim=True)
    for step in range(max_new_tokens):
        token = int(next_id[0, 0])
        if token in eos:
            break
        tokens.append(token)
        if step + 1 == max_new_tokens:
            break
        out = model(input_ids=next_id, use_cache=True, **{key: cache})
        cache = output_cache(out)
        next_id = out.logits[:, -1].argmax(-1, keepdim=True)
    return tokens, cache


def output_cache(out):
    cache = getattr(out, "cache", None)
    return cache if cache is not None else getattr(out, "past_key_values", None)


@torch.inference_mode()
def generate(model, tokenizer, context: str, questions: list[str] | str, press=None, max_new_tokens: int = 16,
             question_aware: bool = False) -> list[str]:
    """Answer every question about ``context`` with greedy decoding.

    ``question_aware=False``: the context alone is prefilled and compressed (the question is
    unknown when the cache is built); every question is then answered from that same compressed
    cache, which is cropped back to its compressed state after each answer. ``question_aware=True``:
    context and question form one prompt that is compressed as a whole. ``press=None``: full cache.
    """
    if isinstance(questions, str):
        questions = [questions]
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    device = next(model.parameters()).device
    eos = eos_ids(model, tokenizer)
    pressing = press(model) if press is not None else nullcontext()
    answers = []
    with pressing:
        if question_aware:
            for question in questions:
                head, tail = split_prompt(tokenizer, context, question)
                ids = torch.cat([encode(tokenizer, head, device), encode(tokenizer, tail, device)], dim=1)
                tokens, _ = greedy_continue(model, ids, None, max_new_tokens, eos)
                answers.append(tokenizer.decode(tokens, skip_special_tokens=True).strip())
            return answers
        head, _ = split_prompt(tokenizer, context, questions[0] if questions else "")
        key = _cache_key(model)
        out = model(input_ids=encode(tokenizer, head, device), use_cache=True, **{key: None})
        cache = output_cache(out)
        context_length = cache.get_seq_length()
        for question in questions:
            _, tail = split_prompt(tokenizer, context, question)
            tokens, cache = greedy_continue(model, encode(tokenizer, tail, device), cache, max_new_tokens, eos)
            answers.append(tokenizer.decode(tokens, skip_special_tokens=True).strip())
            cache.crop(context_length - cache.get_seq_length())
    return answers
