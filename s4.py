"""s4.py: S4 (HiPPO-LegS, normal plus low-rank), S4D and their backbone
(Gu et al. ICLR 2022, NeurIPS 2022).
continuous:   x'(t) = A x(t) + B u(t),  y(t) = C x(t),  A = V(Λ − P̃P̃*)V*
              (HiPPO-LegS diagonalised, S4 §3.2)
recurrent:    x_k = Ā x_{k-1} + B̄ u_k,  y_k = C x_k
              (bilinear: Ā = (I − Δ/2·A)⁻¹(I + Δ/2·A), B̄ = (I − Δ/2·A)⁻¹ΔB)
convolution:  y = K * u,  K_l = C Ā^l B̄, from its generating function at the roots of unity
              (S4 §2.4, §3.3, Alg. 1)
-> both views must agree, and K must equal C Ā^l B̄ from dense matrix powers: see tests/test_s4.py.
Shapes: B batch, L length, H = d_model channels (the papers' H), N state size;
Hk = H, or 2H when bidirectional (forward + backward SSMs).
Every SSM stores one mode of each conjugate pair: (Hk, N/2) complex, output 2·Re(...).
The block around the kernel (FFT convolution, D skip, GELU, GLU, norms, padding) is ssm.py's.
"""
import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from ssm import RFFT, SSMBackbone, SSMConfig, matmul, require, vandermonde
# public: s4.SSMLayer, s4.fft_conv, the block of S4 §3.4 and §2.4
from ssm import SSMLayer, fft_conv  # noqa: F401

# own lr (cfg.ssm_lr), no weight decay; C, D: ordinary
SSM_PARAMS = {"log_dt", "Lambda_re", "Lambda_im", "P", "B"}


@dataclass
class S4Config(SSMConfig):
    """ssm.SSMConfig's fields with S4's defaults, and the S4 / S4D choice."""
    d_state: int = 64                # N, state size (stored as N/2 complex conjugate pairs)
    mode: str = "nplr"               # "nplr" = S4 (HiPPO-LegS, bilinear)
                                     # | "diag" = S4D (diagonal, ZOH)
    diag_init: str = "lin"           # S4D init of Λ when mode="diag": "lin" (Im Λ_n = πn) | "inv"

    def __post_init__(self):
        """ValueError, one line naming the field, for a config no S4 can be built from."""
        super().__post_init__()      # the rules every SSM config shares (ssm.py)
        require(self.d_state % 2 == 0,
                f"d_state={self.d_state} must be even for S4 (N/2 conjugate pairs are stored)")
        require(self.mode in ("nplr", "diag"), f"mode={self.mode!r} must be 'nplr' or 'diag'")
        require(self.diag_init in ("lin", "inv"),
                f"diag_init={self.diag_init!r} must be 'lin' or 'inv'")


# ------------------------------------------------------------ init: HiPPO-LegS, S4D

def hippo_legs(N):
    """HiPPO-LegS (S4 §2.2, eq. 2): A_nk = −√((2n+1)(2k+1)) if n > k, −(n+1) if n = k,
    0 if n < k, B_n = √(2n+1). Returns A (N, N) and B (N,), float64."""
    q = torch.sqrt(2 * torch.arange(N, dtype=torch.float64) + 1)  # (N,)
    A = (-torch.tril(q[:, None] * q[None, :], -1)                 # (N, N)
         - torch.diag(torch.arange(1.0, N + 1, dtype=torch.float64)))
    return A, q


