"""Logit-DP (Kong et al.; spec §4): private contrastive / spreadout training of embedding models.

A batch is ``n`` positive pairs ``(x_i, x'_i)``; ``u_i``, ``v_j`` are the L2-normalized embeddings of
``x_i`` and ``x'_j`` and the logits are ``Z_ij = cos_ij / tau`` with ``cos_ij = <u_i, v_j>``.
The loss gradient is ``sum_ij a_ij grad Z_ij`` with ``a_ij = dL/dZ_ij``.  Logit-DP clips every pair
gradient ``g_ij = grad_w cos_ij`` to norm ``B`` and releases ``gbar = sum_ij a_ij Clip_B(g_ij) / tau``
plus Gaussian noise calibrated to its add/remove-one-pair sensitivity (:func:`logit_dp_sensitivity`).

No ``n^2`` parameter-sized gradients are built: ``g_ij = J_i^T v_j + J'_j^T u_i`` (``J`` the Jacobian
of the normalized embedding), so ``||g_ij||^2 = v_j^T J_i J_i^T v_j + 2 <J_i^T v_j, J'_j^T u_i> +
u_i^T J'_j J'_j^T u_i``, formed per layer from outer-product factors (``nn.Linear``) or per-example
Jacobian blocks (other layers) without any pair-sized parameter vector (:func:`pair_gradient_norms`).  Then
``lambda_ij = a_ij min(1, B / ||g_ij||)`` (detached) and one backward pass through
``sum_ij lambda_ij Z_ij`` yields ``gbar``.  Any upper bound on ``||g_ij||`` that depends on the pair alone keeps
``||Clip_B(g_ij)|| <= B`` and so the sensitivity: ``cross_term="cauchy_schwarz"`` uses one for the Jacobian
blocks, whose exact cross term is the costly part of a convolutional encoder's step.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, jacrev, vmap
from torch.nn.modules.utils import _pair

from ..privacy.certified import whole_number
from ..privacy.accounting import check_positive_finite
from ..privacy.certified import UNDERFLOW_MARGIN, ieee_matmul
from ..privacy.input_guard import (active_torch_mode, check_precision, global_hooks_registered, module_hooks,
                                   replaced_forward, saved_tensor_hooks_active)

__all__ = [
    "CONTRASTIVE_LOSSES",
    "LOSS_FUNCTIONS",
    "normalized_embedding",
    "similarity_logits",
    "pair_logits",
    "contrastive_loss",
    "spreadout_loss",
    "logit_gradient",
    "logit_dp_sensitivity",
    "naive_dp_sensitivity",
    "CROSS_TERMS",
    "pair_gradient_norms",
    "clip_factors",
    "logit_dp_gradient",
    "naive_dp_gradient",
    "nonprivate_gradient",
]



def normalized_embedding(encoder: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``Phi(x) / ||Phi(x)||`` per example, shape ``(n, d)``."""
    e = encoder(x)
    if e.dim() != 2:
        # per-example shape only: a Poisson batch's size is secret
        raise ValueError(f"the encoder must return (batch, embedding_dim), got per-example shape {tuple(e.shape[1:])}")
    return F.normalize(e, dim=1)


def similarity_logits(u: torch.Tensor, v: torch.Tensor, tau: float) -> torch.Tensor:
    """``Z_ij = <u_i, v_j> / tau``."""
    return u @ v.T / tau


def pair_logits(encoder: nn.Module, xa: torch.Tensor, xb: torch.Tensor, tau: float) -> torch.Tensor:
    """``Z_ij = cos(Phi(xa_i), Phi(xb_j)) / tau`` for a batch of pairs."""
    return similarity_logits(normalized_embedding(encoder, xa), normalized_embedding(encoder, xb), tau)


def contrastive_loss(z: torch.Tensor) -> torch.Tensor:
    """InfoNCE summed over the batch: ``sum_i -log softmax(Z_i)_i``."""
    if z.shape[0] == 0:
        return z.sum()
    return F.cross_entropy(z, torch.arange(z.shape[0], device=z.device), reduction="sum")


def spreadout_loss(z: torch.Tensor) -> torch.Tensor:
    """``sum_i sum_{j != i} Z_ij^2 / (n - 1)`` (0 for ``n <= 1``)."""
    n = z.shape[0]
    if n <= 1:
        return z.sum() * 0.0
    off = z - torch.diag_embed(torch.diagonal(z))
    return (off**2).sum() / (n - 1)


def spectral_loss(z: torch.Tensor) -> torch.Tensor:
    """Spectral contrastive loss (HaoChen et al., 2021): ``sum_i (-2 Z_ii + sum_{j != i} Z_ij^2 / (n - 1))``.

    On ``Z = cos / tau`` it is ``tau^-2`` times ``-2 tau cos_ii + sum cos_ij^2 / (n - 1)``: a smaller ``tau``
    weighs pushing other pairs apart more, as the contrastive temperature does, but its coefficients stay
    polynomial in ``1/tau`` (no softmax), and so does the Logit-DP sensitivity."""
    return -2.0 * torch.diagonal(z).sum() + spreadout_loss(z)


LOSS_FUNCTIONS: Dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "contrastive": contrastive_loss,
    "spreadout": spreadout_loss,
    "spectral": spectral_loss,
}
CONTRASTIVE_LOSSES = tuple(LOSS_FUNCTIONS)


def _check_loss(loss: str, tau: float) -> None:
    if loss not in CONTRASTIVE_LOSSES:
        raise ValueError(f"loss must be one of {CONTRASTIVE_LOSSES}, got {loss!r}")
    check_positive_finite(tau, "temperature tau")
    if loss == "spreadout" and tau != 1.0:
        raise ValueError("the spreadout sensitivity 6B (spec §4) holds for tau = 1 only")


def logit_gradient(z: torch.Tensor, loss: str, tau: Optional[float] = None) -> torch.Tensor:
    """``a_ij = dL/dZ_ij``: ``softmax(Z)_ij - [i == j]`` (contrastive); ``2 Z_ij / (n-1)``, ``j != i`` (spreadout),
    and ``-2`` on the diagonal (spectral).  With ``tau``, the polynomial losses' ``Z`` is first clamped to
    ``[-1/tau, 1/tau]`` in float64: their sensitivities assume ``|cos| <= 1``, which rounding can break by ulps."""
    n = z.shape[0]
    z = z.detach()
    if tau is not None and loss != "contrastive":
        z = z.double().clamp(-1.0 / tau, 1.0 / tau)
    if loss == "contrastive":
        return torch.softmax(z, dim=1) - torch.eye(n, dtype=z.dtype, device=z.device)
    if loss in ("spreadout", "spectral"):
        off = torch.zeros_like(z) if n <= 1 else 2.0 * (z - torch.diag_embed(torch.diagonal(z))) / (n - 1)
        return off - 2.0 * torch.eye(n, dtype=z.dtype, device=z.device) if loss == "spectral" else off
    raise ValueError(f"loss must be one of {CONTRASTIVE_LOSSES}, got {loss!r}")


def _check_clip_norm(clip_norm: float, name: str) -> None:
    check_positive_finite(clip_norm, f"clip norm {name}")


def logit_dp_sensitivity(clip_norm: float, tau: float, loss: str = "contrastive",
                         batch_size: Optional[int] = None) -> float:
    """Add/remove-one-pair sensitivity of ``gbar`` (spec §4).

    Contrastive: ``(B/tau)(2 + 2(n-1) q_n)``, ``q_n = e^{2/tau} / (e^{2/tau} + n - 1)``: row ``k`` moves by
    at most ``2``, column ``k`` by ``sum_i p_ik <= (n-1) q_n``, and renormalizing the other rows' softmax
    by another ``(n-1) q_n``.  ``(n-1) q_n`` increases to ``e^{2/tau}``, so with ``batch_size=None`` (Poisson
    batches, whose size is not public) the bound for every ``n`` is ``2 (B/tau)(1 + e^{2/tau})``.
    Spreadout (``tau = 1``): ``6 B`` for every ``n``.  Spectral: ``(2B/tau)(1 + 3/tau)`` for every ``n`` (``8 B``
    at ``tau = 1``).
    """
    _check_loss(loss, tau)
    _check_clip_norm(clip_norm, "B")
    clip_norm += UNDERFLOW_MARGIN  # float32's absolute rounding below its normal range (certified.UNDERFLOW_MARGIN)
    if loss == "spreadout":
        return 6.0 * clip_norm
    if loss == "spectral":
        # gbar = sum_ij a_ij Clip_B(g_ij) / tau, |Z| <= 1/tau. Pair k's row: |a_kk| = 2 and sum_j |a_kj| <= 2/tau;
        # its column: 2/tau; the other rows' 1/(n-1) -> 1/(n-2): sum |2 Z_ij| (1/(n-2) - 1/(n-1)) <= 2/tau over
        # (n-1)(n-2) pairs; the other diagonals do not move.  Every n (a Poisson batch's size is not public).
        value = (clip_norm / tau) * (2.0 + 6.0 / tau)
        if not math.isfinite(value):
            raise ValueError(f"the spectral Logit-DP sensitivity (2B/tau)(1 + 3/tau) overflows at tau = {tau:g}")
        return value
    if batch_size is None:  # sup over n of (n-1) q_n
        column = math.exp(2.0 / tau) if 2.0 / tau < 709.0 else math.inf
    else:  # (n-1) q_n = (n-1) / (1 + (n-1) e^{-2/tau}), which cannot overflow
        n = whole_number(batch_size, "batch_size")  # int() would truncate 2.7 to 2, and the bound grows with n
        column = (n - 1) / (1.0 + (n - 1) * math.exp(-2.0 / tau))
    value = (clip_norm / tau) * (2.0 + 2.0 * column)
    if not math.isfinite(value):
        raise ValueError(f"the contrastive Logit-DP sensitivity 2 (B/tau)(1 + e^(2/tau)) overflows at tau = {tau:g} "
                         "(e^(2/tau) is beyond float range, and so would be the noise): use a temperature "
                         "tau >= 0.01; the noise-to-signal ratio grows like e^(2/tau), tau = 1 is the paper's")
    return value


