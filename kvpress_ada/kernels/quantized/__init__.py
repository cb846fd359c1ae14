"""Attention, append and compaction over records of a storage layout: the record scheme and its torch references
(``scheme``), the custom ops (``ops``), the fused CPU kernel (``cpu_kernel``, ``cpu_kernel.c``), the Triton
kernel (``triton_kernel``)."""
