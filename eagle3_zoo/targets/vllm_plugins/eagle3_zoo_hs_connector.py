"""A CPU-safe hidden-states connector for vLLM's `extract_hidden_states` speculative method.

vLLM's `ExampleHiddenStatesConnector` copies the cached hidden states device-to-host on a CUDA stream into pinned
memory and writes them from a thread pool; on a CPU build the first request fails (no CUDA streams/events, no
pinned memory). This subclass replaces only that asynchronous write with a synchronous one: gather the request's
slots from the cache, clone them, write the safetensors file (to a temporary name, then rename, so a reader never
sees half a file) and release the file lock. Everything else (scheduling, lock files, the `hidden_states_path` in
the response) is the stock connector's. Runs inside the vLLM process; imports vllm only.
"""

from __future__ import annotations

import fcntl
import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)


class _Done:
    """Stands in for the CUDA event the stock `get_finished` polls: the copy is complete when it is recorded."""

    def query(self) -> bool:
        return True


class CPUHiddenStatesConnector(ExampleHiddenStatesConnector):
    """`ExampleHiddenStatesConnector` with a synchronous extract-and-save (no CUDA streams, events or pinned memory)."""

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (offsets.reshape(1, -1) + block_ids.reshape(-1, 1) * self._block_size).flatten()
        num_tokens = pending.token_ids.shape[0]
        hidden = extract_from_kv_cache(self._kv_cache, slots.to(self._kv_cache.device), num_tokens)
        tensors = {"hidden_states": hidden.to("cpu").clone().contiguous(),
                   "token_ids": pending.token_ids.clone().contiguous()}
        os.makedirs(os.path.dirname(pending.filename) or ".", exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        try:
            tmp = f"{pending.filename}.tmp-{os.getpid()}"
            save_file(tensors, tmp)
            os.replace(tmp, pending.filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases LOCK_EX: readers blocked on LOCK_SH proceed
        self._req_copy_events[pending.req_id] = _Done()
