"""ssm.py: the SSM block that S4, S4D (s4.py) and DLR (dlr.py) share (Gu et al. ICLR 2022, S4 §3.4
and §2.4).
block:        y = SSMconv(u) + D⊙u → GELU → dropout → Linear(H→2H) → GLU → dropout,
              residual + norm (pre or post)
convolution:  SSMconv(u) = K * u by FFT, both signals zero-padded to n ≥ 2L (length L alone would
              be circular), n with no prime factor above 7, which cuFFT (and pocketfft) transform
              fast
kernels:      K_l = Re Σ_n coef_n w_n^l, the Vandermonde product, made from split powers
              w^{a·c}·w^b; every matmul of a kernel is a true float32 (or float64) one, forward and
              backward, whatever the process's TF32 setting
-> FFT conv == naive sums, block recurrence == block convolution, causality: see tests/test_ssm.py.
Shapes: B batch, L length, H = d_model channels (the papers' H), N state size; D is the skip vector
only.
A kernel is any module with forward(L) -> (H, L) | (2, H, L), initial_state(B) and
step(u_t, x) -> (y_t, x).
"""
import contextlib
import math
from dataclasses import dataclass
from functools import cache
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F


# ------------------------------------------------------------------------------------ config rules

def require(ok, message):
    """Raise ValueError(message) unless ok: one line naming the field, its value and the rule
    (train.py prints it). Every model's config uses it (transformer.py too)."""
    if not ok:
        raise ValueError(message)


@dataclass
class SSMConfig:
    """The fields every SSM backbone (s4.S4Config, dlr.DLRConfig, a fork's) shares: SSMLayer and
    SSMBackbone read them. A model's config adds its own fields (and its own defaults) by
    subclassing; its __post_init__ calls super().__post_init__() first. Each field is also a flag
    of train.py (--d-state, ...), read from here (models.config_flags)."""
    d_model: int = 64                # H, channels
    n_layers: int = 4
    d_state: int = 64                # N, state size
    dropout: float = 0.1             # tied along L: one mask per (batch, channel)
    bidirectional: bool = True       # + a backward SSM on u_{t+1:} (shifted by one,
                                     # see fft_conv); False = causal
    dt_min: float = 1e-3             # Δ (DLR: the init range of |λ|): log-uniform in
                                     # [dt_min, dt_max] per channel or mode
    dt_max: float = 1e-1
    prenorm: bool = True             # norm → mixer → residual (True)
                                     # or mixer → residual → norm (False)
    norm: str = "layer"              # "layer" | "batch"
                                     # (BatchNorm statistics over real positions only)
    vocab_size: Optional[int] = None  # V: tokens (B, L) -> nn.Embedding(V, H, padding_idx=0)
    d_input: int = 1                 # floats (B, L, d_input) -> nn.Linear(d_input, H),
                                     # when vocab_size is None
    ssm_lr: float = 1e-3             # lr of the model's SSM_PARAMS (train.py)

    def __post_init__(self):
        """ValueError, one line naming the field, for a config no SSM backbone can be built
        from."""
        check_config(self)


def check_config(cfg):
    """The rules of the fields every SSM config has (SSMConfig). Raises ValueError."""
    require(cfg.d_model >= 1, f"d_model={cfg.d_model} must be >= 1")
    require(cfg.n_layers >= 1, f"n_layers={cfg.n_layers} must be >= 1")
    require(cfg.d_state >= 1, f"d_state={cfg.d_state} must be >= 1")
    require(0 <= cfg.dropout < 1, f"dropout={cfg.dropout} must be in [0, 1)")
    require(cfg.ssm_lr > 0, f"ssm_lr={cfg.ssm_lr} must be > 0 (a learning rate; a negative one ascends the loss)")
    require(cfg.norm in ("layer", "batch"), f"norm={cfg.norm!r} must be 'layer' or 'batch'")
    require(cfg.bidirectional or cfg.norm != "batch",
            "norm='batch' with bidirectional=False: BatchNorm statistics "
            "over time leak later positions into earlier outputs in training; use norm='layer'")
    require(0 < cfg.dt_min <= cfg.dt_max,
            f"dt_min={cfg.dt_min}, dt_max={cfg.dt_max} must satisfy 0 < dt_min <= dt_max")
    require(cfg.vocab_size is None or cfg.vocab_size >= 1,
            f"vocab_size={cfg.vocab_size} must be None or >= 1")
    require(cfg.d_input >= 1, f"d_input={cfg.d_input} must be >= 1")


