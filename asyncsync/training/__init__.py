"""What a training loop touches: one validated configuration (:mod:`~asyncsync.training.config`,
:mod:`~asyncsync.training.settings`), the factory (:mod:`~asyncsync.training.factory`),
:class:`~asyncsync.training.session.SyncSession` for synchronous code with bounded staleness
(:mod:`~asyncsync.training.staleness`), and the framework integrations.

Each integration is a module of its own, imported explicitly (none is imported here, so a
framework's optional dependencies are never needed by plain asyncsync users):

* :mod:`asyncsync.training.slime`: slime's ``--update-weight-*`` arguments and a weight updater
  with slime's shape, built by ``create_weight_updater(args, model, weights_getter, ...)``.
"""
