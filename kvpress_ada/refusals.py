"""Published presses kvpress_ada does not build, each with the one line that says what it would need.

:func:`kvpress_ada.preset` and the command line answer with that line for these names (instead of "unknown
preset"), so a user coming from NVIDIA kvpress learns why and what to use. Readable without torch."""

from __future__ import annotations

REFUSED: dict[str, str] = {
    "dms": "DMS (Dynamic Memory Sparsification, arXiv 2506.05345) evicts by decisions a model learns when it is "
           "retrained with DMS (e.g. nvidia/Qwen3-8B-DMS-8x); kvpress_ada compresses frozen models and ships no "
           "retrained one: its learned-threshold path is the Threshold allocator over a learned score (preset "
           "kvzap_threshold)",
    "restorekv": "RestoreKV (arXiv 2608.01247) needs restore-token embeddings and a LoRA adapter trained by "
                 "self-distillation for the model (published only for Llama-3.1-8B-Instruct and Qwen3-8B as "
                 "higokri/RestoreKV-*); kvpress_ada trains none: use kvzip, the selection RestoreKV builds on",
}


def refusal(name: str) -> str | None:
    """The one-line reason ``name`` is not built, or ``None`` for any other name."""
    return REFUSED.get(name)


__all__ = ["REFUSED", "refusal"]