def check_lengths(lengths, batch_size):
    """lengths must be None (no padding) or of shape (B,): a host-side shape check, it never waits
    for the device. Raises ValueError, instead of letting a (B, 1) or (1,) tensor broadcast into a
    wrong mask."""
    if lengths is not None and tuple(lengths.shape) != (batch_size,):
        raise ValueError(f"lengths has shape {tuple(lengths.shape)}, "
                         f"expected (B,) = ({batch_size},)")


# --------------------------------------------------------------------------- exact float32 matmuls

# True: the kernels' matmuls follow the process's TF32 setting, as plain `@` does; only tools/bench.py and
# the GPU check set it, to measure what the guard costs and what it prevents
TF32_IN_KERNELS = False


def matmul_precision():
    """torch's float32 matmul precision now: "highest" (no TF32), "high" (TF32) or "medium", never
    raising. torch >= 2.9 raises on torch.get_float32_matmul_precision() (and on cuBLAS's own query,
    torch._C._get_cublas_allow_tf32) once its legacy and new TF32 APIs were mixed, e.g. after a
    fork's `torch.backends.cuda.matmul.fp32_precision = "tf32"`; the new API's own value still
    answers then. A torch without that API (< 2.9) never raises here."""
    try:
        return torch.get_float32_matmul_precision()
    except RuntimeError:
        if not hasattr(torch.backends.cuda.matmul, "fp32_precision"):     # torch < 2.9: not ours
            raise
        return {"tf32": "high", "bf16": "medium"}.get(torch.backends.cuda.matmul.fp32_precision,
                                                      "highest")


def set_matmul_precision(precision):
    """Set CUDA's float32 matmul precision ("highest": no TF32, "high": TF32, "medium") by
    torch.set_float32_matmul_precision, the one setter after which cuBLAS's query, the legacy flag
    torch.backends.cuda.matmul.allow_tf32 and torch.get_float32_matmul_precision() all answer, from
    every starting state (legacy allow_tf32, the new fp32_precision, set_float32_matmul_precision
    "highest" / "high" / "medium"; tests/test_ssm.py, measured on torch 2.13.0 and 2.14.1). On
    torch >= 2.9 the new `fp32_precision = "tf32"` alone leaves the query raising ("mix of the legacy
    and new APIs"), and `allow_tf32 = False` after set_float32_matmul_precision("high") leaves
    get_float32_matmul_precision() raising. On a torch without the new API it sets the flag that
    allow_tf32 reads. Returns the precision before (matmul_precision())."""
    old = matmul_precision()
    torch.set_float32_matmul_precision(precision)
    return old


def set_tf32(on):
    """TF32 on (True) or off for CUDA's float32 matmuls (set_matmul_precision "high" / "highest")
    and cuDNN's convolutions (the legacy torch.backends.cudnn.allow_tf32, which its query reads
    without raising from every starting state; the new cudnn.conv.fp32_precision does not).
    Returns the matmul precision before."""
    torch.backends.cudnn.allow_tf32 = on
    return set_matmul_precision("high" if on else "highest")


@contextlib.contextmanager
def full_fp32_matmuls():
    """Inside the block CUDA's float32 matmuls are true float32 ones (no TF32), whatever the process
    set; the precision before is restored after (also on an exception, nested blocks too); a state
    that torch could not read before (mixed APIs) comes back readable. Where the process already
    runs true float32 it changes nothing: set_float32_matmul_precision also sets oneDNN's CPU
    matmul mode, whose default ("none") would else turn into "ieee". (On a CPU float32 matmuls are
    float32 anyway.)"""
    try:                                # already true float32 and readable: nothing to change
        exact = (torch.get_float32_matmul_precision() == "highest"
                 and not torch._C._get_cublas_allow_tf32())
    except RuntimeError:                # torch >= 2.9 after a mix of its TF32 APIs
        exact = False
    old = None if exact else set_matmul_precision("highest")
    try:
        yield
    finally:
        if old is not None:
            set_matmul_precision(old)


