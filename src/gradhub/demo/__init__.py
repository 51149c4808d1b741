"""The bundled demo (``gradhub demo``): its data, models and per-process job.

- :mod:`.threads`: the digits data set and a softmax classifier trained by
  worker threads through a :class:`~gradhub.DistributedGradientsCoordinator`.
- :mod:`.job`: one process of a demo job (``python -m gradhub.demo.job``),
  an MLP trained by :class:`~gradhub.DataParallelTrainer`.

Nothing in the library imports this package; :mod:`gradhub.cli.demo` does.
"""
