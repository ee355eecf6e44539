"""Write a tiny random-weight model and a locally trained BPE tokenizer (no hub access).

    python make_tiny_model.py OUT_DIR llama|qwen2 [--layers N --hidden H --intermediate I]

Runs in the SGLang test environment (it needs transformers and tokenizers). float32 weights
(``--dtype float32`` on the server then serves the exact bytes), ``tie_word_embeddings=False``
(``lm_head.weight`` is a tensor of its own), one ``model.safetensors``. Deterministic: the
tokenizer is trained on this Python's own standard library sources, the weights seeded.
"""

import argparse
import glob
import os
import sysconfig

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

ARCHS = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("arch", choices=sorted(ARCHS))
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--intermediate", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)

    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))[:80]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1000,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(files, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        bos_token=None,
        pad_token="<|endoftext|>",
        unk_token=None,
    )
    fast.save_pretrained(a.out)
    eos = fast.convert_tokens_to_ids("<|endoftext|>")

    torch.manual_seed(a.seed)
    config_cls, model_cls = ARCHS[a.arch]
    cfg = config_cls(
        vocab_size=1024,
        hidden_size=a.hidden,
        intermediate_size=a.intermediate,
        num_hidden_layers=a.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=eos,
        pad_token_id=eos,
        torch_dtype="float32",
    )
    model = model_cls(cfg).to(torch.float32)
    model.save_pretrained(a.out, safe_serialization=True)
    print(a.out, sorted(os.listdir(a.out)))


if __name__ == "__main__":
    main()