def naive_dp_sensitivity(clip_norm: float) -> float:
    """Whole-batch gradient clipped to ``C``: add/remove one pair moves it by at most ``2C`` (not ``C``)."""
    _check_clip_norm(clip_norm, "C")
    return 2.0 * (clip_norm + UNDERFLOW_MARGIN)  # float32's absolute rounding below its normal range


# ---------------------------------------------------------------------------------------------------
# Gram blocks of the normalized-embedding Jacobian
# ---------------------------------------------------------------------------------------------------


# Parameter-free modules whose forward is known and acts on each coordinate of each example alone.
_KNOWN_ACTIVATIONS = (nn.ReLU, nn.LeakyReLU, nn.Tanh, nn.Sigmoid, nn.GELU, nn.SiLU, nn.ELU, nn.Softplus,
                      nn.Identity, nn.Flatten)
# Modules whose forward is known and acts on each example alone, but not coordinate-wise: their parameters
# (if any) take a per-example Jacobian block of their own.
_KNOWN_PER_EXAMPLE = (nn.Conv1d, nn.Conv2d, nn.AvgPool1d, nn.AvgPool2d, nn.MaxPool1d, nn.MaxPool2d,
                      nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.LayerNorm, nn.GroupNorm)


def _factored_path_applies(encoder: nn.Module) -> bool:
    """Every module is a plain ``nn.Sequential``, an ``nn.Linear``, a known activation or a known per-example
    layer (convolution, pooling, per-example normalization), without hooks, and no parameter is shared: then
    the ``nn.Linear`` parameters' gradients are exactly per-layer outer products and the others are
    per-example Jacobians of a function of one example."""
    if global_hooks_registered():
        return False
    seen = set()
    for m in encoder.modules():
        if type(m) not in (nn.Sequential, nn.Linear) + _KNOWN_ACTIVATIONS + _KNOWN_PER_EXAMPLE or module_hooks(m):
            return False
    for _, p in encoder.named_parameters(remove_duplicate=False):
        if id(p) in seen:  # tied weights: the gradient is the sum of both uses, not two separate blocks
            return False
        seen.add(id(p))
    return True