class Matmul(torch.autograd.Function):
    """a @ b in full float32, forward and backward, under any TF32 setting. TF32 (NVIDIA tensor
    cores, compute capability ≥ 8) keeps 10 of float32's 23 mantissa bits, and an SSM kernel
    amplifies that rounding: S4's repeated squaring Ā^(2^j) and its Vandermonde product leave PathX
    kernels (L = 16,384, Δ ≈ 1e-4) up to 117 % off, while float32 stays within 1e-3 of float64
    (tests/test_ssm.py emulates TF32 on the CPU). A context manager around the forward alone would
    not do: autograd runs the backward matmuls later, under the process's setting. TF32 off costs
    only these matmuls' tensor-core speed-up (tools/bench.py, "kernel precision"); float64 would cost 1/32
    of the speed on GPUs with weak float64 (T4, RTX). a: (..., m, k), b: (..., k, n), the same batch
    shape -> (..., m, n). Use as matmul(a, b)."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        with full_fp32_matmuls():
            return a @ b                                                        # (..., m, n)

    @staticmethod
    def backward(ctx, g):                                                       # g: (..., m, n)
        a, b = ctx.saved_tensors
        with full_fp32_matmuls():
            ga = g @ b.transpose(-1, -2) if ctx.needs_input_grad[0] else None   # (..., m, k)
            gb = a.transpose(-1, -2) @ g if ctx.needs_input_grad[1] else None   # (..., k, n)
        return ga, gb


def matmul(a, b):
    """a @ b of an SSM kernel: Matmul (full float32, forward and backward), or plain `@` when
    TF32_IN_KERNELS."""
    return a @ b if TF32_IN_KERNELS else Matmul.apply(a, b)


# -------------------------------------------------------------- convolution and Vandermonde product

class RFFT(torch.autograd.Function):
    """torch.fft.rfft(x, n=n) with a lean backward: the adjoint of a real FFT is one inverse real
    FFT, with the one-sided bins halved (irfft counts each twice). PyTorch's own backward (CPU) runs
    a full complex FFT and returns a stride-2 gradient, on which the batched matmuls behind it take
    a slow path; this one is one real FFT and its gradient is dense. x: (..., m) real ->
    (..., n/2+1) complex. Use as RFFT.apply(x, n)."""

    @staticmethod
    def forward(ctx, x, n):
        ctx.m, ctx.n = x.size(-1), n                           # x is zero-padded from m to n
        return torch.fft.rfft(x, n=n)                          # (..., n/2+1) complex

    @staticmethod
    def backward(ctx, g):                                      # g: (..., n/2+1) complex
        n = ctx.n
        # (n/2+1,): bins 1 .. (n−1)/2 are counted twice by irfft
        weight = torch.full((n // 2 + 1,), 0.5, dtype=g.real.dtype, device=g.device)
        weight[0] = weight[(n + 1) // 2 :] = 1
        # (..., m) real; n·irfft
        return torch.fft.irfft(g * weight, n=n, norm="forward")[..., : ctx.m], None


def powers(log_w, n):
    """w^j for j < n by doubling, w^{j+k} = w^j·w^k for k = 1, 2, 4, ...: log2(n) exp calls on
    (G, M) instead of one on (G, M, n), the rest are multiplications. log_w: (G, M) complex ->
    (G, M, n) complex, same dtype."""
    w = torch.ones_like(log_w)[..., None]                                # (G, M, 1), w^0
    while w.size(-1) < n:
        w = torch.cat([w, w * torch.exp(w.size(-1) * log_w)[..., None]], -1)   # (G, M, 2k)
    return w[..., :n]                                                    # (G, M, n)


def vandermonde(coef, log_w, L):
    """Re Σ_n coef_{g,r,n} w_{g,n}^l for l < L: coef (G, R, M) complex, log_w (G, M) complex ->
    (G, R, L) real. The kernels of S4D (G = Hk, R = 1), DLR (G = directions, R = H: λ shared by the
    channels) and the Cauchy sums of S4 (R = 4). Split powers: l = a·c + b (b < c) and
    w^l = w^{a·c}·w^b. Only the tables w^b and w^{a·c}, M·(c + L/c) values, are computed; w^{a·c}
    is folded into coef, and what is left is one batched matmul (G, R·L/c, M)·(G, M, c): matmul
    speed, and no (G, M, L) tensor in the forward or in autograd. c ≈ √(R·L), a power of two, makes
    those two factors equally big, so their memory grows like √L. The tables are made in float64,
    then cast: w^l made in float32 carries a phase error of ~l·ε (l up to 65536; S4's HiPPO modes
    then lose 3 digits), the cast only ε."""
    G, R, M = coef.shape
    c = min(L, 2 ** (round(math.log2(R * L)) // 2))                      # split: l = a·c + b
    log_w = log_w.to(torch.complex128)                                   # (G, M)
    small = powers(log_w.conj(), c).to(coef.dtype)                       # (G, M, c), conj(w^b)
    big = powers(c * log_w, -(-L // c)).to(coef.dtype)                   # (G, M, L/c), w^{a·c}
    # (G, R·L/c, M) complex
    scaled = (coef[:, :, None, :] * big.transpose(1, 2)[:, None]).reshape(G, -1, M)
    # Re(x·y) = Re x·Re y − Im x·Im y: one real matmul of half the flops of a complex one, on
    # (re, im) pairs
    # (G, 2M, c): Re w^b, −Im w^b
    small = torch.view_as_real(small).transpose(2, 3).reshape(G, 2 * M, c)
    # (G, R, ⌈L/c⌉·c) real
    K = matmul(torch.view_as_real(scaled).reshape(G, -1, 2 * M), small).view(G, R, -1)
    # (G, R, L); a slice would cost a zero-filled copy in backward
    return K if K.size(-1) == L else K[..., :L]


@cache
def fft_length(n):
    """The smallest m ≥ n with no prime factor above 7: a length cuFFT and pocketfft transform fast.
    A large prime factor sends cuFFT to Bluestein's algorithm, several times slower: Retrieval's
    2L = 8,002 = 2·4,001 -> 8,064."""
    m = n
    while True:
        rest = m
        for p in (2, 3, 5, 7):
            while rest % p == 0:
                rest //= p
        if rest == 1:
            return m
        m += 1


def fft_conv(u, k):
    """Linear (not circular) convolution by FFT (S4 §2.4), both signals zero-padded to
    n = fft_length(2L) ≥ 2L.
    u: (B, H, L) real. k: (H, L) causal kernel, y_t = Σ_{s≤t} k_{t−s} u_s; or (2, H, L) = (k⁰, k¹),
    bidirectional:
        y_t = Σ_{s≤t} k⁰_{t−s} u_s + Σ_{s>t} k¹_{s−t−1} u_s,
    i.e. k¹ runs on the time-reversed input shifted by one step, so u_t is counted once (by k⁰), as
    in S4.
    Returns (B, H, L) real, u's dtype."""
    L = u.size(-1)
    n = fft_length(2 * L)
    if k.dim() == 3:                           # lag −m (m = 1..L) sits at index n − m of the period
        k0, k1 = k.unbind(0)                   # (H, L) each; unbind, not k[0]: no zero-filled grads
        gap = k0.new_zeros(k0.size(0), n - 2 * L)                   # (H, n − 2L): no lag there
        k = torch.cat([k0, gap, k1.flip(-1)], -1)                   # (H, n): k⁰, 0, k¹ reversed
    y = torch.fft.irfft(RFFT.apply(u, n) * RFFT.apply(k, n), n=n)   # (B, H, n)
    return y[..., :L]                                               # (B, H, L)


