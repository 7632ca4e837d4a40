"""What fits where: memory of a training job, predicted before it runs (``draftsmith plan``).

- :mod:`.simulate`: runs a recipe's own training step (target forward, drafter loss, backward,
  optimizer step) on fake tensors -- shapes and dtypes, no data, no compute -- and records the
  bytes alive after every operation: the step's activation peak, exactly as the code allocates.
- :mod:`.memory`: adds what does not depend on the step (weights, gradients, optimizer state,
  DDP buckets, FSDP shards and gathers, runtime) per device, says whether the job fits, and what
  would (micro-batch, sequence length, offline features, FSDP, more GPUs).
The ``draftsmith plan`` command line is ``recipes/plan.py``.
"""
