"""Save a tiny random Llama (fp32) and a character-level tokenizer that vLLM 0.32 (CPU) can load.

The CPU attention backend accepts head sizes 32, 64, 80, ... (vllm/v1/attention/backends/cpu_attn.py:69), so
the geometry is the test suite's tiny Llama (tests/conftest.py) with head_dim 32 instead of 16.

Run (in the vLLM venv): ``python benchmarks/vllm_probe/make_tiny_model.py /tmp/tiny-llama``
"""

import string
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

VOCAB = 128
CONFIG = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=192, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, max_position_embeddings=1024, tie_word_embeddings=False,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)


def build_tokenizer() -> PreTrainedTokenizerFast:
    """The test suite's character-level tokenizer (ids < VOCAB)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    vocab = {tok: i for i, tok in enumerate(specials + list(string.printable))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def save(path: str, seed: int = 0) -> str:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG)).eval()
    model.save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return path


if __name__ == "__main__":
    print(save(sys.argv[1] if len(sys.argv) > 1 else "/tmp/tiny-llama"))
