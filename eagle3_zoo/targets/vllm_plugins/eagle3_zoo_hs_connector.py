"""Hidden-states connectors for vLLM's `extract_hidden_states` speculative method, handing each file over by rename.

vLLM's `ExampleHiddenStatesConnector` writes each request's safetensors file in place and lets readers wait on a
companion lock file (`flock`). A reader on another node of a shared filesystem cannot rely on that: Lustre without
``-o flock`` and NFS with ``local_lock`` give it a lock that excludes nothing, so it can read half a file. Both
connectors here write the file under a temporary name and rename it (`eagle3_zoo_hs_files.save_atomically`): the
final name is the completion signal, and the server runs them with vLLM's lock files turned off
(``use_synchronization_lock: false``).

- `AtomicHiddenStatesConnector` (GPU builds): the stock connector (asynchronous device-to-host copies into pinned
  memory, a pool of writer threads) with only its writer's save replaced.
- `CPUHiddenStatesConnector` (CPU builds): the stock connector's CUDA streams, events and pinned memory fail on a CPU
  build at the first request, so its asynchronous write is replaced by a synchronous extract-and-save.

Everything else (scheduling, the `hidden_states_path` in the response) is the stock connector's. Runs inside the
vLLM process (the folder is on its ``PYTHONPATH``); imports vllm, never eagle3_zoo.
"""

from __future__ import annotations

import fcntl
import inspect
import os

import torch
from eagle3_zoo_hs_files import save_atomically
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)

# the writer this module replaces, as vLLM 0.32 calls it; another vLLM that calls it otherwise would write in place
# unnoticed, so the server refuses to start instead
_WRITER = ["tensors", "event", "filename", "lock_fd"]
if list(inspect.signature(ExampleHiddenStatesConnector._write_tensors).parameters) != _WRITER:
    raise ImportError("eagle3_zoo_hs_connector: this vLLM's ExampleHiddenStatesConnector._write_tensors takes "
                      f"{list(inspect.signature(ExampleHiddenStatesConnector._write_tensors).parameters)}, not "
                      f"{_WRITER} (vLLM 0.32): its files would not be handed over by rename; use vLLM 0.32")


class _Done:
    """Stands in for the CUDA event the stock `get_finished` polls: the copy is complete when it is recorded."""

    def query(self) -> bool:
        return True


class AtomicHiddenStatesConnector(ExampleHiddenStatesConnector):
    """`ExampleHiddenStatesConnector` whose writer threads save each file under a temporary name and rename it."""

    @staticmethod
    def _write_tensors(tensors: dict[str, torch.Tensor], event: torch.cuda.Event, filename: str,
                       lock_fd: int | None) -> None:
        try:
            event.synchronize()  # the asynchronous device-to-host copy into pinned memory
            save_atomically(tensors, filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases LOCK_EX, when vLLM's lock files are on


class CPUHiddenStatesConnector(AtomicHiddenStatesConnector):
    """The connector with a synchronous extract-and-save (no CUDA streams, events or pinned memory)."""

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
            save_atomically(tensors, pending.filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases LOCK_EX: readers blocked on LOCK_SH proceed
        self._req_copy_events[pending.req_id] = _Done()
