"""The trainer side: publish versions of a state dict into a root (mirrors ``receiver/``).

:mod:`~asyncsync.publish.publisher` (the :class:`Publisher` and its one pipeline),
:mod:`~asyncsync.publish.snapshot` (the CPU snapshot of the last committed version),
:mod:`~asyncsync.publish.writer` (the write stage: shard files and the entries they make),
:mod:`~asyncsync.publish.commit` (making a version durable and committing its manifest),
:mod:`~asyncsync.publish.ranked` (the multi-rank commit, a collaborator of the publisher),
:mod:`~asyncsync.publish.group`, :mod:`~asyncsync.publish.merge` and
:mod:`~asyncsync.publish.distributed` (the multi-rank protocol, part records, coordinators),
:mod:`~asyncsync.publish.retention` (ack-aware deletion), :mod:`~asyncsync.publish.hooks`,
:mod:`~asyncsync.publish.stats` and :mod:`~asyncsync.publish.hf` (registering an HF checkpoint).

The public names are re-exported by :mod:`asyncsync`; import them from there.
"""
