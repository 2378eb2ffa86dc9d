"""Which copies the attention's layout costs around torch SDPA on the GPU: q, k, v cut from the
fused QKV output as models/blocks.py `Attention.attend` does ((s, b, heads, 3, d) storage viewed
as (b, heads, s, d)), the output's strides per backend, whether the (s, b, heads*d) reshape after
it copies, and the strides of the gradients SDPA returns (a non-contiguous one costs the split's
backward a strided cat).

    python3 scripts/debug/sdpa_layouts.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

s, b, heads, d = 2048, 4, 16, 128
qkv = torch.randn(s, b, heads, 3, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION):
    q, k, v = (t.reshape(s, b, heads, d).permute(1, 2, 0, 3)
               for t in qkv.split([1, 1, 1], dim=3))
    with sdpa_kernel(backend):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=0.1)
    context = out.permute(2, 0, 1, 3)
    flat = context.reshape(s, b, heads * d)
    grads = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    print(backend.name, "q strides", q.stride(), "out strides", tuple(out.stride()),
          "reshape copies:", flat.data_ptr() != out.data_ptr(),
          "grad strides", [tuple(g.stride()) for g in grads],
          "grads contiguous:", [g.is_contiguous() for g in grads])
