"""Tests for dlr.py, each named after the numerical fact it checks (float64 for equivalences, tiny sizes, CPU).
The block's facts, shared by every kernel (FFT conv, recurrence == convolution, causality, padding): test_ssm.py."""
import math

import pytest
import torch

import dlr
from dlr import DLRConfig, DLRKernel, dlr_init


def double_kernel(**kw):
    """A DLRKernel whose float64 parameters come straight from the float64 init."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        return DLRKernel(DLRConfig(**kw))
    finally:
        torch.set_default_dtype(old)


def test_dlr_kernel_equals_diagonal_recurrence():
    torch.manual_seed(0)
    kernel, L = double_kernel(d_model=3, d_state=16, bidirectional=True), 40
    log_lambda, W = kernel._params()                                   # (2, N), (2, H, N)
    x, ref = torch.ones_like(log_lambda), []                           # impulse response of x_k = λ x_{k−1} + u_k
    for _ in range(L):
        ref.append((W * x[:, None]).sum(-1).real)                      # (2, H)
        x = torch.exp(log_lambda) * x
    torch.testing.assert_close(kernel(L), torch.stack(ref, -1), rtol=0, atol=1e-12, msg="DLR kernel != Re W λ^l")


def test_dlr_kernel_equals_full_power_table_at_a_length_not_a_multiple_of_the_split():
    torch.manual_seed(0)
    kernel, L = double_kernel(d_model=3, d_state=64, bidirectional=True), 1000       # split c = 64: 1000 = 15·64 + 40
    weight = torch.randn(2, 3, L, dtype=torch.float64)
    K = kernel(L)
    ours = torch.autograd.grad((K * weight).sum(), list(kernel.parameters()))
    log_lambda, W = kernel._params()
    table = torch.exp(log_lambda[:, :, None] * torch.arange(L, dtype=torch.float64))   # (2, N, L), λ^l
    ref = (W @ table).real                                                           # (2, H, L)
    torch.testing.assert_close(K, ref, rtol=0, atol=1e-12, msg="split-powers DLR kernel != Re W λ^l")
    ref = torch.autograd.grad((ref * weight).sum(), list(kernel.parameters()))
    for (name, _), a, b in zip(kernel.named_parameters(), ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=f"gradient of {name} != full-table gradient")


def test_dlr_lambda_is_inside_the_unit_circle_for_any_parameter_values():
    kernel = DLRKernel(DLRConfig(d_model=2, d_state=6, bidirectional=False))
    with torch.no_grad():
        kernel.lambda_p.copy_(torch.tensor([[0.0, 1e-5, -1e-3, 1.0, -30.0, 1e30]]))
        kernel.lambda_theta.uniform_(-100, 100)
    modulus = torch.exp(kernel._params()[0]).abs()
    assert (modulus < 1).all(), f"|λ| = {modulus}"


def test_dlr_init_has_phases_2pi_n_over_N_and_decay_from_dt_range():
    torch.manual_seed(0)
    N = 64
    p, theta = dlr_init(N, 1e-4, 0.1)
    torch.testing.assert_close(theta, 2 * math.pi * torch.arange(N, dtype=torch.float64) / N, msg="θ_n != 2πn/N")
    dt = 2 * p ** 2                                                    # log|λ_n| = −p_n² = −dt_n/2
    assert dt.min() >= 1e-4 and dt.max() <= 0.1 and dt.max() / dt.min() > 10, "dt not log-uniform in [1e-4, 0.1]"
    kernel = DLRKernel(DLRConfig(d_model=5, d_state=N))
    assert kernel.lambda_p.shape == (2, N), "one set of λ per direction, shared by all channels"
    assert kernel.W.shape == (2, 5, N, 2) and abs(kernel.W.std().item() * N - 0.5 ** 0.5) < 0.1, "W ~ N(0, 1)/N"


def test_dlr_config_refuses_a_state_size_below_one_with_a_one_line_value_error():
    with pytest.raises(ValueError, match="^d_state=0 must be >= 1$"):
        DLRConfig(d_state=0)
    DLRConfig(d_state=3)                                               # odd is fine: DLR stores no conjugate pairs


def test_dlr_imports_only_stdlib_torch_and_the_ssm_block():
    with open(dlr.__file__, encoding="utf-8") as f:
        imports = {line.split()[1].split(".")[0] for line in f if line.startswith(("import ", "from "))}
    assert imports <= {"math", "dataclasses", "typing", "torch", "ssm"}, f"dlr.py imports {imports}"
    assert {"lambda_p", "lambda_theta", "W"} == dlr.SSM_PARAMS and callable(dlr.DLR)
