"""Stand-ins for slime in the compatibility tests (nothing here is slime's code).

* :mod:`.rules`: slime's weight-update facts at 90c212b5c (gen1), c74877886 (gen2a) and
  624b824a8 (gen2), written down from its source: the argument definitions as data, the
  behaviour of its validation functions and of its actor's updater choice, and the call
  sequences and contracts (start version, ``connect_rollout_engines`` keywords, the hook, the
  converter's parameters, who reloads the engines);
* :mod:`.fake_slime`: slime's ``HfWeightIteratorDirect`` as each revision's signatures define
  it, and the part of its engine actor the updater calls (in process, or as a Ray actor);
* :mod:`.megatron`: a tiny Llama-like model as slime's getter gives it (Megatron global names,
  tensor-parallel shards) and a converter that gathers the shards over ``torch.distributed``
  and renames them as slime's ``convert_to_hf`` does for Llama/Qwen;
* :mod:`.actor_loop`: one trainer rank running slime's actor loop (a subprocess per rank);
* :mod:`.hooks`: slime hooks that record when and where they ran.
"""
