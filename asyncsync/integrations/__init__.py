"""Adapters that let a training framework use asyncsync through its own conventions.

Each integration is a module of its own, imported explicitly (none is imported here, so a
framework's optional dependencies are never needed by plain asyncsync users):

* :mod:`asyncsync.integrations.slime`: slime's ``--update-weight-*`` arguments and a weight
  updater with slime's shape, built by ``create_weight_updater(args, model, weights_getter, ...)``.
"""

__all__: list[str] = []
