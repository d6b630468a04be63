"""dlr.py: DLR, the diagonal linear RNN layer and backbone
(Gupta, Mehta, Berant, arXiv 2212.00768, 2022).
recurrent:    x_k = λ⊙x_{k-1} + u_k,  y_k = Re(W x_k)
              (λ_n = exp(−p_n² + iθ_n), one set shared by all channels)
convolution:  y = K * u,  K_l = Re(W λ^l) = Re Σ_n W_n λ_n^l
-> both views must agree: see tests/test_dlr.py and tests/test_ssm.py.
DLR is S4 with the reparameterisation removed: no HiPPO, no discretisation (Δ survives only as
the init range of |λ|: log|λ_n| = −Δ_n / 2), no B, no conjugate pairs.
Shapes: B batch, L length, H = d_model channels, N state size;
S = 1 or 2 directions (bidirectional).
The block around the kernel (FFT convolution, D skip, GELU, GLU, norms, padding) is ssm.py's.
"""
import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from ssm import SSMBackbone, SSMConfig, vandermonde

SSM_PARAMS = {"lambda_p", "lambda_theta", "W"}   # own lr (cfg.ssm_lr), no weight decay


@dataclass
class DLRConfig(SSMConfig):
    """ssm.SSMConfig's fields with DLR's defaults (Gupta et al. 2022)."""
    d_state: int = 1024              # N, complex modes λ_n (no conjugate pairs),
                                     # shared by all channels
    dt_min: float = 1e-4             # init: log|λ_n| = −dt_n/2,
                                     # dt_n log-uniform in [dt_min, dt_max]
    ssm_lr: float = 1e-4             # lr for SSM_PARAMS (train.py)


# ------------------------------------------------------------ init

def dlr_init(N, dt_min, dt_max):
    """DLR init (Gupta et al. 2022, §3): log λ_n = −½·dt_n + i·2πn/N,
    dt_n log-uniform in [dt_min, dt_max].
    Returns p = √(dt/2) and θ = 2πn/N, each (N,) float64, so that λ_n = exp(−p_n² + iθ_n)."""
    log_dt = (math.log(dt_min)                                    # (N,)
              + torch.rand(N, dtype=torch.float64) * (math.log(dt_max) - math.log(dt_min)))
    dt = torch.exp(log_dt)                                        # (N,)
    return torch.sqrt(dt / 2), 2 * math.pi * torch.arange(N, dtype=torch.float64) / N


# ------------------------------------------------------------ kernel (convolutional view)

def dlr_kernel(log_lambda, W, L):
    """DLR kernel K_{h,l} = Re Σ_n W_{h,n} λ_n^l: a Vandermonde product.
    The powers λ^l are shared by all H channels, so it is one (H×N)·(N×L) matmul per direction,
    made by ssm.vandermonde from split powers λ^{a·c}·λ^b without an (N, L) table.
    log_lambda: (S, N) complex, W: (S, H, N) complex -> K (S, H, L) real."""
    return vandermonde(W, log_lambda, L)                          # (S, H, L)


# ------------------------------------------------------------ kernel module

class DLRKernel(nn.Module):
    """The SSM of one DLR layer: per direction, N eigenvalues λ shared by the H channels and an
    output matrix W (H, N). Parameters: lambda_p, lambda_theta (S, N) with λ = exp(−p² + iθ),
    and W (S, H, N, 2), a complex matrix stored as real pairs so the optimiser only sees real
    tensors. |λ| ≤ exp(−1e-6) < 1 for any parameter values."""

    def __init__(self, cfg):
        super().__init__()
        self.H, N = cfg.d_model, cfg.d_state
        # float64 init, then cast
        S, dtype = 2 if cfg.bidirectional else 1, torch.get_default_dtype()
        p, theta = zip(*(dlr_init(N, cfg.dt_min, cfg.dt_max) for _ in range(S)))  # S × (N,) each
        self.lambda_p = nn.Parameter(torch.stack(p).to(dtype))              # (S, N)
        self.lambda_theta = nn.Parameter(torch.stack(theta).to(dtype))      # (S, N)
        W = torch.randn(S, self.H, N, dtype=dtype.to_complex()) / N         # (S, H, N), N(0, 1)/N
        self.W = nn.Parameter(torch.view_as_real(W).clone())                # (S, H, N, 2)

    def _params(self):
        """log λ: (S, N) complex, p² floored at 1e-6 so |λ| < 1 even in float32;
        W: (S, H, N) complex."""
        return (torch.complex(-(self.lambda_p ** 2).clamp(min=1e-6), self.lambda_theta),
                torch.view_as_complex(self.W))

    # complex-valued, and its split depends on L: eager under torch.compile (no recompiles)
    @torch.compiler.disable
    def forward(self, L):
        """Kernel K for length L: (H, L), or (2, H, L) = (forward, backward) when bidirectional;
        real, param dtype."""
        K = dlr_kernel(*self._params(), L)                                  # (S, H, L)
        return K[0] if K.size(0) == 1 else K                                # (H, L) or (2, H, L)

    def initial_state(self, batch_size):
        """Zero state x_{-1}: (B, H, N) complex."""
        return torch.zeros(batch_size, self.H, self.W.size(2),
                           dtype=self.W.dtype.to_complex(), device=self.W.device)

    def step(self, u, x):
        """One recurrent step (unidirectional):
        u (B, H) real, x (B, H, N) complex -> y = Re(W x) (B, H), new x."""
        log_lambda, W = self._params()
        x = torch.exp(log_lambda[0]) * x + u[..., None]                     # (B, H, N)
        return (W[0] * x).sum(-1).real, x                                   # (B, H), (B, H, N)


# ------------------------------------------------------------ backbone

def DLR(cfg):
    """DLR backbone: ssm.SSMBackbone(cfg, DLRKernel),
    encoder → n_layers × SSMLayer(DLRKernel) → final norm.
    forward(inputs (B, L) tokens or (B, L, d_input) floats, lengths (B,) or None)
    -> (B, L, H) features."""
    return SSMBackbone(cfg, DLRKernel)


if __name__ == "__main__":      # python dlr.py: the convolution kernel against the recurrence, in a second
    from ssm import show_kernel
    show_kernel(DLRKernel, DLRConfig(d_model=4, d_state=16, bidirectional=False))
