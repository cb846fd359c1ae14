"""Where does vLLM's CPU cache write put a token's K and V inside a (block, kv head) page?

Calls ``cpu_attn_reshape_and_cache`` (what ``CPUAttentionBackendImpl.do_kv_cache_update`` runs) on a small
``[num_blocks, H, block_size, 2 * D]`` tensor, viewed as the backend does (``[NB, H, 2 * bs, D]`` chunked in K and V
halves), for fp32 and bf16, and checks whether K and V land row-major (``[bs, D]``) or K transposed (``[D, bs]``).
No engine is started.

Run (in the vLLM venv): ``python benchmarks/vllm_probe/page_layout.py``
"""

import torch


def main() -> None:
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    torch.manual_seed(0)
    nb, h, bs, d, n, t = 4, 2, 32, 32, 40, 5
    print("AMX:", torch.cpu._is_amx_tile_supported(), "AVX-512:", torch.cpu._is_avx512_supported())
    for dtype in (torch.float32, torch.bfloat16):
        isa = _get_attn_isa(dtype, bs, d)
        kv = torch.zeros(nb, h, bs, 2 * d, dtype=dtype)
        k_cache, v_cache = kv.view(nb, h, 2 * bs, d).chunk(2, dim=2)
        key, value = torch.randn(n, h, d).to(dtype), torch.randn(n, h, d).to(dtype)
        slots = torch.arange(bs, bs + n, dtype=torch.int64)  # block 0 is vLLM's null block
        ops.cpu_attn_reshape_and_cache(key, value, k_cache, v_cache, slots, isa, k_scale=1.0, v_scale=1.0,
                                       kv_cache_dtype="auto")
        b, o = divmod(bs + t, bs)
        print(f"{dtype} isa={isa}: K row-major {torch.equal(k_cache[b, :, o], key[t])}, "
              f"K transposed [D, bs] {torch.equal(k_cache[b].reshape(h, d, bs)[:, :, o], key[t])}, "
              f"V row-major {torch.equal(v_cache[b, :, o], value[t])}")


if __name__ == "__main__":
    main()
