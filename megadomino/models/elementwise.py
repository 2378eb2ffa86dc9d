"""The layer's element-wise pieces as plain functions, run eagerly or each compiled on its own by
torch.compile (`ParallelConfig.compile_layer_pieces`, `--compile-layer-pieces`).

Between the GEMMs and attention a layer spends a fifth (GPT) to a third (Llama) of its time in
element-wise traffic: the bias + dropout + residual add after each reduce, the norms, GELU or
SwiGLU, rotary, the QKV split's backward. The pieces own the linears' biases (the projections'
in the residual add, fc1's in the activation when compiled, QKV's gradient in the split's
backward), so a bias's add and its gradient's sum ride on a pass that runs anyway. Eagerly
each is several kernels that each read and write the whole activation;
compiled, each piece is one or two fused kernels forward and backward. Pieces are compiled one by
one (regional compilation), not the layer: every execution strategy (plain, recompute, Domino's
schedule, CUDA graphs) calls the same pieces, and the GEMMs, collectives and SDPA stay outside
the compiled regions, so no collective or custom autograd Function is ever traced.

Compiled with `dynamic=False`: shapes are fixed by the run (micro-batch, sequence, Domino's at
most two slice sizes), so each piece compiles once per shape, grad mode and train/eval, all in
the first training and evaluation steps. The eager functions are the reference: the compiled ones
equal them up to floating-point reassociation (fp32 within 1e-5 relative).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from megadomino.kernels.bias_grad import gelu_bias_backward


def bias_dropout_add(x: torch.Tensor, y: torch.Tensor, bias: torch.Tensor | None,
                     p: float) -> torch.Tensor:
    """x + dropout_p(y (+ bias)): the residual add of a sub-block's reduced output (p = 0 when
    not training). Dropout draws from the current default generator, so a caller forks the TP RNG
    tracker around the call where the activation is sharded."""
    if bias is not None:
        y = y + bias
    if p > 0.0:
        y = F.dropout(y, p, training=True)
    return x + y


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               eps: float) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def gelu(h: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """GELU with the tanh approximation (GPT-3's) of h (+ fc1's bias, when fc1 left it out: the
    add rides on this piece's read of h; compiled, `_BiasGelu` sums the bias's gradient as its
    backward writes dh)."""
    return F.gelu(h if bias is None else h + bias, approximate="tanh")


def swiglu(gate: torch.Tensor, up: torch.Tensor, gate_bias: torch.Tensor | None = None,
           up_bias: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up, each (+ its half of fc1's bias when fc1 left it out)."""
    if gate_bias is not None:
        gate, up = gate + gate_bias, up + up_bias
    return F.silu(gate) * up


def qkv_grad(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor,
             bias: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The QKV split's backward: the gradients of q (s, b, groups, hpg, d), k and v (s, b,
    groups, 1, d) assembled into the fused projection's interleaved layout (s, b, groups, hpg+2,
    d), and, with `bias`, the projection bias's gradient: its sum over s and b, flattened.
    Compiled, the cat is one kernel (torch's cat of the three strided gradients is a slow
    non-vectorized copy); the sum is a second kernel that reads dqkv again."""
    dqkv = torch.cat([dq, dk, dv], dim=3)
    return dqkv, (dqkv.sum((0, 1)).flatten() if bias else None)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. x: (s, b, heads, d); cos/sin: (s, 1, 1, d) or broadcastable. Computed in
    fp32, returned in x's dtype."""
    half = x.shape[-1] // 2
    xf = x.float()
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


_PIECES = ("bias_dropout_add", "layer_norm", "rms_norm", "gelu", "swiglu", "rotary", "qkv_grad")

EAGER = SimpleNamespace(**{name: globals()[name] for name in _PIECES})
"""The pieces run eagerly (the reference)."""


class _BiasGelu(torch.autograd.Function):
    """gelu(h + bias) by the compiled piece `forward`; backward by one Triton pass
    (kernels/bias_grad.py) that writes dh and sums the bias's gradient as it goes, where the
    compiled backward reads dh again for the sum."""

    @staticmethod
    def forward(ctx, h, bias, forward):
        ctx.save_for_backward(h, bias)
        return forward(h, bias)

    @staticmethod
    def backward(ctx, grad):
        h, bias = ctx.saved_tensors
        width = h.shape[-1]
        dh, dbias = gelu_bias_backward(grad.reshape(-1, width).contiguous(),
                                       h.reshape(-1, width).contiguous(), bias)
        return dh.view(h.shape), dbias, None


def _fused_gelu(compiled_gelu):
    def gelu(h: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if bias is None or not torch.is_grad_enabled():
            return compiled_gelu(h, bias)
        return _BiasGelu.apply(h, bias, compiled_gelu)
    return gelu


@functools.cache
def compiled() -> SimpleNamespace:
    """The pieces, each wrapped by torch.compile (compiled on first call). Cached: one wrapper per
    piece for the process, so every layer shares its compiled code. GELU with fc1's bias runs
    its backward as a Triton kernel that sums the bias's gradient as it writes dh
    (kernels/bias_grad.py: torch.compile reads dh again for the sum); on CPU, its torch
    reference."""
    pieces = {name: torch.compile(getattr(EAGER, name), dynamic=False) for name in _PIECES}
    pieces["gelu"] = _fused_gelu(pieces["gelu"])
    return SimpleNamespace(**pieces)


def pieces(compile_pieces: bool) -> SimpleNamespace:
    """The element-wise pieces a layer runs: compiled ones when asked, else the eager ones."""
    return compiled() if compile_pieces else EAGER


def compile_seconds() -> float | None:
    """Seconds torch.compile has spent compiling in this process (dynamo's own timer), or None
    where this torch does not keep it."""
    from torch._dynamo.utils import compilation_time_metrics

    times = compilation_time_metrics.get("_compile.compile_inner")
    return None if times is None else float(sum(times))
