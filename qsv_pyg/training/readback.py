"""The training loop's metrics on their way to the host without a host sync
(issue 32 item 3): a pinned buffer, a non-blocking copy and an event, read one
step late (:class:`Readback`)."""
from __future__ import annotations

from typing import Any

import torch


def copy_event(device: torch.device) -> Any:
    """An event marking a queued device-to-host copy: a :class:`torch.cuda.Event`
    on CUDA, :obj:`None` on the CPU (there the copy is done when ``copy_`` returns)."""
    return torch.cuda.Event() if device.type == "cuda" else None


class Readback:
    r"""Each step's ``[loss, correct]`` on its way to the host, read one step late.

    :meth:`push` queues a copy of the device tensor into one of two host
    buffers (pinned on CUDA, so the copy is asynchronous: ``non_blocking=True``)
    and records an event after it on the current stream; nothing waits.
    :meth:`read` waits for *that* event only (the work queued up to the step that
    pushed it), then reads the host buffer. The loop reads step :math:`t`'s values
    after step :math:`t + 1` is queued, so the device always has a step to run
    while the host waits; reading with ``.tolist()`` on the device tensor
    instead would wait for everything queued so far, step :math:`t + 1` included.
    Two buffers: a push never overwrites the values still to be read.
    """

    def __init__(self, device: torch.device):
        self.device = device
        pinned = device.type == "cuda"
        self.buffers = [torch.empty(2, dtype=torch.float32, pin_memory=pinned)
                        for _ in range(2)]
        self.events: list = [None, None]
        self._next = 0

    def push(self, values: torch.Tensor) -> int:
        """Queue the copy of ``values`` ``[2]``; returns the slot for :meth:`read`."""
        slot, self._next = self._next, 1 - self._next
        self.buffers[slot].copy_(values.detach(), non_blocking=True)
        event = copy_event(self.device)
        if event is not None:
            event.record()
        self.events[slot] = event
        return slot

    def read(self, slot: int) -> list:
        """The values pushed into ``slot``, waiting only for their own copy."""
        event, self.events[slot] = self.events[slot], None
        if event is not None:
            event.synchronize()
        return self.buffers[slot].tolist()  # host memory: no device sync
