"""Greedy output of plain HF transformers for several state dicts of one model, in one process.

    python hf_reference.py BASE_MODEL_DIR N PROMPT_IDS FILE.safetensors ...

Runs in the vLLM test environment (transformers lives there). ``PROMPT_IDS`` is a comma
separated list. Prints a JSON list: for each file, the N greedy token ids after the prompt
(an eos is just another token, as with vLLM's ``ignore_eos``).
"""

import json
import sys

import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM


def main() -> None:
    base, n, ids, *files = sys.argv[1:]
    config = AutoConfig.from_pretrained(base)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    prompt = torch.tensor([[int(i) for i in ids.split(",")]])
    out = []
    for f in files:
        missing, unexpected = model.load_state_dict(load_file(f), strict=False)
        assert not unexpected, unexpected
        assert all("rotary_emb" in m for m in missing), missing
        with torch.no_grad():
            got = model.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                max_new_tokens=int(n),
                do_sample=False,
                pad_token_id=config.pad_token_id,
                eos_token_id=None,
            )
        out.append(got[0, prompt.shape[1] :].tolist())
    print(json.dumps(out))


if __name__ == "__main__":
    main()
