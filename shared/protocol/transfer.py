"""Host-to-device copies that do not stall the host: values gathered on the host go to the
device in one copy from pinned memory (on CUDA), queued behind the work already on the stream.

A copy from pageable memory is a host sync on CUDA (the host waits for the stream to reach it);
one from pinned memory with ``non_blocking`` is not (PyTorch's pinned-memory cache keeps the
source alive until the copy has run). Elsewhere both are the plain tensor.
"""

from __future__ import annotations

from typing import ClassVar

import torch


def to_device(values: list[int] | list[float] | list[bool], dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
    """``values`` as a tensor on ``device``, in one non-blocking copy from pinned memory."""
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


class Upload:
    """Host integers for one forward, copied to the device at once: ``add`` a list, get back
    its index; ``send`` makes one copy (``to_device``), and ``get`` slices it on the device.
    ``Upload.count`` counts the copies (tests read it)."""

    count: ClassVar[int] = 0

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.parts: list[list[int]] = []
        self.flat: torch.Tensor | None = None
        self.offsets: list[int] = [0]

    def add(self, values: list[int]) -> int:
        assert self.flat is None, "add after send"
        self.parts.append(values)
        self.offsets.append(self.offsets[-1] + len(values))
        return len(self.parts) - 1

    def send(self) -> Upload:
        self.flat = to_device([v for part in self.parts for v in part] or [0], torch.long,
                              self.device)
        Upload.count += 1
        return self

    def get(self, index: int) -> torch.Tensor:
        assert self.flat is not None, "get before send"
        return self.flat[self.offsets[index]:self.offsets[index + 1]]
