"""Compile the Triton kernels for a GPU target on a machine without a GPU.

The interpreter (``TRITON_INTERPRET=1``) checks the kernels' arithmetic but not their real
code generation; this module runs Triton's full pipeline (TTIR -> PTX -> cubin with the
bundled ptxas) for ``sm_90`` with the launch configs of :func:`default_config`, so
codegen errors, shared-memory overruns and unpipelined loads show up in CPU-only CI.

    python -m kvpress_ada.kernels.aot_check --dtype bf16 --head-dim 128 --m 4

``--extras`` compiles the variants with logit soft-capping and attention sinks compiled in.
Must run *without* ``TRITON_INTERPRET`` (prints JSON, one line per kernel).
"""

from __future__ import annotations

import argparse
import json
import sys

_DTYPES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}


def _compile(kernel, types, consts, num_warps, num_stages, arch):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    sig = {n: ("constexpr" if n in consts else types.get(n, "i32")) for n in names}
    # the runtime specialises 16-aligned pointers / multiple-of-16 ints the same way
    div = {
        (i,): [["tt.divisibility", 16]]
        for i, n in enumerate(names)
        if n not in consts and (n.endswith("_ptr") or n.startswith("stride"))
    }
    src = ASTSource(fn=kernel, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()}, attrs=div)
    options = dict(num_warps=num_warps, num_stages=num_stages)
    k = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    ptx = k.asm["ptx"]
    return {"shared": k.metadata.shared, "cp_async": ptx.count("cp.async"), "ptx_lines": ptx.count("\n")}


def check(dtype: str, head_dim: int, m_total: int, arch: int = 90, extras: bool = False) -> dict:
    """Compile the split, reduce and compact kernels, the split kernel over int8 / int4 records (groups of
    32 channels) and e4m3 records (one scale per head), and the split kernels over selected pages (16-entry
    pages) of full-precision entries and of those records, for one (dtype, head_dim, G*Q); ``extras``: with
    soft-capping and sinks compiled in."""
    import torch

    from .quantized import triton_kernel as qt
    from .ragged import triton_kernel as tk
    from .support import triton_interpret

    if triton_interpret():
        raise RuntimeError("aot_check must run without TRITON_INTERPRET")
    tdt = getattr(torch, _DTYPES[dtype])
    cfg = tk.default_config(head_dim, m_total, 1 << 20, tdt, torch.device("cpu"))
    f32 = {"PM_ptr": "*fp32", "PL_ptr": "*fp32", "PACC_ptr": "*fp32", "LEN_ptr": "*i32", "cap_log2": "fp32",
           "SINK_ptr": "*fp32", "BIAS_ptr": "*fp32"}
    t = "*" + dtype
    out = {"dtype": dtype, "head_dim": head_dim, "m_total": m_total, "config": cfg, "extras": extras}
    out["split"] = _compile(
        tk._ragged_attn_split_kernel,
        {"Q_ptr": t, "K_ptr": t, "V_ptr": t, "OFF_ptr": "*i32", "qk_scale": "fp32", **f32},
        dict(HEAD_DIM=head_dim, BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"], R_PAD=16, IEEE=dtype == "fp32",
             SOFTCAP=extras),
        cfg["num_warps"],
        cfg["num_stages"],
        arch,
    )
    for name, bits, group, e4m3 in (("int8", 8, min(32, head_dim), False), ("int4", 4, min(32, head_dim), False),
                                    ("e4m3", 8, head_dim, True)):
        scales = "*fp32" if e4m3 else t  # e4m3 records keep float32 scales
        out[f"quantized_split_{name}"] = _compile(
            qt._quantized_split_kernel,
            {"Q_ptr": t, "K_ptr": "*u8", "V_ptr": "*u8", "KS_ptr": scales, "VS_ptr": scales, "AK_ptr": "*fp32",
             "AV_ptr": t, "TK_ptr": "*fp32", "TV_ptr": "*fp32", "OFF_ptr": "*i32", "qk_scale": "fp32", **f32},
            dict(HEAD_DIM=head_dim, BITS=bits, GROUP=group, E4M3=e4m3, RESID=32, BLOCK_M=cfg["block_m"],
                 BLOCK_N=cfg["block_n"], R_PAD=16, IEEE=dtype == "fp32", SOFTCAP=extras, SHIFT=extras),
            cfg["num_warps"],
            cfg["num_stages"],
            arch,
        )
    from .ragged import sparse_triton_kernel as st

    out["sparse_split"] = _compile(
        st._sparse_split_kernel,
        {"Q_ptr": t, "K_ptr": t, "V_ptr": t, "CNT_ptr": "*i32", "PAGE_ptr": "*i32", "J_ptr": "*i32",
         "qk_scale": "fp32", **f32},
        dict(PAGE=16, HEAD_DIM=head_dim, BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"], R_PAD=16,
             IEEE=dtype == "fp32", SOFTCAP=extras),
        cfg["num_warps"],
        cfg["num_stages"],
        arch,
    )
    from .quantized import sparse_triton_kernel as sq

    for name, bits, group, e4m3 in (("int8", 8, min(32, head_dim), False), ("int4", 4, min(32, head_dim), False),
                                    ("e4m3", 8, head_dim, True)):
        scales = "*fp32" if e4m3 else t
        out[f"sparse_quantized_split_{name}"] = _compile(
            sq._sparse_quantized_split_kernel,
            {"Q_ptr": t, "K_ptr": "*u8", "V_ptr": "*u8", "KS_ptr": scales, "VS_ptr": scales, "AK_ptr": "*fp32",
             "AV_ptr": t, "TK_ptr": "*fp32", "TV_ptr": "*fp32", "CNT_ptr": "*i32", "PAGE_ptr": "*i32",
             "J_ptr": "*i32", "qk_scale": "fp32", **f32},
            dict(PAGE=16, HEAD_DIM=head_dim, BITS=bits, GROUP=group, E4M3=e4m3, RESID=32, BLOCK_M=cfg["block_m"],
                 BLOCK_N=cfg["block_n"], R_PAD=16, IEEE=dtype == "fp32", SOFTCAP=extras, SHIFT=extras),
            cfg["num_warps"],
            cfg["num_stages"],
            arch,
        )
    out["reduce"] = _compile(
        tk._ragged_attn_reduce_kernel,
        {"O_ptr": t, **f32},
        dict(HEAD_DIM=head_dim, R_PAD=16, BLOCK_S=32 if head_dim <= 128 else 16, SINKS=extras),
        4,
        2,
        arch,
    )
    out["compact"] = _compile(
        tk._compact_kernel,
        {"K_ptr": t, "V_ptr": t, "KF_ptr": t, "VF_ptr": t, "KEEP_ptr": "*u8", "CSUM_ptr": "*i32", "OFF_ptr": "*i32"},
        dict(BLOCK_L=64, BLOCK_D=max(16, head_dim)),
        4,
        1,
        arch,
    )
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", choices=sorted(_DTYPES), nargs="+", default=["bf16"])
    p.add_argument("--head-dim", type=int, nargs="+", default=[128])
    p.add_argument("--m", type=int, nargs="+", default=[4], help="G * Q query rows per kv row")
    p.add_argument("--arch", type=int, default=90)
    p.add_argument("--extras", action="store_true", help="with logit soft-capping and attention sinks compiled in")
    a = p.parse_args(argv)
    for dt in a.dtype:
        for d in a.head_dim:
            for m in a.m:
                print(json.dumps(check(dt, d, m, a.arch, a.extras)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