def nplr_legs(N):
    """HiPPO-LegS as normal plus low-rank, diagonalised (S4 §3.2, Thm. 1): A = V(Λ − P̃P̃*)V*.
    With P_n = √(n+½), A + PPᵀ = −½I + S and S is skew-symmetric, so −iS is Hermitian: eigh
    (float64) gives S = V·diag(iω)·V*, Λ = −½ + iω. S is real, so modes come in conjugate pairs:
    keep the N/2 with ω > 0. Returns Λ, P̃ = V*P, B̃ = V*B, each (N/2,) complex128, and
    V (N, N/2) complex128 (full basis: [V, conj V]). Raises ValueError for odd N."""
    require(N % 2 == 0, f"N={N} must be even (conjugate pairs)")
    A, B = hippo_legs(N)                                          # (N, N), (N,)
    P = torch.sqrt(torch.arange(N, dtype=torch.float64) + 0.5)    # (N,)
    # (N, N), skew-symmetric
    S = A + P[:, None] * P[None, :] + 0.5 * torch.eye(N, dtype=torch.float64)
    omega, V = torch.linalg.eigh(-1j * S.to(torch.complex128))    # (N,), (N, N); sorted: ±ω pairs
    omega, V = omega[N // 2:], V[:, N // 2:]                      # (N/2,), (N, N/2): the ω > 0 half
    Vh = V.conj().T                                               # (N/2, N)
    return -0.5 + 1j * omega, Vh @ P.to(V.dtype), Vh @ B.to(V.dtype), V


def s4d_init(N, kind):
    """S4D initialisations (S4D §4): "lin" Λ_n = −½ + iπn,
    "inv" Λ_n = −½ + i(N/π)(N/(2n+1) − 1), n < N/2. Returns Λ (N/2,) complex128."""
    n = torch.arange(N // 2, dtype=torch.float64)                 # (N/2,)
    imag = math.pi * n if kind == "lin" else N / math.pi * (N / (2 * n + 1) - 1)
    return torch.complex(torch.full_like(n, -0.5), imag)          # (N/2,) complex


# ------------------------------------------------------------ kernels (convolutional view)

def full(x):
    """The implied conjugate half: (..., N/2) -> (..., N) = [x, conj x]."""
    return torch.cat([x, x.conj()], -1)


def full_dot(a, b):
    """a*b over all N modes of conjugate-pair vectors given by their halves:
    2·Re Σ_{n<N/2} conj(a_n) b_n, (..., 1)."""
    return 2 * (a.conj() * b).sum(-1, keepdim=True).real


def bilinear_power(Lambda, P, C, dt, L):
    """C Ā^L for the bilinear Ā of A = Λ − PP* (all N modes); returns its pair half,
    (Hk, N/2) complex. Ā = (I − hA)⁻¹(I + hA) = 2(I − hA)⁻¹ − I with h = Δ/2, and
    I − hA = diag(d) + h·pp* is diagonal plus rank one: Sherman–Morrison gives
    Ā = diag(2/d − 1) − β·q r in O(N²), no batched N×N solve. Ā^L by repeated squaring,
    log L matmuls, in real coordinates: the system is real, so Ā on [x, x̄] is a real N×N
    matrix on [Re x, Im x], and a real matmul takes a quarter of the flops of a complex one."""
    n, h = Lambda.shape[1], (dt / 2)[:, None]                     # N/2, (Hk, 1)
    lam, p = full(Lambda), full(P)                                # (Hk, N) complex each
    d = 1 - h * lam                                               # (Hk, N), I − hΛ
    q, r = p / d, p.conj() / d                                    # (Hk, N): d⁻¹p and the row p*d⁻¹
    beta = 2 * h / (1 + h * (r * p).sum(-1, keepdim=True))        # (Hk, 1)
    # (Hk, N, N) complex
    dA = torch.diag_embed(2 / d - 1) - beta[:, :, None] * q[:, :, None] * r[:, None, :]
    # x' = M₁x + M₂x̄ (M₁ = dA[:n, :n], M₂ = dA[:n, n:]):
    # Re x' = Re(M₁+M₂)·Re x − Im(M₁−M₂)·Im x, Im x' likewise
    # (Hk, N/2, N/2) each
    plus, minus = dA[:, :n, :n] + dA[:, :n, n:], dA[:, :n, :n] - dA[:, :n, n:]
    dA = torch.cat([torch.cat([plus.real, -minus.imag], 2),       # (Hk, N, N)
                    torch.cat([plus.imag, minus.real], 2)], 1)
    Cr = torch.cat([C.real, -C.imag], -1)[:, None]      # (Hk, 1, N): 2 Re(Cx) = 2 Cr·[Re x, Im x]
    left = L                          # C Ā^L = Cr·(Ā^(2^j))^left: square while left is large and
    while left > 16:                  # send the odd factors into the row Cr (N² each, not N³)
        # (Hk, 1, N), (Hk, N, N)
        Cr, dA, left = (matmul(Cr, dA) if left % 2 else Cr), matmul(dA, dA), left // 2
    for _ in range(left):             # the last ≤ 16 factors as row × matrix too: 4 squarings less
        Cr = matmul(Cr, dA)                                       # (Hk, 1, N)
    return torch.complex(Cr[:, 0, :n], -Cr[:, 0, n:])             # (Hk, N/2), back to pair form


def nplr_kernel(Lambda, P, B, C, dt, L):
    """S4 kernel K_l = C Ā^l B̄, l < L, bilinear (S4 §2.3), for A = Λ − PP* over all N modes
    (S4 §3.3, Alg. 1). Lambda, P, B, C: (Hk, N/2) complex; dt: (Hk,) real.
    Returns K (Hk, L) real, in O(N·L + N³·log L) per channel.
    Generating function at the rfft nodes z = e^{−2πik/L}, k ≤ L/2 (K is real, the other half
    is conjugate):
        K̂(z) = Σ_{l<L} K_l z^l = C̃(I − Āz)⁻¹B̄ = 2·C̃[(2/Δ)(1−z) − (1+z)A]⁻¹B,   C̃ = C(I − Ā^L).
    This is S4's 2/(1+z)·C̃(g(z) − A)⁻¹B, g = (2/Δ)(1−z)/(1+z), multiplied by (1+z):
    no pole at z = −1 (even L).
    Woodbury with R_n(z) = 1/((2/Δ)(1−z) − (1+z)Λ_n), s = 1 + z and the Cauchy sums
    k_ab = Σ_{n<N} a_n b_n R_n:
        K̂ = 2·[k_{C̃,B} − s·k_{C̃,P} k_{P*,B} / (1 + s·k_{P*,P})].
    The Cauchy sums without an (N/2, L) Cauchy matrix: R_n(z) = δ_n/(1 − w_n z),
    with w_n = (1 + ΔΛ_n/2)/(1 − ΔΛ_n/2) and δ_n = 1/(2/Δ − Λ_n);
    since z^L = 1, 1/(1 − wz) = Σ_{l<L} (wz)^l/(1 − w^L). So k_ab is the DFT of the power sum
    f_l = Σ_n e_n w_n^l + conjugate half = 2·Re Σ_n e_n w_n^l, e_n = a_n b_n δ_n/(1 − w_n^L):
    a Vandermonde product and an rfft (|w| < 1 as Re Λ < 0, so 1 − w^L ≠ 0).
    C is learned; C̃ is computed from it here, so the step uses C."""
    Ct = C - bilinear_power(Lambda, P, C, dt, L)                    # (Hk, N/2), C̃
    hL = dt[:, None] * Lambda / 2                                   # (Hk, N/2), hΛ = ΔΛ/2
    # (Hk, N/2), log w = log((1+hΛ)/(1−hΛ)), accurate for small hΛ
    log_w = 2 * torch.atanh(hL)
    delta = 1 / ((2 / dt)[:, None] - Lambda)                        # (Hk, N/2)
    num = torch.stack([Ct * B, Ct * P, P.conj() * B, P.conj() * P], 1)  # (Hk, 4, N/2)
    e = num * (delta / -torch.expm1(L * log_w))[:, None]            # (Hk, 4, N/2), a·b·δ/(1 − w^L)
    f = vandermonde(2 * e, log_w, L)                                # (Hk, 4, L) real
    kCB, kCP, kPB, kPP = RFFT.apply(f, L).unbind(1)                 # 4 × (Hk, L/2+1), sums over N
    k = torch.arange(L // 2 + 1, dtype=dt.dtype, device=dt.device)  # (L/2+1,)
    s = 1 + torch.polar(torch.ones_like(k), -2 * math.pi * k / L)   # (L/2+1,) complex, 1 + z
    Khat = 2 * (kCB - s * kCP * kPB * torch.reciprocal(1 + s * kPP))  # (Hk, L/2+1), Woodbury
    return torch.fft.irfft(Khat, n=L)                               # (Hk, L)


def diag_kernel(Lambda, B, C, dt, L):
    """S4D kernel (S4D §3, ZOH): Ā = exp(ΔΛ), B̄ = (Ā − 1)/Λ·B, K_l = 2·Re Σ_{n<N/2} C_n B̄_n Ā_n^l.
    Lambda, B, C: (Hk, N/2) complex; dt: (Hk,). The 2·Re adds the conjugate half.
    Returns K (Hk, L) real."""
    dtA = dt[:, None] * Lambda                                    # (Hk, N/2), log Ā
    CB = C * (torch.exp(dtA) - 1) / Lambda * B                    # (Hk, N/2), C·B̄
    return vandermonde(2 * CB[:, None], dtA, L).squeeze(1)        # (Hk, L)


# ------------------------------------------------------------ kernel module

class S4Kernel(nn.Module):
    """The SSM of one S4 layer: Hk independent SSMs (one per channel and direction), N/2 modes
    each. mode "nplr": A = Λ − PP* from HiPPO-LegS, bilinear; "diag": A = Λ (S4D-Lin/Inv), ZOH.
    Parameters (complex ones as real pairs (..., 2), so the optimiser only sees real tensors):
    log_dt (Hk,), Lambda_re, Lambda_im (Hk, N/2) with Re Λ = −max(exp(Lambda_re), 1e-4),
    B, C [, P] (Hk, N/2, 2). Re Λ < 0 makes every A = Λ − PP* stable (A + A* ≺ 0) for any P,
    after any parameter update."""

    def __init__(self, cfg):
        super().__init__()
        self.mode, self.H, N = cfg.mode, cfg.d_model, cfg.d_state
        # float64 init, then cast
        Hk, dtype = self.H * (2 if cfg.bidirectional else 1), torch.get_default_dtype()
        if cfg.mode == "nplr":
            Lambda, P, B, _ = nplr_legs(N)                                  # (N/2,) complex each
            self.P = nn.Parameter(torch.view_as_real(P.repeat(Hk, 1)).to(dtype))  # (Hk, N/2, 2)
        else:
            # (N/2,) each
            Lambda, B = s4d_init(N, cfg.diag_init), torch.ones(N // 2, dtype=torch.complex128)
        log_dt = (math.log(cfg.dt_min)                                      # (Hk,)
                  + torch.rand(Hk) * (math.log(cfg.dt_max) - math.log(cfg.dt_min)))
        self.log_dt = nn.Parameter(log_dt)
        self.Lambda_re = nn.Parameter(torch.log(-Lambda.real).repeat(Hk, 1).to(dtype))  # (Hk, N/2)
        self.Lambda_im = nn.Parameter(Lambda.imag.repeat(Hk, 1).to(dtype))  # (Hk, N/2)
        self.B = nn.Parameter(torch.view_as_real(B.repeat(Hk, 1)).to(dtype))  # (Hk, N/2, 2)
        C = torch.randn(Hk, N // 2, dtype=dtype.to_complex())               # (Hk, N/2), E|C_n|² = 1
        self.C = nn.Parameter(torch.view_as_real(C).clone())                # (Hk, N/2, 2)

    def _params(self):
        """Λ, P (None for diag), B, C: (Hk, N/2) complex; Δ: (Hk,)."""
        # (Hk, N/2), Re Λ < 0 always
        Lambda = torch.complex(-self.Lambda_re.exp().clamp(min=1e-4), self.Lambda_im)
        P = torch.view_as_complex(self.P) if self.mode == "nplr" else None  # (Hk, N/2)
        return (Lambda, P, torch.view_as_complex(self.B), torch.view_as_complex(self.C),
                self.log_dt.exp())

    # complex-valued, and its loops depend on L: eager under torch.compile (no recompiles)
    @torch.compiler.disable
    def forward(self, L):
        """Kernel K for length L: (H, L), or (2, H, L) = (forward, backward) when bidirectional;
        real, param dtype."""
        Lambda, P, B, C, dt = self._params()
        K = (nplr_kernel(Lambda, P, B, C, dt, L) if self.mode == "nplr"     # (Hk, L)
             else diag_kernel(Lambda, B, C, dt, L))
        return K if K.size(0) == self.H else K.view(2, self.H, L)           # (H, L) or (2, H, L)

    def initial_state(self, batch_size):
        """Zero state x_{-1}: (B, H, N/2) complex (the conjugate half is implied)."""
        return torch.zeros(batch_size, *self.Lambda_re.shape,
                           dtype=self.Lambda_re.dtype.to_complex(),
                           device=self.Lambda_re.device)                    # (B, H, N/2)

    def step(self, u, x):
        """One recurrent step (unidirectional):
        u (B, H) real, x (B, H, N/2) complex -> y = 2·Re(C x) (B, H), new x."""
        Lambda, P, B, C, dt = self._params()
        if self.mode == "diag":                                             # ZOH, diagonal
            dA = torch.exp(dt[:, None] * Lambda)                            # (H, N/2)
            x = dA * x + (dA - 1) / Lambda * B * u[..., None]               # (B, H, N/2)
        else:   # bilinear: (I − Δ/2·A) x_k = (I + Δ/2·A) x_{k−1} + ΔB u_k, O(N) by Sherman–Morrison
            h = dt[:, None] / 2                                             # (H, 1)
            v = x + h * (Lambda * x - P * full_dot(P, x)) + 2 * h * B * u[..., None]  # (B, H, N/2)
            d = 1 - h * Lambda                                  # (H, N/2): I − Δ/2·A = diag(d) + Δ/2·PP*
            x = v / d - P / d * h * full_dot(P, v / d) / (1 + h * full_dot(P, P / d))  # (B, H, N/2)
        return 2 * (C * x).sum(-1).real, x                                  # (B, H), (B, H, N/2)


# ------------------------------------------------------------ backbone

def S4(cfg):
    """S4 and S4D backbone: ssm.SSMBackbone(cfg, S4Kernel),
    encoder → n_layers × SSMLayer(S4Kernel) → final norm.
    forward(inputs (B, L) tokens or (B, L, d_input) floats, lengths (B,) or None)
    -> (B, L, H) features."""
    return SSMBackbone(cfg, S4Kernel)


if __name__ == "__main__":      # python s4.py: the convolution kernel against the recurrence, in a second
    from ssm import show_kernel
    show_kernel(S4Kernel, S4Config(d_model=4, d_state=16, bidirectional=False))
