"""What runs inside an inference engine's own process (these modules import without the
engine installed).

Engine-agnostic (a plugin for any engine whose model has ``load_weights``):

* ``routing``: an XOR delta routed through the model's own ``load_weights``, writes recorded
  and checked to be plain copies; ``scatter``: the sparse plan of a routed tensor (changed
  positions mapped into the parameters, O(changed));
* ``stage``: the staged delta the receiver writes before it pauses the engine, and its reader;
* ``held``: what a model holds (the base an apply checks), verified reads of the checkpoint;
* ``inplace``: ``InEngineLoader``, one per model: a stage applied in place, else the checkpoint;
* ``audit``: the background audit of the served bytes and its per-rank record.

``sglang_loader``: the SGLang plugin (entry-point group ``sglang.srt.plugins``, name
``asyncsync``, value ``receiver.plugins.sglang_loader:register``). docs/ENGINES.md.
"""
