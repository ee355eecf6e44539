"""Greedy output of plain HF transformers for the weights of a checkpoint directory.

    python hf_reference.py BASE_MODEL_DIR CHECKPOINT_DIR N ID ID ...

Runs in the SGLang test environment (transformers lives there). The config comes from the base
model; every tensor from CHECKPOINT_DIR's safetensors files (an asyncsync LocalCheckpoint: an
HF index plus shards). Prints a JSON list of the N greedy token ids after the prompt ids.
"""

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM


def main() -> None:
    base, ckpt, n, *ids = sys.argv[1:]
    config = AutoConfig.from_pretrained(base)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32).eval()
    state: dict[str, torch.Tensor] = {}
    for f in sorted(Path(ckpt).glob("*.safetensors")):
        state.update(load_file(f))
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    assert all("rotary_emb" in m for m in missing), missing
    model.generation_config.eos_token_id = None
    prompt = torch.tensor([[int(i) for i in ids]])
    with torch.no_grad():
        out = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=int(n),
            do_sample=False,
            pad_token_id=config.pad_token_id,
            eos_token_id=None,  # like SGLang's ignore_eos: an eos is just another token
        )
    print(json.dumps(out[0, prompt.shape[1] :].tolist()))


if __name__ == "__main__":
    main()
