"""The one place that papers over torch-version differences in torch.distributed.

torch 2.13 renamed `all_gather_into_tensor` / `reduce_scatter_tensor` to `all_gather_single` /
`reduce_scatter_single` (the old names warn); torch 2.11 has only the old names.
"""

from __future__ import annotations

import torch.distributed as dist

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
"""all_gather_single(output, input, group=None, async_op=False): concatenate along dim 0."""

reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
"""reduce_scatter_single(output, input, op=SUM, group=None, async_op=False): split along dim 0."""