# -------------------------------------------------------------------------- dropout, norms, padding

def tied_dropout(x, p, training):
    """Dropout with one mask per (batch, channel), tied along L (S4's DropoutNd). x: (B, L, H) ->
    (B, L, H)."""
    if not training or p == 0:
        return x
    mask = torch.bernoulli(torch.full_like(x[:, :1], 1 - p))            # (B, 1, H)
    return x * mask / (1 - p)                                           # (B, L, H)


def norm_layer(kind, H):
    """nn.LayerNorm(H) for "layer", nn.BatchNorm1d(H) (momentum 0.1) for "batch"; ValueError
    otherwise."""
    require(kind in ("layer", "batch"), f"norm={kind!r} must be 'layer' or 'batch'")
    return nn.LayerNorm(H) if kind == "layer" else nn.BatchNorm1d(H)


def pad_mask(lengths, L, device):
    """(B, L) bool, True at real positions (t < lengths[b]); None when lengths is None (no
    padding)."""
    return None if lengths is None else torch.arange(L, device=device) < lengths.to(device)[:, None]


def masked_batch_norm(norm, x, mask):
    """nn.BatchNorm1d over the real positions of a padded batch, pads set to 0. x: (B, L, H) float,
    mask: (B, L) bool -> (B, L, H). Training: normalise by the mean and biased variance of the real
    positions and move the running estimates as BatchNorm1d does (unbiased variance,
    norm.momentum); eval: the running statistics. Sums under the mask instead of x[mask]: boolean
    indexing would make the host wait for the device to count."""
    if not norm.training:
        # (B, L, H)
        return torch.where(mask[..., None], norm(x.reshape(-1, x.size(-1))).view_as(x), 0)
    m = mask[..., None].to(x.dtype)                                     # (B, L, 1)
    n = m.sum()                                                         # (), real positions
    mean = (x * m).sum((0, 1)) / n.clamp(min=1)                         # (H,)
    var = ((x - mean) ** 2 * m).sum((0, 1)) / n.clamp(min=1)            # (H,), biased
    with torch.no_grad():
        norm.running_mean.lerp_(mean.to(norm.running_mean.dtype), norm.momentum)
        norm.running_var.lerp_((var * n / (n - 1).clamp(min=1)).to(norm.running_var.dtype),
                               norm.momentum)
        norm.num_batches_tracked.add_(1)
    y = (x - mean) * torch.rsqrt(var + norm.eps) * norm.weight + norm.bias   # (B, L, H)
    return torch.where(mask[..., None], y, 0)                           # (B, L, H)


