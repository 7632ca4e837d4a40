"""The training core every recipe shares: config, run setup, checkpoints, stopping, data order.

Each recipe (``recipes/eagle.py``, ``recipes/medusa.py``, ``recipes/distill.py``) keeps its own
objective and loop, top to bottom; what is the same in all three lives here, once:

* :mod:`.config` -- :class:`~.config.TrainConfig`, the fields every recipe has, with ranges.
* :mod:`.run` -- :class:`~.run.TrainRun`: process group (with a timeout), accelerator, output
  lock and ownership, resume, the per-step stop/non-finite verdict agreed by all ranks, the
  best-validation drafter, clean teardown.
* :mod:`.checkpoint` -- one checkpoint shape (``accelerate`` state + ``trainer_state.json``),
  written into a temp dir and renamed, found with fallback to the previous good one, rotated
  without ever deleting the last good or the best one.
* :mod:`.schedule` -- the warm-up + cosine learning-rate schedule, and its fit to
  ``max_minutes`` from the measured step rate (``fit_schedule``).
* :mod:`.stop` -- SIGINT/SIGTERM handling and non-finite detection.
* :mod:`.data` -- the train/validation split, the data position (epoch, batches consumed), EOS
  ids, and the "too little data" check.
* :mod:`.dist` -- process-group timeout, workers that die with their launcher, teardown.
* :mod:`.accelerate_compat` -- the few accelerate internals used (no public API for them),
  each checked by ``tests/test_accelerate_compat.py``.
"""
