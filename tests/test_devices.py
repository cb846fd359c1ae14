"""Multi-device models: with ``device_map="auto"`` (accelerate) each layer's cache lives on that
layer's device. On CPU every layer is on ``cpu``; the test pins the contract (no ``model.device`` for cache tensors)."""

import torch
from conftest import build_model, build_tokenizer
from transformers import AutoModelForCausalLM

from kvpress_ada import preset
from kvpress_ada.hosts.transformers.hf import output_cache


def test_cache_tensors_sit_on_their_layers_device(tmp_path):
    build_model("llama").save_pretrained(tmp_path)
    build_tokenizer().save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, device_map="auto", dtype=torch.float32).eval()
    ids = torch.randint(4, 100, (2, 96), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), preset("ada_snapkv", compression_ratio=0.5)(model):
        out = model.generate(input_ids=ids, max_new_tokens=3, do_sample=False, return_dict_in_generate=True,
                             pad_token_id=0)
    cache = output_cache(out)
    for layer, attn in zip(cache.layers, (block.self_attn for block in model.model.layers)):
        device = attn.k_proj.weight.device
        assert layer.compressed
        assert {t.device for t in (layer.k_flat, layer.v_flat, layer.row_offsets, layer.row_lengths)} == {device}
