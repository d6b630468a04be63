"""s4.py: S4 (HiPPO-LegS, normal plus low-rank), S4D, the SSM block and backbone (Gu et al. ICLR 2022, NeurIPS 2022).
continuous:   x'(t) = A x(t) + B u(t),  y(t) = C x(t),  A = V(Λ − P̃P̃*)V*  (HiPPO-LegS diagonalised, S4 §3.2)
recurrent:    x_k = Ā x_{k-1} + B̄ u_k,  y_k = C x_k   (bilinear: Ā = (I − Δ/2·A)⁻¹(I + Δ/2·A), B̄ = (I − Δ/2·A)⁻¹ΔB)
convolution:  y = K * u,  K_l = C Ā^l B̄, from its generating function at the roots of unity (S4 §2.4, §3.3, Alg. 1)
-> both views must agree, and K must equal C Ā^l B̄ from dense matrix powers: see tests/test_s4.py.
Shapes: B batch, L length, H = d_model channels (the papers' H), N state size; Hk = H, or 2H when bidirectional
(forward + backward SSMs). Every SSM stores one mode of each conjugate pair: (Hk, N/2) complex, output 2·Re(...).
"""
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

SSM_PARAMS = {"log_dt", "Lambda_re", "Lambda_im", "P", "B"}   # own lr (cfg.ssm_lr), no weight decay; C, D: ordinary


@dataclass
class S4Config:
    d_model: int = 64                # H, channels
    n_layers: int = 4
    d_state: int = 64                # N, state size (stored as N/2 complex conjugate pairs)
    dropout: float = 0.1             # tied along L: one mask per (batch, channel)
    bidirectional: bool = True       # + a backward SSM on u_{t+1:} (shifted by one, see fft_conv); False = causal
    mode: str = "nplr"               # "nplr" = S4 (HiPPO-LegS, bilinear) | "diag" = S4D (diagonal, ZOH)
    diag_init: str = "lin"           # S4D init of Λ when mode="diag": "lin" (Im Λ_n = πn) | "inv"
    dt_min: float = 1e-3             # Δ, step size: log-uniform init in [dt_min, dt_max] per channel (PathX: 1e-4)
    dt_max: float = 1e-1
    prenorm: bool = True             # norm → mixer → residual (True) or mixer → residual → norm (False)
    norm: str = "layer"              # "layer" | "batch" (BatchNorm statistics over real positions only)
    vocab_size: Optional[int] = None  # V: tokens (B, L) -> nn.Embedding(V, D, padding_idx=0)
    d_input: int = 1                 # floats (B, L, d_input) -> nn.Linear(d_input, D), when vocab_size is None
    ssm_lr: float = 1e-3             # lr for SSM_PARAMS (train.py)


# ----------------------------------------------------------------------------- init: HiPPO-LegS, S4D

def hippo_legs(N):
    """HiPPO-LegS (S4 §2.2, eq. 2): A_nk = −√((2n+1)(2k+1)) if n > k, −(n+1) if n = k, 0 if n < k, B_n = √(2n+1).
    Returns A (N, N) and B (N,), float64."""
    q = torch.sqrt(2 * torch.arange(N, dtype=torch.float64) + 1)                     # (N,)
    A = -torch.tril(q[:, None] * q[None, :], -1) - torch.diag(torch.arange(1.0, N + 1, dtype=torch.float64))  # (N, N)
    return A, q