def apply_norm(norm, x, mask=None):
    """x: (B, L, H) or (B, H); mask: (B, L) bool, True = real, or None (no padding). BatchNorm
    statistics use the real positions only (pads get 0), so padding never changes real outputs;
    LayerNorm acts per position anyway."""
    if not isinstance(norm, nn.BatchNorm1d):
        return norm(x)
    if mask is None:
        return norm(x.reshape(-1, x.size(-1))).view_as(x)               # (B·L, H) -> (B, L, H)
    return masked_batch_norm(norm, x, mask)                             # (B, L, H)


# -------------------------------------------------------------------------------------- the block

class SSMLayer(nn.Module):
    """The S4 block (S4 §3.4), shared by S4, S4D and DLR. For u (B, L, H):
        z = norm(u) → pads zeroed → y = K * z + D⊙z → GELU → dropout → Linear(H→2H) → GLU →
        dropout → u + y
    (pre-norm, default; post-norm: the norm comes after the residual). kernel: s4.S4Kernel,
    dlr.DLRKernel, or any module with forward(L) -> (H, L) | (2, H, L), initial_state(B) and
    step(z_t, x) -> (K-part of y_t, x).
    Reads cfg.d_model, cfg.dropout, cfg.prenorm, cfg.norm, cfg.bidirectional."""

    def __init__(self, cfg, kernel):
        super().__init__()
        self.kernel, self.prenorm, self.p, self.bidirectional = (
            kernel, cfg.prenorm, cfg.dropout, cfg.bidirectional)
        self.D = nn.Parameter(torch.randn(cfg.d_model))              # (H,), skip connection
        self.out = nn.Linear(cfg.d_model, 2 * cfg.d_model)           # H -> 2H, halved by the GLU
        self.norm = norm_layer(cfg.norm, cfg.d_model)
        self.kernels = ((), {})          # eval, no grad: (parameter versions, {L: kernel})

    def train(self, mode=True):
        """nn.Module.train; a change of mode starts a new pass: the cached kernels are dropped."""
        self.kernels = ((), {})
        return super().train(mode)

    # a dict of tensors keyed by lengths and parameter versions: eager, as the kernel itself is
    @torch.compiler.disable
    def kernel_of(self, L):
        """self.kernel(L), computed once per evaluation pass: in eval mode under torch.no_grad() the
        kernel's parameters cannot change inside the pass, so each length's kernel is kept until
        the mode changes or a parameter is written (its version counter or storage changes:
        load_state_dict, an in-place edit, .to()). Training and autograd: computed every call.
        -> (H, L) or (2, H, L), the kernel's output itself."""
        if self.training or torch.is_grad_enabled():
            return self.kernel(L)
        versions = tuple((p.data_ptr(), p._version) for p in self.kernel.parameters())
        if versions != self.kernels[0]:
            self.kernels = (versions, {})
        cache = self.kernels[1]
        if L not in cache:
            cache[L] = self.kernel(L)
        return cache[L]

    def forward(self, u, lengths=None):
        """u: (B, L, H) float; lengths: (B,) long, or None = no padding. Returns (B, L, H), u's
        dtype. Real positions never depend on pads (pads are zeroed before the convolution). The
        kernel and the FFT run in ≥ float32, with autocast off. Raises ValueError when lengths is
        not of shape (B,)."""
        L = u.size(1)
        check_lengths(lengths, u.size(0))
        mask = pad_mask(lengths, L, u.device)                                # (B, L) or None
        z = apply_norm(self.norm, u, mask) if self.prenorm else u            # (B, L, H)
        if mask is not None:
            z = z * mask[..., None]    # so a backward kernel cannot carry pads to real positions
        with torch.autocast(u.device.type, enabled=False):           # FFT in ≥ fp32, even under AMP
            k = self.kernel_of(L)                                            # (H, L) or (2, H, L)
            dtype = torch.promote_types(k.dtype, torch.float32)
            z = z.transpose(1, 2).to(dtype)                                  # (B, H, L)
            y = fft_conv(z, k.to(dtype)) + self.D.to(dtype)[:, None] * z     # (B, H, L)
        y = tied_dropout(F.gelu(y).transpose(1, 2), self.p, self.training)   # (B, L, H)
        # (B, L, 2H) -> (B, L, H)
        y = u + tied_dropout(F.glu(self.out(y), dim=-1), self.p, self.training)
        return y if self.prenorm else apply_norm(self.norm, y, mask)         # (B, L, H)

    def initial_state(self, batch_size):
        """Zero recurrent state of the kernel, e.g. (B, H, N/2) complex. ValueError for a
        bidirectional layer."""
        require(not self.bidirectional,
                "a bidirectional layer has no recurrent view (it reads the future)")
        return self.kernel.initial_state(batch_size)

    def step(self, u_t, state):
        """The whole block for one position, in eval mode: u_t (B, H) -> (y_t (B, H), state).
        Feeding u_0, u_1, ... from initial_state gives forward(u)[:, t] (eval mode; BatchNorm uses
        its running statistics)."""
        z = apply_norm(self.norm, u_t) if self.prenorm else u_t              # (B, H)
        y, state = self.kernel.step(z, state)                                # (B, H)
        y = u_t + F.glu(self.out(F.gelu(y + self.D * z)), dim=-1)            # (B, 2H) -> (B, H)
        return (y if self.prenorm else apply_norm(self.norm, y)), state


