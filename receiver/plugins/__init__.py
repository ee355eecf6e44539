"""Plugins that run inside an inference engine's own process.

``receiver.plugins.sglang_loader``: an SGLang plugin (entry-point group
``sglang.srt.plugins``, name ``asyncsync``, value ``receiver.plugins.sglang_loader:register``)
that makes ``update_weights_from_disk`` on an asyncsync checkpoint load only changed tensors.
These modules import without the engine installed.
"""