def nplr_legs(N):
    """HiPPO-LegS as normal plus low-rank, diagonalised (S4 §3.2, Thm. 1): A = V(Λ − P̃P̃*)V*.
    With P_n = √(n+½), A + PPᵀ = −½I + S and S is skew-symmetric, so −iS is Hermitian: eigh (float64) gives
    S = V·diag(iω)·V*, Λ = −½ + iω. S is real, so modes come in conjugate pairs: keep the N/2 with ω > 0.
    Returns Λ, P̃ = V*P, B̃ = V*B, each (N/2,) complex128, and V (N, N/2) complex128 (full basis: [V, conj V])."""
    assert N % 2 == 0, "d_state must be even (conjugate pairs)"
    A, B = hippo_legs(N)                                                             # (N, N), (N,)
    P = torch.sqrt(torch.arange(N, dtype=torch.float64) + 0.5)                      # (N,)
    S = A + P[:, None] * P[None, :] + 0.5 * torch.eye(N, dtype=torch.float64)        # (N, N), skew-symmetric
    omega, V = torch.linalg.eigh(-1j * S.to(torch.complex128))                       # (N,), (N, N); sorted: ±ω pairs
    omega, V = omega[N // 2:], V[:, N // 2:]                                         # (N/2,), (N, N/2): the ω > 0 half
    Vh = V.conj().T                                                                  # (N/2, N)
    return -0.5 + 1j * omega, Vh @ P.to(V.dtype), Vh @ B.to(V.dtype), V


def s4d_init(N, kind):
    """S4D initialisations (S4D §4): "lin" Λ_n = −½ + iπn, "inv" Λ_n = −½ + i(N/π)(N/(2n+1) − 1), n < N/2.
    Returns Λ (N/2,) complex128."""
    n = torch.arange(N // 2, dtype=torch.float64)                                    # (N/2,)
    imag = math.pi * n if kind == "lin" else N / math.pi * (N / (2 * n + 1) - 1)
    return torch.complex(torch.full_like(n, -0.5), imag)                             # (N/2,) complex


# ----------------------------------------------------------------------------- kernels (convolutional view)

def full(x):
    """The implied conjugate half: (..., N/2) -> (..., N) = [x, conj x]."""
    return torch.cat([x, x.conj()], -1)


def full_dot(a, b):
    """a*b over all N modes of conjugate-pair vectors given by their halves: 2·Re Σ_{n<N/2} conj(a_n) b_n, (..., 1)."""
    return 2 * (a.conj() * b).sum(-1, keepdim=True).real


def nplr_kernel(Lambda, P, B, C, dt, L):
    """S4 kernel K_l = C Ā^l B̄, l < L, bilinear (S4 §2.3), for A = Λ − PP* over all N modes (S4 §3.3, Alg. 1).
    Lambda, P, B, C: (Hk, N/2) complex; dt: (Hk,) real. Returns K (Hk, L) real, in O(N·L + N³·log L) per channel.
    Generating function at the rfft nodes z = e^{−2πik/L}, k ≤ L/2 (K is real, the other half is conjugate):
        K̂(z) = Σ_{l<L} K_l z^l = C̃(I − Āz)⁻¹B̄ = 2·C̃[(2/Δ)(1−z) − (1+z)A]⁻¹B,   C̃ = C(I − Ā^L).
    This is S4's 2/(1+z)·C̃(g(z) − A)⁻¹B, g = (2/Δ)(1−z)/(1+z), multiplied by (1+z): no pole at z = −1 (even L).
    Woodbury with R_n(z) = 1/((2/Δ)(1−z) − (1+z)Λ_n), s = 1 + z and the Cauchy sums k_ab = Σ_{n<N} a_n b_n R_n:
        K̂ = 2·[k_{C̃,B} − s·k_{C̃,P} k_{P*,B} / (1 + s·k_{P*,P})].
    C is learned; C̃ is computed from it here (Ā^L by repeated squaring), so the step uses C for any L."""
    N = 2 * Lambda.shape[1]
    A = torch.diag_embed(full(Lambda)) - full(P)[:, :, None] * full(P).conj()[:, None, :]   # (Hk, N, N) complex
    I = torch.eye(N, dtype=A.dtype, device=A.device)                                 # (N, N)
    h = (dt / 2)[:, None, None]                                                      # (Hk, 1, 1)
    dA = torch.linalg.solve(I - h * A, I + h * A)                                    # (Hk, N, N), bilinear Ā
    CAL = (full(C)[:, None, :] @ torch.linalg.matrix_power(dA, L))[:, 0]              # (Hk, N), C Ā^L
    Ct = C - CAL[:, : N // 2]                                                        # (Hk, N/2), C̃
    k = torch.arange(L // 2 + 1, dtype=dt.dtype, device=dt.device)                   # (L/2+1,)
    z = torch.polar(torch.ones_like(k), -2 * math.pi * k / L)                        # (L/2+1,) complex, roots of unity
    a, s = (2 / dt)[:, None, None] * (1 - z), 1 + z                                  # (Hk, 1, L/2+1), (L/2+1,)
    R = 1 / (a - s * Lambda[:, :, None])                                             # (Hk, N/2, L/2+1), Cauchy
    Rc = 1 / (a - s * Lambda.conj()[:, :, None])                                     # (Hk, N/2, L/2+1), conjugate half
    num = torch.stack([Ct * B, Ct * P, P.conj() * B, P.conj() * P], 1)               # (Hk, 4, N/2)
    kCB, kCP, kPB, kPP = (num @ R + num.conj() @ Rc).unbind(1)                       # 4 × (Hk, L/2+1), sums over N
    Khat = 2 * (kCB - s * kCP * kPB / (1 + s * kPP))                                 # (Hk, L/2+1), Woodbury
    return torch.fft.irfft(Khat, n=L)                                                # (Hk, L)


def diag_kernel(Lambda, B, C, dt, L):
    """S4D kernel (S4D §3, ZOH): Ā = exp(ΔΛ), B̄ = (Ā − 1)/Λ·B, K_l = 2·Re Σ_{n<N/2} C_n B̄_n Ā_n^l.
    Lambda, B, C: (Hk, N/2) complex; dt: (Hk,). The 2·Re adds the conjugate half. Returns K (Hk, L) real."""
    dtA = dt[:, None] * Lambda                                                       # (Hk, N/2)
    CB = C * (torch.exp(dtA) - 1) / Lambda * B                                       # (Hk, N/2), C·B̄
    l = torch.arange(L, dtype=dt.dtype, device=dt.device)                            # (L,)
    V = torch.exp(dtA[:, :, None] * l)                                               # (Hk, N/2, L), Vandermonde Ā^l
    return 2 * torch.einsum("hn,hnl->hl", CB, V).real                                # (Hk, L)


def fft_conv(u, k):
    """Linear (not circular) convolution by FFT (S4 §2.4), both signals zero-padded to 2L.
    u: (B, H, L). k: (H, L) causal kernel, y_t = Σ_{s≤t} k_{t−s} u_s; or (2, H, L) = (k⁰, k¹), bidirectional:
        y_t = Σ_{s≤t} k⁰_{t−s} u_s + Σ_{s>t} k¹_{s−t−1} u_s,
    i.e. k¹ runs on the time-reversed input shifted by one step, so u_t is counted once (by k⁰), as in S4.
    Returns (B, H, L)."""
    L = u.size(-1)
    if k.dim() == 3:                                        # lag −m (m = 1..L) sits at index 2L − m of the period
        k = F.pad(k[0], (0, L)) + F.pad(k[1].flip(-1), (L, 0))                       # (H, 2L)
    y = torch.fft.irfft(torch.fft.rfft(u, n=2 * L) * torch.fft.rfft(k, n=2 * L), n=2 * L)   # (B, H, 2L)
    return y[..., :L]                                                                # (B, H, L)


# ----------------------------------------------------------------------------- kernel module

class S4Kernel(nn.Module):
    """The SSM of one S4 layer: Hk independent SSMs (one per channel and direction), N/2 modes each.
    mode "nplr": A = Λ − PP* from HiPPO-LegS, bilinear; "diag": A = Λ (S4D-Lin/Inv), ZOH.
    Parameters (complex ones as real pairs (..., 2), so the optimiser only sees real tensors):
    log_dt (Hk,), Lambda_re, Lambda_im (Hk, N/2) with Re Λ = −max(exp(Lambda_re), 1e-4), B, C [, P] (Hk, N/2, 2).
    Re Λ < 0 makes every A = Λ − PP* stable (A + A* ≺ 0) for any P, after any parameter update."""

    def __init__(self, cfg):
        super().__init__()
        assert cfg.mode in ("nplr", "diag") and cfg.diag_init in ("lin", "inv"), "mode: nplr|diag, diag_init: lin|inv"
        self.mode, self.H, N = cfg.mode, cfg.d_model, cfg.d_state
        Hk, dtype = self.H * (2 if cfg.bidirectional else 1), torch.get_default_dtype()   # float64 init, then cast
        if cfg.mode == "nplr":
            Lambda, P, B, _ = nplr_legs(N)                                           # (N/2,) complex each
            self.P = nn.Parameter(torch.view_as_real(P.repeat(Hk, 1)).to(dtype))     # (Hk, N/2, 2)
        else:
            Lambda, B = s4d_init(N, cfg.diag_init), torch.ones(N // 2, dtype=torch.complex128)   # (N/2,) each
        log_dt = math.log(cfg.dt_min) + torch.rand(Hk) * (math.log(cfg.dt_max) - math.log(cfg.dt_min))   # (Hk,)
        self.log_dt = nn.Parameter(log_dt)
        self.Lambda_re = nn.Parameter(torch.log(-Lambda.real).repeat(Hk, 1).to(dtype))  # (Hk, N/2)
        self.Lambda_im = nn.Parameter(Lambda.imag.repeat(Hk, 1).to(dtype))           # (Hk, N/2)
        self.B = nn.Parameter(torch.view_as_real(B.repeat(Hk, 1)).to(dtype))         # (Hk, N/2, 2)
        C = torch.randn(Hk, N // 2, dtype=dtype.to_complex())                       # (Hk, N/2), E|C_n|² = 1
        self.C = nn.Parameter(torch.view_as_real(C).clone())                         # (Hk, N/2, 2)

    def _params(self):
        """Λ, P (None for diag), B, C: (Hk, N/2) complex; Δ: (Hk,)."""
        Lambda = torch.complex(-self.Lambda_re.exp().clamp(min=1e-4), self.Lambda_im)  # (Hk, N/2), Re Λ < 0 always
        P = torch.view_as_complex(self.P) if self.mode == "nplr" else None           # (Hk, N/2)
        return Lambda, P, torch.view_as_complex(self.B), torch.view_as_complex(self.C), self.log_dt.exp()

    def forward(self, L):
        """Kernel K for length L: (H, L), or (2, H, L) = (forward, backward) when bidirectional; real, param dtype."""
        Lambda, P, B, C, dt = self._params()
        K = nplr_kernel(Lambda, P, B, C, dt, L) if self.mode == "nplr" else diag_kernel(Lambda, B, C, dt, L)  # (Hk, L)
        return K if K.size(0) == self.H else K.view(2, self.H, L)                   # (H, L) or (2, H, L)

    def initial_state(self, batch_size):
        """Zero state x_{-1}: (B, H, N/2) complex (the conjugate half is implied)."""
        return torch.zeros(batch_size, *self.Lambda_re.shape, dtype=self.Lambda_re.dtype.to_complex(),
                           device=self.Lambda_re.device)                            # (B, H, N/2)

    def step(self, u, x):
        """One recurrent step (unidirectional): u (B, H) real, x (B, H, N/2) complex -> y = 2·Re(C x) (B, H), new x."""
        Lambda, P, B, C, dt = self._params()
        if self.mode == "diag":                                                      # ZOH, diagonal
            dA = torch.exp(dt[:, None] * Lambda)                                     # (H, N/2)
            x = dA * x + (dA - 1) / Lambda * B * u[..., None]                        # (B, H, N/2)
        else:   # bilinear: (I − Δ/2·A) x_k = (I + Δ/2·A) x_{k−1} + ΔB u_k, O(N) by Sherman–Morrison
            h = dt[:, None] / 2                                                      # (H, 1)
            v = x + h * (Lambda * x - P * full_dot(P, x)) + 2 * h * B * u[..., None]  # (B, H, N/2)
            d = 1 - h * Lambda                                                       # (H, N/2); I − Δ/2·A = d + Δ/2·PP*
            x = v / d - P / d * h * full_dot(P, v / d) / (1 + h * full_dot(P, P / d))  # (B, H, N/2)
        return 2 * (C * x).sum(-1).real, x                                           # (B, H), (B, H, N/2)


# ----------------------------------------------------------------------------- the SSM block (shared with dlr.py)

def tied_dropout(x, p, training):
    """Dropout with one mask per (batch, channel), tied along L. x: (B, L, H) -> (B, L, H)."""
    if not training or p == 0:
        return x
    mask = torch.bernoulli(torch.full_like(x[:, :1], 1 - p))                         # (B, 1, H)
    return x * mask / (1 - p)                                                        # (B, L, H)


def norm_layer(kind, H):
    """nn.LayerNorm(H) for "layer", nn.BatchNorm1d(H) for "batch"."""
    assert kind in ("layer", "batch"), f"norm must be 'layer' or 'batch', got {kind!r}"
    return nn.LayerNorm(H) if kind == "layer" else nn.BatchNorm1d(H)


def pad_mask(lengths, L, device):
    """(B, L) bool, True at real positions (t < lengths[b]); None when lengths is None (all real)."""
    return None if lengths is None else torch.arange(L, device=device) < lengths.to(device)[:, None]


def apply_norm(norm, x, mask=None):
    """x: (B, L, H) or (B, H); mask: (B, L) bool, True = real. BatchNorm statistics use real positions only
    (pads get 0), so padding never changes real outputs; LayerNorm acts per position anyway."""
    if not isinstance(norm, nn.BatchNorm1d):
        return norm(x)
    if mask is None:
        return norm(x.reshape(-1, x.size(-1))).view_as(x)                            # (B·L, H) -> (B, L, H)
    y = norm(x[mask])                                                                # (real positions, H)
    out = y.new_zeros(x.shape)                                                       # (B, L, H)
    out[mask] = y
    return out


class SSMLayer(nn.Module):
    """The S4 block (S4 §3.4), shared by S4, S4D and DLR. For u (B, L, H):
        z = norm(u) → pads zeroed → y = K * z + D⊙z → GELU → dropout → Linear(H→2H) → GLU → dropout → u + y
    (pre-norm, default; post-norm: the norm comes after the residual). kernel: S4Kernel or DLRKernel, any module
    with forward(L) -> (H, L) | (2, H, L), initial_state(B) and step(z_t, x) -> (K-part of y_t, x).
    Reads cfg.d_model, cfg.dropout, cfg.prenorm, cfg.norm."""

    def __init__(self, cfg, kernel):
        super().__init__()
        self.kernel, self.prenorm, self.p, self.bidirectional = kernel, cfg.prenorm, cfg.dropout, cfg.bidirectional
        self.D = nn.Parameter(torch.randn(cfg.d_model))                              # (H,), skip connection
        self.out = nn.Linear(cfg.d_model, 2 * cfg.d_model)                           # H -> 2H, halved by the GLU
        self.norm = norm_layer(cfg.norm, cfg.d_model)

    def forward(self, u, lengths=None):
        """u: (B, L, H) float; lengths: (B,) long or None (all real). Returns (B, L, H); real positions never
        depend on pads (pads are zeroed before the convolution)."""
        L = u.size(1)
        mask = pad_mask(lengths, L, u.device)                                        # (B, L) or None
        z = apply_norm(self.norm, u, mask) if self.prenorm else u                    # (B, L, H)
        if mask is not None:
            z = z * mask[..., None]                       # so a backward kernel cannot carry pads to real positions
        with torch.autocast(u.device.type, enabled=False):                           # FFT in ≥ fp32, even under AMP
            k = self.kernel(L)                                                       # (H, L) or (2, H, L)
            dtype = torch.promote_types(k.dtype, torch.float32)
            z = z.transpose(1, 2).to(dtype)                                          # (B, H, L)
            y = fft_conv(z, k.to(dtype)) + self.D.to(dtype)[:, None] * z             # (B, H, L)
        y = tied_dropout(F.gelu(y).transpose(1, 2), self.p, self.training)           # (B, L, H)
        y = u + tied_dropout(F.glu(self.out(y), dim=-1), self.p, self.training)      # (B, L, 2H) -> (B, L, H)
        return y if self.prenorm else apply_norm(self.norm, y, mask)                 # (B, L, H)

    def initial_state(self, batch_size):
        """Zero recurrent state of the kernel, e.g. (B, H, N/2) complex. Unidirectional layers only."""
        assert not self.bidirectional, "a bidirectional layer has no recurrent view"
        return self.kernel.initial_state(batch_size)

    def step(self, u_t, state):
        """The whole block for one position, in eval mode: u_t (B, H) -> (y_t (B, H), state). Feeding u_0, u_1, ...
        from initial_state gives forward(u)[:, t] (eval mode; BatchNorm uses its running statistics)."""
        z = apply_norm(self.norm, u_t) if self.prenorm else u_t                      # (B, H)
        y, state = self.kernel.step(z, state)                                        # (B, H)
        y = u_t + F.glu(self.out(F.gelu(y + self.D * z)), dim=-1)                    # (B, 2H) -> (B, H)
        return (y if self.prenorm else apply_norm(self.norm, y)), state


# ----------------------------------------------------------------------------- backbone

class S4(nn.Module):
    """S4 backbone: encoder → n_layers × SSMLayer → final norm. forward(x, lengths=None) -> (B, L, D) features.
    x: (B, L) long tokens when cfg.vocab_size is set, else (B, L, d_input) float; lengths: (B,) long or None.
    With post-norm the last block's norm is the final norm. No head (train.py owns heads)."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        D = cfg.d_model
        self.encoder = nn.Embedding(cfg.vocab_size, D, padding_idx=0) if cfg.vocab_size else nn.Linear(cfg.d_input, D)
        self.layers = nn.ModuleList(SSMLayer(cfg, S4Kernel(cfg)) for _ in range(cfg.n_layers))
        self.norm = norm_layer(cfg.norm, D) if cfg.prenorm else nn.Identity()        # post-norm blocks end normed

    def forward(self, x, lengths=None):
        h = self.encoder(x)                                               # (B, L) | (B, L, d_input) -> (B, L, D)
        for layer in self.layers:
            h = layer(h, lengths)                                                    # (B, L, D)
        return apply_norm(self.norm, h, pad_mask(lengths, h.size(1), h.device))      # (B, L, D)