# ----------------------------------------------------------------------------------- the backbone

class SSMBackbone(nn.Module):
    """encoder → n_layers × SSMLayer(Kernel(cfg)) → final norm: the backbone of S4, S4D (s4.S4) and
    DLR (dlr.DLR), with no head (models.py holds the heads). forward(inputs, lengths=None) ->
    (B, L, H) features, float32 at least: the residual stream stays in float32 between blocks under
    autocast too (the pixel encoder's Linear would give bf16 there, the token Embedding float32: one
    dtype for every task). inputs: (B, L) long tokens when cfg.vocab_size is set, else
    (B, L, d_input) float. lengths: (B,) long; None means no padding: lra_data.clean_batch passes None
    for a batch without pads (it knows that on the host; finding it out here would make the host
    wait for the device). Raises ValueError when lengths is not of shape (B,). With post-norm the
    last block's norm is the final norm."""

    def __init__(self, cfg, Kernel):
        super().__init__()
        self.cfg = cfg
        H = cfg.d_model
        self.encoder = (nn.Embedding(cfg.vocab_size, H, padding_idx=0) if cfg.vocab_size
                        else nn.Linear(cfg.d_input, H))
        self.layers = nn.ModuleList(SSMLayer(cfg, Kernel(cfg)) for _ in range(cfg.n_layers))
        # post-norm blocks end normed
        self.norm = norm_layer(cfg.norm, H) if cfg.prenorm else nn.Identity()

    # Under torch.compile this frame runs eagerly and what it calls (the encoder, each block, the
    # norm) compiles as its own frame: the graph break inside a block (the kernel,
    # SSMLayer.kernel_of) would, inside this loop, make dynamo skip the whole frame anyway (torch
    # 2.13: "graph breaks in loops are not supported"). recursive=False: only this frame.
    @torch.compiler.disable(recursive=False)
    def forward(self, inputs, lengths=None):
        check_lengths(lengths, inputs.size(0))
        u = self.encoder(inputs)                           # (B, L) | (B, L, d_input) -> (B, L, H)
        u = u.to(torch.promote_types(u.dtype, torch.float32))    # bf16 (autocast Linear) -> float32
        for layer in self.layers:
            u = layer(u, lengths)                                               # (B, L, H)
        return apply_norm(self.norm, u, pad_mask(lengths, u.size(1), u.device))  # (B, L, H)


