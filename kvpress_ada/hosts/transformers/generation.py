"""``generate``: answer questions about one context, question-agnostic by default."""

from __future__ import annotations

import copy
from contextlib import nullcontext

import torch

from ...tokens import encode, left_pad
from .hf import cache_kwarg, output_cache
from .model_pass import use_tokenizer

_PLACEHOLDER = "<<<kvpress_ada_question>>>"


def split_prompt(tokenizer, context: str, question: str) -> tuple[str, str]:
    """Render the chat prompt and split it where the question starts: ``(context part, question part)``."""
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": context + "\n\n" + _PLACEHOLDER}]
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        head, tail = rendered.split(_PLACEHOLDER)
        return head, question + tail
    return context, "\n\nQuestion: " + question + "\nAnswer:"


def eos_ids(model, tokenizer) -> set[int]:
    eos = model.generation_config.eos_token_id
    ids = set(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


@torch.inference_mode()
def continue_rows(model, input_ids: torch.Tensor, cache, max_new_tokens: int, eos: set[int],
                  mask: torch.Tensor | None = None):
    """Feed ``input_ids [B, T]`` through ``model`` with ``cache``, then decode every row greedily
    (:func:`decode_rows`). ``mask [B, past + T]`` (left-padded batches) covers cache and ids; positions
    then follow it (``cumsum - 1``), so padded rows keep their true RoPE positions."""
    extra = {}
    if mask is not None:
        positions = (mask.long().cumsum(-1) - 1).clamp(min=0)[:, -input_ids.shape[1]:]
        extra = {"attention_mask": mask, "position_ids": positions}
    out = model(input_ids=input_ids, use_cache=True, logits_to_keep=1, **{cache_kwarg(model): cache}, **extra)
    return decode_rows(model, out.logits[:, -1], output_cache(out), max_new_tokens, eos, mask=mask)


@torch.inference_mode()
def decode_rows(model, logits: torch.Tensor, cache, max_new_tokens: int, eos: set[int], mask=None):
    """Greedy decoding of every batch row from next-token ``logits [B, V]``: ``(one token list per row,
    cache)``; each row stops at its first ``eos`` id (not returned).

    With ``mask [B, past]`` (left-padded batches) the mask grows by one per step and positions
    follow it, so padded rows keep their true RoPE positions.
    """
    key = cache_kwarg(model)
    B = logits.shape[0]
    rows: list[list[int]] = [[] for _ in range(B)]
    done = [False] * B
    next_id = logits.argmax(-1)
    for step in range(max_new_tokens):
        for b, token in enumerate(next_id.tolist()):
            if not done[b]:
                done[b] = token in eos
                if not done[b]:
                    rows[b].append(token)
        if all(done) or step + 1 == max_new_tokens:
            break
        extra = {}
        if mask is not None:
            mask = torch.cat([mask, mask.new_ones(B, 1)], dim=1)
            extra = {"attention_mask": mask, "position_ids": mask.long().sum(-1, keepdim=True) - 1}
        out = model(input_ids=next_id[:, None], use_cache=True, **{key: cache}, **extra)
        cache = output_cache(out)
        next_id = out.logits[:, -1].argmax(-1)
    return rows, cache


@torch.inference_mode()
def generate(model, tokenizer, context: str | list[str], questions: list[str] | str, press=None,
             max_new_tokens: int = 16, question_aware: bool = False,
             compile: bool | None = None) -> list[str] | list[list[str]]:
    """Answer every question about ``context`` with greedy decoding.

    ``question_aware=False``: the context alone is prefilled and compressed (the question is
    unknown when the cache is built); every question is then answered from that same compressed
    cache, which is cropped back to its compressed state after each answer. ``question_aware=True``:
    context and question form one prompt that is compressed as a whole. ``press=None``: full cache.
    ``context`` may be a list of documents of different lengths: they run as one left-padded batch
    and the result is one list of answers per document. ``compile``: decode steps over the compressed
    cache run through a compiled forward (default: on CUDA, off on CPU; ``$KVPRESS_ADA_COMPILE=0`` turns
    the default off; see :mod:`kvpress_ada.hosts.transformers.compiled`); tokens are the same either way. With
    decode compression (``press.decode_budget``) the question and answer tokens count toward the decode
    interval; a compaction cannot be cropped away, so every question then starts from a copy of the
    compressed context cache instead.
    """
    single = isinstance(context, str)
    contexts: list[str] = [context] if isinstance(context, str) else list(context)
    if isinstance(questions, str):
        questions = [questions]
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not contexts:
        raise ValueError("generate needs at least one context")
    device = next(model.parameters()).device
    use_tokenizer(model, tokenizer)  # for scorers that prompt the model themselves (KVzip)
    eos = eos_ids(model, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    answers: list[list[str]] = [[] for _ in contexts]

    def decode_rows(token_rows):
        for b, row in enumerate(token_rows):
            answers[b].append(tokenizer.decode(row, skip_special_tokens=True).strip())

    def parts(question):
        return [split_prompt(tokenizer, c, question) for c in contexts]

    with press(model, compile=compile) if press is not None else nullcontext():
        if question_aware:
            for question in questions:
                rows = [torch.cat([encode(tokenizer, h, device), encode(tokenizer, t, device)], 1)[0]
                        for h, t in parts(question)]
                ids, mask = left_pad(rows, pad_id)
                mask = mask.long()
                token_rows, _ = continue_rows(model, ids, None, max_new_tokens, eos, mask=mask)
                decode_rows(token_rows)
        elif questions:
            heads = [encode(tokenizer, h, device)[0] for h, _ in parts(questions[0])]
            ids, context_mask = left_pad(heads, pad_id)
            context_mask = context_mask.long()
            positions = (context_mask.cumsum(-1) - 1).clamp(min=0)
            out = model(input_ids=ids, attention_mask=context_mask, position_ids=positions, use_cache=True,
                        logits_to_keep=1, **{cache_kwarg(model): None})
            cache = output_cache(out)
            context_length = cache.get_seq_length()
            # each question continues a copy when cropping its tokens off cannot restore the context's cache (decode
            # compaction; sliding-window layers, which let the context's window go)
            decoding = (press is not None and press.compresses_decode) or any(getattr(cache, "is_sliding", ()))
            for i, question in enumerate(questions):
                tails = [encode(tokenizer, t, device)[0] for _, t in parts(question)]
                if any(not torch.equal(t, tails[0]) for t in tails):
                    raise ValueError("the question part of the prompt tokenizes differently across contexts; "
                                     "answer them one context at a time")
                tail = torch.stack(tails)
                mask = torch.cat([context_mask, context_mask.new_ones(tail.shape)], dim=1)
                last = i + 1 == len(questions)
                work = copy.deepcopy(cache) if decoding and not last else cache
                token_rows, work = continue_rows(model, tail, work, max_new_tokens, eos, mask=mask)
                decode_rows(token_rows)
                if not decoding:
                    cache = work
                    cache.crop(context_length - cache.get_seq_length())
    return answers[0] if single else answers