def _layer_factors(encoder: nn.Module, x: torch.Tensor, chunk: Optional[int]) -> Optional[Tuple[torch.Tensor, ...]]:
    """Normalized embeddings ``u``, their norms ``r = ||e||`` before normalization, per ``nn.Linear`` a factor:

    - ``("tail", h, has_bias, m, R)`` when the layer's output ``z`` reaches the embedding ``e`` through
      elementwise activations and at most one more ``nn.Linear`` (weight ``R``; ``None`` for none), so that
      ``de/dz = R diag(m_i)`` for a per-example vector ``m_i``: the last two layers of an MLP;
    - ``("deep", h, has_bias, delta)`` otherwise, ``delta[i, a] = d u_i[a] / d z_i`` (``(n, d, out)``);

    ``h`` is the layer's input; the Jacobian of ``u_i[a]`` w.r.t. the weight is the outer product
    ``delta[i, a] h_i^T`` (and ``delta[i, a]`` for the bias).  Only trainable parameters count: a frozen weight
    has ``h`` replaced by a zero column, ``has_bias`` is false for a frozen bias, and a layer frozen whole has no
    factor.  Last, the per-example Jacobian ``(n, d, p)`` of
    ``u`` w.r.t. the trainable parameters of the other layers (convolutions, normalizations), or ``None``.

    Returns ``None`` unless :func:`_factored_path_applies` and every ``nn.Linear`` runs once on ``(n, in)``
    inputs: the factorization would not hold otherwise.  The recorded output is not the tensor handed on (a
    clone is), so in-place activations cannot overwrite it and skip their own derivative.
    """
    if not _factored_path_applies(encoder):
        return None
    leaves = [m for m in encoder.modules() if not isinstance(m, nn.Sequential)]
    linears = [m for m in leaves if isinstance(m, nn.Linear)]
    records: Dict[int, List[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {id(m): [] for m in linears}
    # The order in which the leaves run (a module may be called more than once): with only Sequential
    # containers and one-input layers, this sequence is the whole graph.
    calls: List[nn.Module] = []
    largest = [1]  # values of one example's largest layer input: sets the conv Jacobian's chunk

    def hook(module: nn.Module, args: Tuple[torch.Tensor, ...], out: torch.Tensor) -> torch.Tensor:
        records[id(module)].append((args[0].detach().clone(), args[0], out))
        return out.clone()

    def called(module: nn.Module, args: Tuple[torch.Tensor, ...]) -> None:
        calls.append(module)
        largest[0] = max(largest[0], args[0][0].numel() if args[0].dim() and args[0].shape[0] else 1)

    handles = [m.register_forward_hook(hook) for m in linears]
    handles += [m.register_forward_pre_hook(called) for m in leaves]
    try:
        with torch.enable_grad():
            e = encoder(x)
    finally:
        for h in handles:
            h.remove()
    if e.dim() != 2 or any(len(r) != 1 or r[0][0].dim() != 2 for r in records.values()):
        return None
    linears = [m for m in calls if isinstance(m, nn.Linear)]  # in the order they ran
    u = F.normalize(e, dim=1)
    r = torch.linalg.vector_norm(e.detach(), dim=1)
    outs = [records[id(m)][0][2] for m in linears]
    last = len(linears) - 1
    # de/dz_k = R diag(m): z_k is the last layer's output and only elementwise maps follow it (R = identity),
    # or the one before it with only elementwise maps up to the last layer and identity maps after it.
    # Embeddings near 0 (where normalization is not (I - u u^T) / r) take the general path.
    position = {id(m): max(k for k, c in enumerate(calls) if c is m) for m in linears}
    after_last = calls[position[id(linears[last])] + 1:] if linears else []
    between = calls[position[id(linears[last - 1])] + 1:position[id(linears[last])]] if last >= 1 else []
    elementwise_end = all(isinstance(m, _KNOWN_ACTIVATIONS) for m in after_last)
    plain_end = all(isinstance(m, (nn.Identity, nn.Flatten)) for m in after_last)
    elementwise_between = all(isinstance(m, _KNOWN_ACTIVATIONS) for m in between)
    tail_ok = bool(r.numel() == 0 or r.min() > 1e-6)
    kinds: List[Any] = []
    for k, out in enumerate(outs):
        target, weight = None, None
        if not _trains(linears[k]):  # no gradient to clip; with nothing trained before it, out has no graph
            kinds.append("frozen")
            continue
        if tail_ok and k == last and elementwise_end:
            target = e
        elif tail_ok and k == last - 1 and plain_end and elementwise_between:
            target, weight = records[id(linears[last])][0][1], linears[last].weight
        if target is not None and target.shape == out.shape:
            m = torch.autograd.grad(target, out, grad_outputs=torch.ones_like(target), retain_graph=True)[0]
            kinds.append(("tail", m.detach(), None if weight is None else weight.detach()))
        else:
            kinds.append(None)
    deep = [k for k, kind in enumerate(kinds) if kind is None]
    deltas: Dict[int, torch.Tensor] = {}
    if deep:
        n, d = u.shape
        basis = torch.eye(d, dtype=u.dtype, device=u.device).unsqueeze(1).expand(d, n, d)
        grads = torch.autograd.grad(u, [outs[k] for k in deep], grad_outputs=basis, is_grads_batched=True,
                                    allow_unused=True)
        for k, delta in zip(deep, grads):
            if delta is None:
                delta = torch.zeros((d,) + tuple(outs[k].shape), dtype=outs[k].dtype, device=outs[k].device)
            deltas[k] = delta.permute(1, 0, 2)
    factors = []
    for k, (m, kind) in enumerate(zip(linears, kinds)):
        if kind == "frozen":
            continue
        bias = m.bias is not None and m.bias.requires_grad
        h = records[id(m)][0][0]
        if not m.weight.requires_grad:  # only the bias's ones remain of the outer product's input side
            h = h.new_zeros(h.shape[0], 1)
        factors.append(("deep", h, bias, deltas[k]) if kind is None else ("tail", h, bias, kind[1], kind[2]))
    in_linears = {id(p) for m in linears for p in m.parameters()}
    others = [k for k, p in encoder.named_parameters() if p.requires_grad and id(p) not in in_linears]
    holders = [m for m in leaves if not isinstance(m, nn.Linear) and any(True for _ in m.parameters())]
    if not others:
        jac = None
    elif all(_plain_conv2d(m) for m in holders):
        if chunk is None:
            chunk = min(MAX_CHUNK, max(CHUNK, CHUNK_ELEMENTS // (u.shape[1] * largest[0])))
        jac = _LazyConvJacobian(encoder, holders, x, chunk)
    else:
        jac = _jacobian(encoder, x, chunk or CHUNK, others, u.dtype)
    return u.detach(), r, factors, jac


def _trains(m: nn.Linear) -> bool:
    """Whether the layer has a parameter that gets a gradient (a share of the pair norms)."""
    return bool(m.weight.requires_grad or (m.bias is not None and m.bias.requires_grad))


def _plain_conv2d(m: nn.Module) -> bool:
    """A ``Conv2d`` whose per-example weight gradient is ``delta @ unfold(h)^T``: one group, zero padding."""
    return (type(m) is nn.Conv2d and m.groups == 1 and m.padding_mode == "zeros"
            and not isinstance(m.padding, str))


# Examples whose d cotangents are carried back together when forming a conv Jacobian block, and whose rows of the
# second view's block are formed at once for the cross term.  Measured on the CLI's CNN encoder at n = 1024
# (benchmarks/logit_dp_memory.py --chunk N): 16 took 18-19 s and 837 MB, 64 took 22-23 s and 1139 MB (16 x d rows of
# conv activations at 16 x 28 x 28 are 26 MB per module and stay in cache longer).  Smaller activations take more
# examples at once (fewer, larger products): a chunk's d-fold activations are kept near CHUNK_ELEMENTS values,
# between CHUNK and MAX_CHUNK examples.  The bounded step of Conv 8-16 at batch 1024 went from 1.96-2.38 s (16) to
# 1.15-1.42 s (64) with 2 x 2 input pooling, and from 4.06-4.58 to 3.26-3.96 s (32) without.
CHUNK = 16
MAX_CHUNK = 64
CHUNK_ELEMENTS = 16 * 32 * 16 * 28 * 28


class _LazyConvJacobian:
    """The rows of :func:`_conv_jacobian` for a slice of the examples, computed when asked: the cross term then
    holds one view's block whole and the other's a chunk of examples at a time (at n = 1024 and 4,800 conv
    parameters a block is 629 MB of float32).  The weights must not change between the request and the
    forward pass that recorded ``u``: both happen inside one :func:`_gram_terms` call."""

    def __init__(self, encoder: nn.Module, convs: List[nn.Module], x: torch.Tensor, chunk: int) -> None:
        self.encoder, self.convs, self.x, self.chunk = encoder, convs, x, chunk

    def __len__(self) -> int:
        return self.x.shape[0]

    def rows(self, start: int, stop: int) -> torch.Tensor:
        return _conv_jacobian(self.encoder, self.convs, self.x[start:stop], self.chunk)


def _conv_jacobian(encoder: nn.Module, convs: List[nn.Module], x: torch.Tensor, chunk: int) -> torch.Tensor:
    """Per-example Jacobian ``(n, d, p)`` of the normalized embedding w.r.t. the trainable parameters of
    ``convs`` (plain ``Conv2d`` layers, each run once): ``delta[i, a] = d u_i[a] / d z_i`` at each layer's
    output, then ``J_i[a] = delta[i, a] unfold(h_i)^T`` (and ``sum_positions delta[i, a]`` for the bias).

    The ``d`` directions of a chunk of examples are carried back together as ``chunk x d`` cotangents, module
    by module down the call sequence (:func:`_batched_vjp`): every module of the factored path acts on each
    example alone, so each call's vector-Jacobian product is that of a batch, and no autograd graph of the
    ``d``-fold batch is built."""
    leaves = [m for m in encoder.modules() if not isinstance(m, nn.Sequential)]
    jacobian: Optional[torch.Tensor] = None  # filled chunk by chunk: a final cat would hold the block twice
    for start in range(0, x.shape[0], chunk):
        calls: List[Tuple[nn.Module, torch.Tensor]] = []

        def record(module: nn.Module, args: Tuple[torch.Tensor, ...]) -> None:
            calls.append((module, args[0].detach().clone()))  # before an in-place layer overwrites it

        handles = [m.register_forward_pre_hook(record) for m in leaves]
        try:
            with torch.no_grad():
                e = encoder(x[start : start + chunk])
        finally:
            for h in handles:
                h.remove()
        ran = [m for m, _ in calls]
        if any(sum(m is r for r in ran) != 1 for m in convs):
            raise ValueError("a convolution of the encoder runs more than once per forward pass")
        c, d = e.shape
        basis = torch.eye(d, dtype=e.dtype, device=e.device).repeat(c, 1)  # row i * d + a: e_a
        g = _batched_vjp(lambda t: F.normalize(t, dim=1), e, basis)
        deltas: Dict[int, torch.Tensor] = {}
        first = min(k for k, m in enumerate(ran) if any(m is conv for conv in convs))
        folded = _foldable_after(calls, first, d)
        stop = first + 1 + len(folded) if folded else first
        for k in range(len(calls) - 1, stop - 1, -1):
            m, h = calls[k]
            if any(m is conv for conv in convs):
                deltas[id(m)] = g.reshape(c, d, g.shape[1], -1)  # (c, d, out channels, positions)
            if k > first and (k >= stop or not folded):  # folded: down to the input of calls[stop]
                g = _batched_vjp(m, h, g)
        blocks = []
        for m in convs:
            h = next(h for r, h in calls if r is m)
            if folded and m is calls[first][0]:  # the cotangents stopped above the layers that follow it
                blocks.extend(_folded_conv_rows(m, h, folded, g.reshape(c, d, g.shape[1], -1)))
                continue
            flat = deltas[id(m)]
            if m.weight.requires_grad:
                patches = F.unfold(h, m.kernel_size, dilation=m.dilation, padding=m.padding, stride=m.stride)
                blocks.append(torch.einsum("iaol,ikl->iaok", flat, patches).flatten(2))
            if m.bias is not None and m.bias.requires_grad:
                blocks.append(flat.sum(-1))
        part = torch.cat(blocks, 2)
        if c == x.shape[0]:  # one chunk: no copy into a block
            return part
        if jacobian is None:
            jacobian = part.new_empty((x.shape[0],) + tuple(part.shape[1:]))
        jacobian[start : start + c] = part
    assert jacobian is not None, "no examples"
    return jacobian


def _foldable_after(calls: List[Tuple[nn.Module, torch.Tensor]], first: int, d: int
                    ) -> List[Tuple[nn.Module, torch.Tensor]]:
    """The calls right after the first convolution that act on each channel alone and linearly in its values
    given the input (elementwise activations, average pooling), when carrying the conv's patches forward
    through them is cheaper than carrying the ``d`` cotangents back (the patch length ``in x kh x kw + 1`` is
    below ``d``); otherwise none."""
    conv, _ = calls[first]
    if conv.in_channels * math.prod(_pair(conv.kernel_size)) + 1 >= d:
        return []
    out: List[Tuple[nn.Module, torch.Tensor]] = []
    for m, h in calls[first + 1:]:
        if not (type(m) is nn.AvgPool2d or (isinstance(m, _KNOWN_ACTIVATIONS) and type(m) is not nn.Flatten)):
            break
        if h.dim() != 4 or h.shape[1] != conv.out_channels:
            break
        out.append((m, h))
    return out


def _folded_conv_rows(conv: nn.Module, h: torch.Tensor, folded: List[Tuple[nn.Module, torch.Tensor]],
                      g: torch.Tensor) -> List[torch.Tensor]:
    """The conv's Jacobian rows from the cotangents ``g`` ``(c, d, out channels, positions)`` at the output of the
    channelwise layers ``folded`` that follow it: ``J[a] = (M^T g_a) P^T = g_a (M P)`` for their linear map ``M``
    on each channel (the activations' slopes, then the poolings), so ``M`` runs forward on the patches ``P``
    (and on ones, for the bias) instead of backward on the ``d`` cotangents.  Equal to the backward path up to
    the order of the roundings."""
    patches = F.unfold(h, conv.kernel_size, dilation=conv.dilation, padding=conv.padding, stride=conv.stride)
    c, k, positions = patches.shape
    o = conv.out_channels
    rows, cols = folded[0][1].shape[-2:]
    t = torch.cat([patches, torch.ones_like(patches[:, :1])], 1)  # (c, k + 1, positions): the bias's row last
    t = t.unsqueeze(1).expand(c, o, k + 1, positions).reshape(c, o, k + 1, rows, cols)
    for m, x in folded:
        if type(m) is nn.AvgPool2d:
            t = m(t.reshape(c, o * (k + 1), *t.shape[-2:]))
            t = t.reshape(c, o, k + 1, *t.shape[-2:])
        else:
            t = t * _slope(m, x).unsqueeze(2)
    # (c, d, o, k + 1), as c * o products (k + 1, m) (m, d): 3x faster than the einsum's (d, m) (m, k + 1) order
    by_channel = g.transpose(1, 2).reshape(c * o, g.shape[1], -1)
    rows_ = torch.bmm(t.reshape(c * o, k + 1, -1), by_channel.transpose(1, 2))
    rows_ = rows_.view(c, o, k + 1, -1).permute(0, 3, 1, 2)
    blocks = []
    if conv.weight.requires_grad:
        blocks.append(rows_[..., :k].flatten(2))
    if conv.bias is not None and conv.bias.requires_grad:
        blocks.append(rows_[..., k])
    return blocks


def _slope(module: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """The derivative of an elementwise activation at ``h``, elementwise (the gradient of the sum)."""
    leaf = h.clone().requires_grad_()
    with torch.enable_grad():
        out = module(leaf.clone() if getattr(module, "inplace", False) else leaf)
    return torch.autograd.grad(out.sum(), leaf)[0]


def _tiled_avg_pool_backward(g: torch.Tensor, shape: Tuple[int, ...], size: Tuple[int, int],
                             divisor: Optional[int]) -> torch.Tensor:
    """The backward of average pooling over disjoint ``size`` windows (stride = kernel, no padding, floor mode):
    every input position of a window gets ``g / divisor``, positions no window covers get 0.  Along the columns,
    one product with a 0/1 matrix (each entry is one product by 1 plus zeros, so exactly ``g / divisor`` where
    products are IEEE, which the caller checks); along the rows, copies.  It equals ``avg_pool2d_backward`` bit
    for bit, in about 40% of its time on the CPU at the encoder's shapes (the ``d``-fold batches of the conv
    Jacobian)."""
    rows, cols = shape[-2], shape[-1]
    out_rows, out_cols = g.shape[-2], g.shape[-1]
    spread = (torch.arange(cols, device=g.device)[:, None] // size[1]
              == torch.arange(out_cols, device=g.device)[None, :]).to(g.dtype)  # column c lies in window c // k
    widened = (g / (divisor if divisor is not None else size[0] * size[1])).reshape(-1, out_cols) @ spread.T
    widened = widened.view(-1, out_rows, 1, cols)
    out = g.new_empty((widened.shape[0], rows, cols))
    covered = out_rows * size[0]
    out[:, :covered].view(-1, out_rows, size[0], cols).copy_(widened.expand(-1, out_rows, size[0], cols))
    out[:, covered:].zero_()
    return out.view(shape)


def _dense_avg_pool_backward(g: torch.Tensor, shape: Tuple[int, ...], size: Tuple[int, int],
                             divisor: Optional[int]) -> torch.Tensor:
    """The backward of average pooling over disjoint ``size`` windows (stride = kernel, no padding, floor mode) as
    one product of ``g / divisor`` with the 0/1 matrix of which window holds each input position: every entry of
    the result is one product by 1 plus zeros, so it equals ``avg_pool2d_backward`` bit for bit where products are
    IEEE (the caller checks), positions no window covers included (0)."""
    rows, cols = shape[-2], shape[-1]
    out_rows, out_cols = g.shape[-2], g.shape[-1]
    r = torch.arange(rows, device=g.device)[:, None] // size[0]
    c = torch.arange(cols, device=g.device)[None, :] // size[1]
    window = (r * out_cols + c).flatten()
    covered = ((r < out_rows) & (c < out_cols)).flatten()  # a remainder row or column lies in no window
    spread = ((torch.arange(out_rows * out_cols, device=g.device)[:, None] == window[None, :])
              & covered[None, :]).to(g.dtype)
    scaled = g / (divisor if divisor is not None else size[0] * size[1])
    return (scaled.reshape(-1, out_rows * out_cols) @ spread).view(shape)


def _batched_vjp(module: Callable[[torch.Tensor], torch.Tensor], h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Vector-Jacobian products of a per-example ``module`` at input ``h`` (``c`` examples) with the
    cotangents ``g`` (``c x k`` rows, row ``i * k + a`` for example ``i``).  Linear maps (``nn.Linear``,
    plain convolutions, average pooling, reshapes) need no input; an elementwise activation's derivative is
    taken once per example; any other module goes by autograd through one forward of the repeated input."""
    c = h.shape[0]
    k = g.shape[0] // max(c, 1)
    if type(module) is nn.Linear:
        return g @ module.weight.detach()
    if isinstance(module, nn.Conv2d) and _plain_conv2d(module):
        return torch.nn.grad.conv2d_input((g.shape[0],) + tuple(h.shape[1:]), module.weight.detach(), g,
                                          module.stride, module.padding, module.dilation, module.groups)
    if isinstance(module, (nn.Flatten, nn.Identity)):
        return g.reshape((g.shape[0],) + tuple(h.shape[1:]))
    shape = (g.shape[0],) + tuple(h.shape[1:])
    if type(module) is nn.AvgPool2d:
        size = _pair(module.kernel_size)
        stride = _pair(module.stride if module.stride is not None else module.kernel_size)
        # windows tiling the whole input (torch's own kernel was faster where a remainder is left: 3.3 ms
        # against 6.2 ms from 3 x 3 to 7 x 7, at 2048 x 16 channels)
        if (size == stride and _pair(module.padding) == (0, 0) and not module.ceil_mode
                and g.dtype in (torch.float32, torch.float64) and ieee_matmul(g.device)):
            # small maps by one product with the whole 0/1 window matrix (at 2048 x 16 channels: 7 x 7 to 3 x 3 in
            # 2.1 ms against torch's 3.4, 6 x 6 to 3 x 3 in 0.9 against the tiled form's 4.9; from 9 x 9 to 3 x 3,
            # 729 entries, it was the slowest of the three)
            if g.shape[-2] * g.shape[-1] * shape[-2] * shape[-1] <= 512:
                return _dense_avg_pool_backward(g, shape, size, module.divisor_override)
            if shape[-2] % size[0] == 0 and shape[-1] % size[1] == 0:
                return _tiled_avg_pool_backward(g, shape, size, module.divisor_override)
        return torch.ops.aten.avg_pool2d_backward(g, h.new_zeros(()).expand(shape), size, stride,
                                                  _pair(module.padding), module.ceil_mode,
                                                  module.count_include_pad, module.divisor_override)
    if isinstance(module, _KNOWN_ACTIVATIONS):  # diagonal Jacobian: the gradient of the sum is its diagonal
        return (g.view((c, k) + tuple(h.shape[1:])) * _slope(module, h).unsqueeze(1)).view(shape)
    leaf = h.repeat_interleave(k, dim=0).requires_grad_()
    with torch.enable_grad():
        out = module(leaf.clone() if getattr(module, "inplace", False) else leaf)
    return torch.autograd.grad(out, leaf, g)[0]


def _tail_layer_terms(fa: Tuple, fb: Tuple, u: torch.Tensor, v: torch.Tensor, ra: torch.Tensor,
                      rb: torch.Tensor, c: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    """One layer's share of ``||g_ij||^2`` when ``de/dz = R diag(m)`` on both sides, by ``n x n`` products.

    With ``M_i = (I - u_i u_i^T) / r_i`` (the derivative of normalization), ``alpha_j = R^T v_j``,
    ``beta_i = R^T u_i`` and ``c_ij = u_i . v_j``: ``J_i^T v_j = m_i * (alpha_j - c_ij beta_i) / r_i`` and
    ``J'_j^T u_i = m'_j * (beta_i - c_ij alpha_j) / r'_j``.  Expanding the squares and the cross product
    leaves sums over the layer's width of per-example vectors, i.e. matrix products: ``O(n^2 width)``
    instead of ``O(n^2 d width)``.  Returns the ``n x n`` part, the per-example coefficients of ``c_ij^2``
    (added once for all layers by the caller) and ``S_i = ||m_i||_inf^2 ||R||_F^2 (||h_i||^2 + [bias]) /
    r_i^2``, which bounds the expansions' absolute terms: ``4 S_i`` for ``A``, ``4 sqrt(S_i S'_j)`` for ``C``.
    """
    _, ha, bias, ma, weight = fa
    _, hb, _, mb, _ = fb
    alpha, beta = (v, u) if weight is None else (v @ weight, u @ weight)
    rho2 = float(u.shape[1]) if weight is None else float(weight.double().square().sum())
    fa_ = ((ha * ha).sum(1) + float(bias)) / (ra * ra)  # A's row factor ||h_i||^2 / r_i^2
    fb_ = ((hb * hb).sum(1) + float(bias)) / (rb * rb)
    wa, wb = ma * ma * fa_[:, None], mb * mb * fb_[:, None]
    # A + B = [S1 + T1] - 2c [S2 + T2] + c^2 [s3_i + t3_j], each bracket one product over 2 x width.
    total = torch.cat([wa, beta * beta], 1) @ torch.cat([alpha * alpha, wb], 1).T
    total.sub_(2 * c * (torch.cat([wa * beta, beta], 1) @ torch.cat([alpha, wb * alpha], 1).T))
    squares_a, squares_b = (wa * beta * beta).sum(1), (wb * alpha * alpha).sum(1)
    # 2C = 2 (h_i . h'_j + b) [(1 + c^2) X1 - c (X2 + X3)] / (r_i r'_j)
    sa, sb = ma / ra[:, None], mb / rb[:, None]
    x1 = (sa * beta) @ (sb * alpha).T
    x23 = torch.cat([sa, sa * beta * beta], 1) @ torch.cat([sb * alpha * alpha, sb], 1).T
    cross = x1.mul_(1 + c * c).sub_(c * x23)
    total.addcmul_(cross, ha @ hb.T + float(bias), value=2.0)
    scale_a = ma.abs().amax(1).square() * rho2 * fa_
    scale_b = mb.abs().amax(1).square() * rho2 * fb_
    return total, squares_a, squares_b, scale_a, scale_b


def _terms_from_factors(fac_a: Tuple, fac_b: Tuple, block: int, cross_term: str = "exact"
                        ) -> Tuple[torch.Tensor, torch.Tensor]:
    """``||g_ij||^2 = A_ij + 2 C_ij + B_ij`` with ``A_ij = v_j^T J_i J_i^T v_j``, ``B_ij = u_i^T J'_j J'_j^T u_i``,
    ``C_ij = v_j^T J_i J'_j^T u_i``, and a bound on its rounding.

    Per layer, ``J_i[a] . J'_j[b] = (delta_i[a] . delta'_j[b]) (h_i . h'_j + [bias])``.  Layers that are tail
    layers on both sides take :func:`_tail_layer_terms`; a layer that is a tail layer on one side only (an
    embedding near 0 on the other) has its deltas formed by :func:`_deltas`.  For deep layers the cross term
    is contracted with ``v_j`` and ``u_i`` before the ``d x d`` block is formed:
    ``C_ij = sum_layers (h_i . h'_j + 1) <delta_i^T v_j, delta'_j^T u_i>``, in blocks of ``block`` rows, so
    the work is ``O(n^2 d width)`` and the memory ``O(block n width)``.

    Rounding: each of ``A``, ``B``, ``C`` is a sum of products through at most ``K`` roundings, so its error
    is at most ``gamma_K`` times its terms' absolute sum.  Deep layers: that sum is at most
    ``||J_i||_F^2 + ||J'_j||_F^2`` (:func:`_rounding_margin`).  Tail layers: ``4 S_i + 4 (S_i + S'_j) +
    4 S'_j`` for ``A + 2C + B``, twice what the margin's factor 4 covers, hence the factor 2 on ``S``.
    The parameters outside ``nn.Linear`` layers add their Jacobian block's share (:func:`_jacobian_terms`,
    exact or, with ``cross_term="cauchy_schwarz"``, an upper bound).
    """
    u, ra, fa, ja = fac_a
    v, rb, fb, jb = fac_b
    n, d = u.shape
    total = u.new_zeros(n, n)
    squares_a, squares_b = u.new_zeros(n), u.new_zeros(n)
    scale_a, scale_b = u.new_zeros(n), u.new_zeros(n)
    c = u @ v.T
    # |u_i|, |v_j| (hence |c_ij|) may exceed 1 by the rounding of the normalization, about d units in the last
    # place: the tail bounds below are products of at most four such factors.
    inflation = (1.0 + 2.0 * d * torch.finfo(u.dtype).eps / 2) ** 4
    length = 2 * d + len(fa) + 16
    for layer_a, layer_b in zip(fa, fb):
        ha, hb = layer_a[1], layer_b[1]
        if layer_a[0] == "tail" and layer_b[0] == "tail":
            part, sq_a, sq_b, s_a, s_b = _tail_layer_terms(layer_a, layer_b, u, v, ra, rb, c)
            total += part
            squares_a += sq_a
            squares_b += sq_b
            scale_a += 2 * inflation * s_a
            scale_b += 2 * inflation * s_b
            length += ha.shape[1] + 2 * layer_a[3].shape[1] + 2 * d + 8  # sums over 2 x width in the products
            continue
        da, db = _deltas(layer_a, u, ra), _deltas(layer_b, v, rb)
        bias = layer_a[2]
        width = da.shape[2]
        length += ha.shape[1] + width + d * d + 2
        gram_aa = torch.einsum("iao,ibo->iab", da, da) * ((ha * ha).sum(1) + float(bias))[:, None, None]
        gram_bb = torch.einsum("jao,jbo->jab", db, db) * ((hb * hb).sum(1) + float(bias))[:, None, None]
        total += torch.einsum("iab,ja,jb->ij", gram_aa, v, v)
        total += torch.einsum("jab,ia,ib->ij", gram_bb, u, u)
        scale_a += torch.einsum("iaa->i", gram_aa)
        scale_b += torch.einsum("jaa->j", gram_bb)
        h_cross = ha @ hb.T + float(bias)
        db_flat = db.permute(1, 0, 2).reshape(d, n * width)
        for start in range(0, n, block):
            rows = slice(start, min(n, start + block))
            da_v = torch.matmul(v, da[rows])  # (m, n, width): delta_i^T v_j
            db_u = (u[rows] @ db_flat).reshape(-1, n, width)  # delta'_j^T u_i
            total[rows] += 2 * h_cross[rows] * (da_v * db_u).sum(-1)
    if ja is not None:
        part, trace_a, trace_b, chain = _jacobian_terms(ja, jb, u, v, cross_term=cross_term)
        total += part
        scale_a += trace_a
        scale_b += trace_b
        length += chain
    total.addcmul_(c * c, squares_a[:, None] + squares_b[None, :])
    slack = _rounding_margin(length, total.dtype) * (scale_a[:, None] + scale_b[None, :])
    return total, slack


def _deltas(layer: Tuple, u: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """``delta[i, a] = d u_i[a] / d z_i``, ``(n, d, width)``; for a tail layer ``M_i R diag(m_i)``."""
    if layer[0] == "deep":
        return layer[3]
    _, _, _, m, weight = layer
    eye = torch.eye(u.shape[1], dtype=u.dtype, device=u.device)
    proj = (eye - u[:, :, None] * u[:, None, :]) / r[:, None, None]
    return (proj if weight is None else proj @ weight) * m[:, None, :]


def _rounding_margin(accumulation_length: int, dtype: torch.dtype) -> float:
    """``4 gamma_K``, ``gamma_K = K u / (1 - K u)`` (``u`` the unit roundoff of ``dtype``).

    Each of ``A``, ``B``, ``C`` is a sum of products passing through at most ``K`` roundings, so its error
    is at most ``gamma_K`` times the sum of its terms' absolute values.  For the PSD Gram blocks
    (``|K_ab| <= sqrt(K_aa K_bb)``) and unit ``u``, ``v`` those sums are at most ``tr K_i = ||J_i||_F^2``,
    ``||J'_j||_F^2`` and ``sqrt(||J_i||_F^2 ||J'_j||_F^2)``, so ``A + 2C + B`` is within
    ``2 gamma_K (||J_i||_F^2 + ||J'_j||_F^2)``; the factor 2 on top is slack."""
    return 4.0 * _gamma(accumulation_length, dtype)


def _gamma(roundings: int, dtype: torch.dtype) -> float:
    """Higham's ``gamma_K = K u / (1 - K u)``: the relative error of ``K`` roundings in ``dtype``."""
    k_u = roundings * torch.finfo(dtype).eps / 2
    if k_u >= 0.5:
        raise ValueError("sums too long for a rounding bound in this precision; use float64")
    return k_u / (1.0 - k_u)


def _call_with(encoder: nn.Module, tensors: Any, x: torch.Tensor) -> torch.Tensor:
    """``functional_call`` that leaves every module holding its own parameters and buffers: for a module run twice
    in the forward (tied by reuse), torch puts the substitutes back in place of the originals, so the layer would
    then compute with a detached copy that neither the pair norms nor the optimizer's updates reach."""
    held = [(m, dict(m._parameters), dict(m._buffers)) for m in encoder.modules()]
    try:
        return functional_call(encoder, tensors, (x,))
    finally:
        for m, params, buffers in held:
            m._parameters.update(params)
            m._buffers.update(buffers)


def _jacobian(encoder: nn.Module, x: torch.Tensor, chunk: int, names: Optional[List[str]] = None,
              dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Per-example Jacobian of the normalized embedding w.r.t. the parameters ``names`` (default: all
    trainable ones), ``(n, d, p)`` in ``dtype``."""
    if names is None:
        names = [k for k, p in encoder.named_parameters() if p.requires_grad]
    wanted = set(names)
    params = {k: p.detach() for k, p in encoder.named_parameters() if k in wanted}
    fixed = {k: p.detach() for k, p in encoder.named_parameters() if k not in wanted}
    buffers = dict(encoder.named_buffers())

    def f(p: Dict[str, torch.Tensor], xi: torch.Tensor) -> torch.Tensor:
        e = _call_with(encoder, ({**fixed, **p}, buffers), xi.unsqueeze(0)).squeeze(0)
        return F.normalize(e, dim=0)

    parts, alone = [], []
    for start in range(0, x.shape[0], chunk):
        jac = vmap(jacrev(f), in_dims=(None, 0))(params, x[start : start + chunk])
        parts.append(torch.cat([jac[k].flatten(2).to(dtype) for k in names], dim=2))
        with torch.no_grad():
            alone.append(vmap(f, in_dims=(None, 0))(params, x[start : start + chunk]))
    # The norms are those of each example alone; the released gradient comes from the batch forward.
    # They describe the same function only if no example's embedding depends on the others.
    with torch.no_grad():
        together = normalized_embedding(encoder, x)
    if x.shape[0] and not torch.allclose(torch.cat(alone), together, rtol=1e-4, atol=1e-5):
        raise ValueError("the encoder's output for one example depends on the other examples of the batch "
                         "(batch statistics or another coupling module): Logit-DP's per-pair analysis does not apply")
    return torch.cat(parts)


JacobianBlock = Union[torch.Tensor, _LazyConvJacobian]


CROSS_TERMS = ("exact", "cauchy_schwarz")


def _check_cross_term(cross_term: str) -> None:
    if cross_term not in CROSS_TERMS:
        raise ValueError(f"cross_term must be one of {CROSS_TERMS}, got {cross_term!r}")


GRAM_METHODS = ("auto", "factored", "jacobian")


def _check_gram_method(method: str) -> None:
    if method not in GRAM_METHODS:
        raise ValueError(f"method must be one of {GRAM_METHODS}, got {method!r}")


def _block_chain(p: int, d: int) -> int:
    """The longest chain of roundings in a Jacobian block's ``A``, ``B``, ``C`` (a length-``p`` Gram or
    ``J^T v`` product, then a ``d x d`` quadratic form or a length-``p`` dot product)."""
    return p + d * d + 2 * d + 4


def _cauchy_schwarz_terms(ja: JacobianBlock, jb: JacobianBlock, u: torch.Tensor, v: torch.Tensor,
                          precision: Optional[torch.dtype] = None
                          ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """An upper bound on a Jacobian block's share of ``||g_ij||^2``: ``A_ij + B_ij + 2 sqrt(A_ij B_ij)`` with
    ``|C_ij| = |<J_i^T v_j, J'_j^T u_i>| <= sqrt(A_ij B_ij)`` (Cauchy-Schwarz) for ``i != j``, at
    ``O(n d^2 p + n^2 d^2)`` instead of the exact cross term's ``2 n^2 d p``.  The positive pairs ``i = j``
    keep their exact ``C_ii`` (``O(n d p)``): two views of one image nearly cancel (``g_ii`` small), where
    the bound would be loosest.  Other pairs are clipped harder than they need, by ``sqrt 2`` where their
    two parts are orthogonal, by nothing where they are parallel.

    The square roots take ``A``, ``B`` raised by their own rounding bound ``2 gamma_K tr(J_i J_i^T)`` (the
    factor 2 covers ``||v_j||`` above 1 by rounding), so the cross bound holds for the exact ``A``, ``B``;
    it is formed in float64 and rounded up into the working precision.  The caller's margin covers the
    rounding of ``A``, ``B`` and ``C_ii`` themselves, as for the exact term.  ``precision``: that of the
    computation the Jacobians come from, when coarser than their dtype (float32 Jacobians held in float64).
    Same returns as :func:`_jacobian_terms`.
    """
    n, d = u.shape
    lazy = isinstance(ja, _LazyConvJacobian)
    step = ja.chunk if lazy else max(n, 1)
    grams_a, grams_b, diagonal = [], [], []
    p = 0
    for c0 in range(0, n, step):  # a chunk of examples of both views at a time: no block is held whole
        c1 = min(n, c0 + step)
        rows_a, rows_b = (ja.rows(c0, c1), jb.rows(c0, c1)) if lazy else (ja[c0:c1], jb[c0:c1])
        p = rows_a.shape[2]
        grams_a.append(torch.einsum("iap,ibp->iab", rows_a, rows_a))
        grams_b.append(torch.einsum("iap,ibp->iab", rows_b, rows_b))
        # J_i^T v_i and J'_i^T u_i, as (1 x d) (d x p) products: an einsum runs them as transposed products, 10x slower
        x = torch.matmul(v[c0:c1].unsqueeze(1), rows_a).squeeze(1)
        y = torch.matmul(u[c0:c1].unsqueeze(1), rows_b).squeeze(1)
        diagonal.append((x * y).sum(1))
    gram_aa, gram_bb = torch.cat(grams_a), torch.cat(grams_b)
    a = torch.einsum("iab,ja,jb->ij", gram_aa, v, v)
    b = torch.einsum("jab,ia,ib->ij", gram_bb, u, u)
    trace_a, trace_b = torch.einsum("iaa->i", gram_aa), torch.einsum("jaa->j", gram_bb)
    chain = _block_chain(p, d)
    g = 2.0 * _gamma(chain, precision or a.dtype)
    upper_a = (a.double() + g * trace_a.double()[:, None]).clamp_min(0.0)
    upper_b = (b.double() + g * trace_b.double()[None, :]).clamp_min(0.0)
    # float64 rounding of the product and the root (a few units of 2^-53) and the one rounding to a.dtype
    up = 1.0 + 2.0 * torch.finfo(a.dtype).eps + 8.0 * torch.finfo(torch.float64).eps
    cross = (2.0 * (upper_a * upper_b).sqrt() * up).to(a.dtype)
    cross.diagonal().copy_(2.0 * torch.cat(diagonal))
    return a + b + cross, trace_a, trace_b, chain + 2


def _jacobian_terms(ja: JacobianBlock, jb: JacobianBlock, u: torch.Tensor, v: torch.Tensor,
                    block_elements: int = 1 << 22, cross_term: str = "exact",
                    precision: Optional[torch.dtype] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """A Jacobian block's share of ``||g_ij||^2 = A_ij + 2 C_ij + B_ij`` (``J``: ``(n, d, p)``).

    ``A``, ``B`` from the ``d x d`` Grams ``J_i J_i^T``; ``C_ij = <J_i^T v_j, J'_j^T u_i>`` from
    ``y_ij = J'_j^T u_i`` and then ``v_j . (J_i y_ij)``: ``2 n^2 d p`` multiply-adds (not the ``n^2 d^2 p`` of
    the ``d x d`` cross Grams), in tiles of at most ``block_elements`` numbers ``y``.  A lazy ``jb`` is formed
    a chunk of examples at a time, so only ``ja`` is held whole.  Returns the part, the traces ``||J_i||_F^2``,
    ``||J'_j||_F^2`` (which bound every term's absolute sum, see :func:`_rounding_margin`) and the longest
    chain of roundings.  ``cross_term="cauchy_schwarz"``: an upper bound instead (:func:`_cauchy_schwarz_terms`;
    the public entry points check ``cross_term`` in :func:`_check_pairs`; ``precision`` is passed on).
    """
    if cross_term == "cauchy_schwarz":
        return _cauchy_schwarz_terms(ja, jb, u, v, precision)
    if isinstance(ja, _LazyConvJacobian):
        ja = ja.rows(0, len(ja))
    n, d, p = ja.shape
    gram_aa = torch.einsum("iap,ibp->iab", ja, ja)
    total = torch.einsum("iab,ja,jb->ij", gram_aa, v, v)
    trace_b = total.new_zeros(n)
    # Rows of a tile reuse the columns' Jacobians, which is what keeps the products compute-bound.
    rows_per_tile = max(1, min(n, 32))
    cols_per_tile = max(1, min(n, block_elements // max(1, rows_per_tile * p)))
    step = jb.chunk if isinstance(jb, _LazyConvJacobian) else n
    for c0 in range(0, n, step):
        c1 = min(n, c0 + step)
        jb_chunk = jb.rows(c0, c1) if isinstance(jb, _LazyConvJacobian) else jb[c0:c1]
        gram_bb = torch.einsum("jap,jbp->jab", jb_chunk, jb_chunk)
        total[:, c0:c1] += torch.einsum("jab,ia,ib->ij", gram_bb, u, u)
        trace_b[c0:c1] = torch.einsum("jaa->j", gram_bb)
        jb_by_dim = jb_chunk.permute(1, 0, 2)  # (d, chunk, p)
        for j0 in range(c0, c1, cols_per_tile):
            cols = slice(j0, min(c1, j0 + cols_per_tile))
            jb_cols = jb_by_dim[:, cols.start - c0 : cols.stop - c0].reshape(d, -1)
            for i0 in range(0, n, rows_per_tile):
                rows = slice(i0, min(n, i0 + rows_per_tile))
                y = (u[rows] @ jb_cols).reshape(-1, cols.stop - cols.start, p)  # J'_j^T u_i
                z = torch.bmm(ja[rows], y.transpose(1, 2))  # (rows, d, cols): J_i J'_j^T u_i
                total[rows, cols] += 2.0 * torch.einsum("iaj,ja->ij", z, v[cols])
    return total, torch.einsum("iaa->i", gram_aa), trace_b, _block_chain(p, d)


def pair_gradient_norms(
    encoder: nn.Module,
    xa: torch.Tensor,
    xb: torch.Tensor,
    method: str = "auto",
    block: int = 256,
    chunk: Optional[int] = None,
    cross_term: str = "exact",
) -> torch.Tensor:
    """``||grad_w cos(Phi(xa_i), Phi(xb_j))||`` for all ``i, j`` (``(n, n)``, float64), from Gram blocks.

    ``method="factored"``: encoders made of ``nn.Linear`` layers, elementwise activations and known per-example
    layers (convolutions, pooling, LayerNorm/GroupNorm) in ``nn.Sequential``: the ``nn.Linear`` parameters
    via the outer-product structure of their Jacobians (``O(n^2 width)`` for the last two layers of an MLP,
    ``O(n^2 d width)`` for earlier ones), the other parameters via their per-example Jacobian block,
    ``2 n^2 d p`` multiply-adds for ``p`` such parameters (:func:`_jacobian_terms`).
    ``method="jacobian"``: any encoder without cross-example coupling, via ``torch.func``
    (``vmap(jacrev)``) Jacobians ``(n, d, p)`` of all parameters, in float64.
    ``"auto"`` takes the first that applies.  The values are over-estimated by a rounding margin only
    when used for clipping (:func:`logit_dp_gradient`), not here.  ``cross_term="cauchy_schwarz"`` bounds
    the Jacobian blocks' cross term ``<J_i^T v_j, J'_j^T u_i>`` by the product of the two norms instead of
    computing it: an upper bound on every pair norm, exact for the ``nn.Linear`` parameters, much faster
    for convolutions (:func:`_cauchy_schwarz_terms`).
    """
    squared = _gram_terms(encoder, xa, xb, method, block, chunk, cross_term)[0]
    return squared.double().clamp_min(0.0).sqrt()


def _check_per_example(encoder: nn.Module) -> None:
    """Refuse layers that break the per-pair analysis: batch statistics couple the examples of a batch, and
    random dropout masks would differ between the pass that measures the norms and the one that uses them."""
    for name, m in encoder.named_modules():
        # Batch statistics are used in training mode and, without running statistics, in eval mode too.
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and (m.training or m.running_mean is None):
            raise ValueError(f"layer {name or 'encoder'} ({type(m).__name__}) couples examples through batch "
                             "statistics; use a per-example normalization (LayerNorm, GroupNorm)")
        if m.training and isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0:
            raise ValueError(f"layer {name} ({type(m).__name__}) is random: the clipped pair norms would be "
                             "measured on a different function than the one differentiated; remove dropout")


def _check_pairs(xa: torch.Tensor, xb: torch.Tensor, method: str, cross_term: str = "exact") -> None:
    _check_cross_term(cross_term)
    if xa.shape != xb.shape:
        raise ValueError(f"pair sides differ in shape: per example {tuple(xa.shape[1:])} vs {tuple(xb.shape[1:])}"
                         + ("" if xa.shape[:1] == xb.shape[:1] else ", and in number"))
    _check_gram_method(method)
    for side, x in (("first", xa), ("second", xb)):
        if x.is_floating_point() and not torch.isfinite(x).all():
            raise ValueError(f"the {side} views contain NaN or infinite values: no pair norm can be bounded; "
                             "clean the data")


def _gram_terms(encoder: nn.Module, xa: torch.Tensor, xb: torch.Tensor, method: str, block: int,
                chunk: Optional[int], cross_term: str = "exact"):
    _check_per_example(encoder)
    _check_pairs(xa, xb, method, cross_term)
    if method in ("auto", "factored"):
        fac_a = _layer_factors(encoder, xa, chunk)
        fac_b = _layer_factors(encoder, xb, chunk) if fac_a is not None else None
        if fac_a is not None and fac_b is not None:
            return _terms_from_factors(fac_a, fac_b, block, cross_term) + (fac_a[0], fac_b[0])
        if method == "factored":
            raise ValueError("method='factored' needs an encoder built from nn.Sequential, nn.Linear (applied once "
                             "to (batch, features) inputs), convolutions, pooling, LayerNorm/GroupNorm and "
                             "elementwise activations, without hooks or shared parameters; use method='jacobian'")
    return _jacobian_terms_all_parameters(encoder, xa, xb, chunk, cross_term)


def _jacobian_terms_all_parameters(encoder: nn.Module, xa: torch.Tensor, xb: torch.Tensor, chunk: Optional[int],
                                   cross_term: str = "exact"):
    """``A + 2C + B`` and its rounding bound from the Jacobians of all parameters (any encoder), held in float64;
    the bound is at the encoder's precision, which the Jacobians were computed in."""
    with torch.no_grad():
        u, v = normalized_embedding(encoder, xa), normalized_embedding(encoder, xb)
    working = u.dtype if torch.finfo(u.dtype).eps > torch.finfo(v.dtype).eps else v.dtype
    u, v = u.double(), v.double()
    ja, jb = _jacobian(encoder, xa, chunk or CHUNK), _jacobian(encoder, xb, chunk or CHUNK)
    total, trace_a, trace_b, length = _jacobian_terms(ja, jb, u, v, cross_term=cross_term, precision=working)
    # The Jacobians carry the rounding of the encoder's own (e.g. float32) backward, the pass the released
    # gradient is made of; summing them in float64 does not remove it, so the margin is that of the encoder's
    # precision, as on the factored path (in float32 the float64 margin under-covered near-cancelling pairs by 10%).
    return total, _rounding_margin(length, working) * (trace_a[:, None] + trace_b[None, :]), u, v


# ---------------------------------------------------------------------------------------------------
# The two private gradients (noise is added by the caller; see clipless.contrastive.pretrain)
# ---------------------------------------------------------------------------------------------------


def _refuse_hooks(encoder: nn.Module) -> None:
    """Hooks may change the backward (module backward hooks, saved-tensor hooks) or the forward between the pass
    that measures the pair norms and the one that differentiates them, and a forward set on a module instance
    is not the one the factored path differentiates: each would release a pair gradient larger than its clip."""
    if global_hooks_registered():
        raise ValueError("global module hooks (torch.nn.modules.module.register_module_*) are registered: "
                         "they could change the gradient after its pair norms were clipped; remove them")
    for name, m in encoder.named_modules():
        if module_hooks(m):
            raise ValueError(f"layer {name or 'encoder'} ({type(m).__name__}) has a forward or backward hook: "
                             "it could change the gradient after its pair norms were clipped; remove it")
        replaced = replaced_forward(m)
        if replaced:  # the factored path computes the class's Jacobian, the release would use the instance's
            raise ValueError(f"layer {name or 'encoder'} ({type(m).__name__}) has its own {replaced} (set on the "
                             "instance, e.g. module.forward = ... or module.compile()): its pair norms would be "
                             "measured for its class's forward; use a module class that computes it")
    if saved_tensor_hooks_active():
        raise ValueError("saved-tensor hooks (torch.autograd.graph.saved_tensors_hooks, torch.utils.checkpoint) "
                         "are active: the backward might not use the forward's values; run outside them")
    mode = active_torch_mode()
    if mode is not None:  # it may act on the pass that measures the pair norms otherwise than on the release
        raise ValueError(f"a torch function or dispatch mode ({mode}) is active: it can change the operations of the "
                         "pass that measures the pair norms and of the one that differentiates them; run outside it")


def _refuse_custom_functions(outputs: Sequence[torch.Tensor]) -> None:
    """The pair norms are those of ``J^T w`` for the autograd Jacobian ``J``; a custom ``autograd.Function``'s
    backward need not be that linear map of its cotangent (it may, say, act otherwise under ``vmap``, where the
    norms are measured), so the released gradient could exceed its clip: refuse any in the embeddings' graph."""
    seen, stack = set(), [t.grad_fn for t in outputs if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if isinstance(node, torch.autograd.function.BackwardCFunction):
            name = getattr(node, "_forward_cls", type(node)).__name__
            raise ValueError(f"the encoder applies the custom torch.autograd.Function {name}: its backward is not "
                             "checked to be the derivative of its forward, so the clipped pair norms would not "
                             "bound the released gradient; write it with differentiable torch operations")
        stack.extend(next_node for next_node, _ in node.next_functions)


def _check_precision(encoder: nn.Module, xa: torch.Tensor, xb: torch.Tensor) -> None:
    """Clip factors are measured in one pass and applied in another; their rounding margins are proven for
    float32/float64 sums, not for two reduced-precision computations of the same gradient that may differ by
    ``2^-8`` relative, so a private gradient refuses autocast and float16/bfloat16 inputs or weights."""
    check_precision(encoder, xa)
    check_precision(encoder, xb)


def _cleared_params(encoder: nn.Module) -> List[nn.Parameter]:
    """The trainable parameters, every parameter's ``.grad`` cleared first: a frozen one's too, since the
    optimizer would otherwise apply a gradient left on it (by a backward of the user's own) without noise."""
    for p in encoder.parameters():
        p.grad = None
    return [p for p in encoder.parameters() if p.requires_grad]


def _fill_missing_grads(params: List[nn.Parameter]) -> None:
    """A parameter the batch did not reach (or an empty batch) has gradient 0, which still gets noise."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)


def clip_factors(encoder: nn.Module, xa: torch.Tensor, xb: torch.Tensor, clip_norm: float,
                 method: str = "auto", block: int = 256, cross_term: str = "exact") -> torch.Tensor:
    """``min(1, B / ||g_ij||)`` for all pairs (float64), with ``||g_ij||`` over-estimated by a bound on
    the rounding of ``A + 2C + B`` (and, with ``cross_term="cauchy_schwarz"``, by the bound on the cross
    term, :func:`pair_gradient_norms`) so that no clipped pair gradient exceeds ``B``."""
    return _clip_factors(encoder, xa, xb, clip_norm, method, block, cross_term)[0]


def _clip_factors(encoder: nn.Module, xa: torch.Tensor, xb: torch.Tensor, clip_norm: float, method: str,
                  block: int, cross_term: str = "exact") -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`clip_factors` and the normalized embeddings ``u``, ``v`` whose pair norms they clip."""
    squared, slack, u, v = _gram_terms(encoder, xa, xb, method, block, None, cross_term)
    norms = (squared.double() + slack.double()).clamp_min(0.0).sqrt()
    return torch.clamp(clip_norm / norms.clamp_min(1e-300), max=1.0), u, v


def logit_dp_gradient(
    encoder: nn.Module,
    xa: torch.Tensor,
    xb: torch.Tensor,
    loss: str,
    tau: float,
    clip_norm: float,
    method: str = "auto",
    block: int = 256,
    cross_term: str = "exact",
) -> Dict[str, float]:
    """Set every parameter's ``.grad`` to ``gbar = sum_ij a_ij Clip_B(g_ij) / tau`` (the un-noised sum).

    Returns the batch loss and the fraction of pair gradients that were clipped.  ``cross_term``: see
    :func:`pair_gradient_norms` (``"cauchy_schwarz"`` clips by an upper bound on each pair norm: the same
    sensitivity, a faster step for convolutional encoders, more clipping).
    """
    _check_loss(loss, tau)
    _check_clip_norm(clip_norm, "B")
    _refuse_hooks(encoder)
    _check_per_example(encoder)
    _check_pairs(xa, xb, method, cross_term)
    _check_precision(encoder, xa, xb)
    params = _cleared_params(encoder)
    if xa.shape[0] == 0:
        _fill_missing_grads(params)
        return {"loss": 0.0, "clipped_fraction": 0.0}
    _refuse_custom_functions([encoder(xa[:1])])  # early and clear; the released pass is checked whole below
    factor, u_measured, v_measured = _clip_factors(encoder, xa, xb, clip_norm, method, block, cross_term)
    # The released gradient is taken at fresh leaves: hooks put on the parameters themselves (which no one
    # can list) never see it, so it is exactly sum_ij lambda_ij grad Z_ij.
    leaves = {k: p.detach().requires_grad_() for k, p in encoder.named_parameters() if p.requires_grad}
    u = F.normalize(_call_with(encoder, leaves, xa), dim=1)
    v = F.normalize(_call_with(encoder, leaves, xb), dim=1)
    if not (torch.isfinite(u).all() and torch.isfinite(v).all() and torch.isfinite(factor).all()):
        raise ValueError("the encoder's embeddings or their pair gradient norms are NaN or infinite (an overflow in "
                         "the encoder): no pair gradient can be clipped; rescale the inputs or the weights")
    # A forward that is not a function of its input alone (state, randomness) would release the gradient of
    # another function than the one whose pair norms were clipped.
    for side, now, then in (("first", u, u_measured), ("second", v, v_measured)):
        if not torch.allclose(now.detach(), then.to(now.dtype), rtol=1e-4, atol=1e-5):
            raise ValueError(f"the encoder's embeddings of the {side} views changed between the pass that "
                             "measured the pair norms and the pass that differentiates them: a forward that keeps "
                             "state or draws random numbers cannot be trained with Logit-DP")
    _refuse_custom_functions([u, v])
    z = similarity_logits(u, v, tau)
    a = logit_gradient(z, loss, tau)
    weights = (a.double() * factor).to(z.dtype)
    grads = torch.autograd.grad((weights * z).sum(), list(leaves.values()), allow_unused=True)
    for p, g in zip(params, grads):
        p.grad = g
    _fill_missing_grads(params)
    return {"loss": float(LOSS_FUNCTIONS[loss](z.detach())), "clipped_fraction": float((factor < 1).double().mean())}


def naive_dp_gradient(encoder: nn.Module, xa: torch.Tensor, xb: torch.Tensor, loss: str, tau: float,
                      clip_norm: float) -> Dict[str, float]:
    """Set ``.grad`` to the whole batch's loss gradient clipped to norm ``C`` (sensitivity ``2C``).

    The released gradient's norm is at most ``C`` in exact arithmetic on the stored values: the float64 norm is
    rounded up by its summation bound, and the factor's ``1 - 8u`` (``u`` of the gradient's dtype) covers the
    roundings of the norm's square root, of the factor and of each product (at most ``5.5u`` together)."""
    _check_loss(loss, tau)
    _check_clip_norm(clip_norm, "C")
    _check_precision(encoder, xa, xb)
    params = _cleared_params(encoder)
    if xa.shape[0] == 0:
        _fill_missing_grads(params)
        return {"loss": 0.0, "clipped_fraction": 0.0}
    value = LOSS_FUNCTIONS[loss](pair_logits(encoder, xa, xb, tau))
    value.backward()
    _fill_missing_grads(params)
    grads = [p.grad for p in params]
    count = sum(g.numel() for g in grads)  # type: ignore[union-attr]
    squared = float(sum((g.double() ** 2).sum() for g in grads))  # type: ignore[union-attr]
    # float64 squares of float32/64 values are exact or one rounding; the sum adds at most count - 1 roundings
    total = math.sqrt(squared * (1.0 + _gamma(count + 1, torch.float64)))
    if not math.isfinite(total):
        raise ValueError("the batch gradient is NaN or infinite (an overflow in the encoder): it cannot be clipped; "
                         "rescale the inputs or the weights")
    factor = 1.0
    if total > clip_norm:
        unit = max(torch.finfo(g.dtype).eps / 2 for g in grads)  # type: ignore[union-attr]
        factor = clip_norm / total * (1.0 - 8.0 * unit)
        for p in params:
            p.grad = p.grad * factor  # type: ignore[operator]
    return {"loss": float(value.detach()), "clipped_fraction": float(factor < 1.0)}


def nonprivate_gradient(encoder: nn.Module, xa: torch.Tensor, xb: torch.Tensor, loss: str,
                        tau: float) -> Dict[str, float]:
    """Set ``.grad`` to the batch loss gradient (sum over pairs), no clipping."""
    _check_loss(loss, tau)
    _cleared_params(encoder)
    value = LOSS_FUNCTIONS[loss](pair_logits(encoder, xa, xb, tau))
    value.backward()
    return {"loss": float(value.detach()), "clipped_fraction": 0.0}
