"""Ragged per-(batch, kv head) attention, compaction and append: the custom ops and their dispatch (``ops``), the
torch references (``reference``, also the CPU path), the Triton kernels (``triton_kernel``)."""