# ------------------------------------------------------------------------------------ the kernel files' demo

def show_kernel(Kernel, cfg, L=64):
    """What `python s4.py` and `python dlr.py` show in a second on a CPU: the kernel K = (C B̄, C Ā B̄, C Ā² B̄, ...)
    that the convolution uses, checked against the recurrence x_k = Ā x_{k−1} + B̄ u_k, y_k = C x_k run step by step
    (Kernel.step), in float64 on a random input (S4 §2.3: the two views of one SSM). cfg: the kernel's config
    (unidirectional). Prints K's shape and the largest |y_conv − y_rec|; returns that difference (float)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        kernel = Kernel(cfg)
    finally:
        torch.set_default_dtype(old)
    with torch.no_grad():
        K = kernel(L)                                                        # (H, L)
        u = torch.randn(2, cfg.d_model, L, dtype=torch.float64)              # (B, H, L)
        y_conv = fft_conv(u, K)                                              # (B, H, L)
        x, ys = kernel.initial_state(2), []
        for t in range(L):
            y_t, x = kernel.step(u[..., t], x)                               # (B, H)
            ys.append(y_t)
        y_rec = torch.stack(ys, -1)                                          # (B, H, L)
    error = (y_conv - y_rec).abs().max().item()
    print(f"{type(kernel).__name__}: kernel K of shape {tuple(K.shape)} (H channels, L = {L} lags), "
          f"K[0, :4] = {[round(v, 4) for v in K[0, :4].tolist()]}")
    print(f"convolution (FFT) against the recurrence, float64: max |y_conv − y_rec| = {error:.1e}")
    return error
