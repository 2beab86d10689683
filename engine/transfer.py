"""Host-to-device copies that never block the host.

A copy from ordinary (pageable) host memory makes the host wait until the device has finished everything
queued before it. The engine prepares step N+1 while step N still runs, so that wait would serialize the two;
staging through pinned memory lets the copy queue behind step N while the host moves on."""
from __future__ import annotations

import torch


def to_device(data, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A list (or CPU tensor) as a tensor on `device`, copied asynchronously when `device` is a GPU."""
    t = data if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype)
    if device.type != "cuda":
        return t.to(dtype)
    return t.to(dtype).pin_memory().to(device, non_blocking=True)
