"""Host-to-device copies that do not wait for the device.

`torch.tensor(data, device="cuda")` and `cpu_tensor.to("cuda")` synchronize the stream after the
copy: the host stops until every kernel queued before it has run. The engine copies a few small
tensors per step (token ids, attention metadata, sampling settings, indices); on a host-bound GPU
those waits keep the host from queuing the next kernels while the device works. A non-blocking
copy from ordinary (pageable) host memory is safe: the data is staged before the call returns.
On the CPU both calls return the tensor as it is.
"""

from __future__ import annotations

import torch


def upload(data, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A tensor of `data` (a list, or a host tensor) on `device`."""
    return torch.as_tensor(data, dtype=dtype).to(device, non_blocking=True)
