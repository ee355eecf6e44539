"""Stand-ins for slime in the compatibility tests (nothing here is slime's code).

* :mod:`.rules`: slime's weight-update argument definitions at 90c212b5c (gen1) and 624b824a8
  (gen2), written as data, and the behaviour of its validation functions
  (``_resolve_update_weight_disk_dir``, ``_validate_update_weight_args``, the weight-update part
  of ``slime_validate_args``), rewritten from their documented behaviour so the tests can run
  the same inputs through slime's rules and asyncsync's;
* :mod:`.megatron`: a tiny Llama-like model as slime's getter gives it (Megatron global names,
  tensor-parallel shards) and a converter that gathers the shards over ``torch.distributed``
  and renames them as slime's ``convert_to_hf`` does for Llama/Qwen;
* :mod:`.actor_loop`: one trainer rank running slime's actor loop (a subprocess per rank).
"""
