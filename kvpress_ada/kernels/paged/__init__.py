"""Paged per-(request, kv head) attention: the custom op with its torch reference (``ops``), the Triton kernel
(``triton_kernel``)."""
