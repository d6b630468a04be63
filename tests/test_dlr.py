"""Tests for dlr.py, each named after the numerical fact it checks (float64 for equivalences, tiny sizes, CPU)."""
import math

import pytest
import torch

from dlr import DLR, SSM_PARAMS, DLRConfig, DLRKernel, dlr_init
from s4 import SSMLayer, fft_conv


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


def test_dlr_kernel_autograd_keeps_no_N_by_L_table():
    L, N = 4096, 256
    kernel = DLRKernel(DLRConfig(d_model=4, d_state=N))                # S = 2 directions
    sizes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t, lambda t: t):
        K = kernel(L)
    K.square().sum().backward()
    assert max(sizes) < 2 * N * L / 8, f"autograd keeps a {max(sizes)}-element tensor: an (S, N, L) table of λ^l?"


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("L", [16, 17])
def test_dlr_layer_convolution_equals_step_by_step_recurrence(dtype, tol, L):
    torch.manual_seed(0)
    cfg = DLRConfig(d_model=4, d_state=32, bidirectional=False, dropout=0.0)
    layer = SSMLayer(cfg, DLRKernel(cfg)).to(dtype).eval()
    u = torch.randn(2, L, 4, dtype=dtype)
    state, ys = layer.initial_state(2), []
    with torch.no_grad():
        for t in range(L):
            y_t, state = layer.step(u[:, t], state)
            ys.append(y_t)
        torch.testing.assert_close(torch.stack(ys, 1), layer(u), rtol=tol, atol=tol, msg="recurrent and FFT views disagree")


def test_dlr_impulse_at_last_position_does_not_reach_t0():
    L = 32
    kernel = double_kernel(d_model=4, d_state=32, bidirectional=False)
    u = torch.zeros(1, 4, L, dtype=torch.float64)
    u[..., -1] = 1.0
    with torch.no_grad():
        y = fft_conv(u, kernel(L))
    assert y[..., :-1].abs().max() < 1e-12, "the convolution wrapped around: circular instead of linear"


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


def test_unidirectional_dlr_outputs_ignore_future_inputs():
    torch.manual_seed(0)
    model = DLR(DLRConfig(d_model=8, n_layers=2, d_state=16, bidirectional=False, d_input=2)).double().eval()
    x, t0 = torch.randn(2, 20, 2, dtype=torch.float64), 11
    x2 = x.clone()
    x2[:, t0 + 1:] = torch.randn(2, 20 - t0 - 1, 2, dtype=torch.float64)
    with torch.no_grad():
        y, y2 = model(x), model(x2)
    torch.testing.assert_close(y2[:, : t0 + 1], y[:, : t0 + 1], rtol=0, atol=1e-10, msg="causal DLR saw the future")
    assert (y2[:, t0 + 1:] - y[:, t0 + 1:]).abs().max() > 1e-3, "changed inputs should change later outputs"


def test_bidirectional_dlr_padded_batch_equals_each_sequence_alone():
    torch.manual_seed(0)
    model = DLR(DLRConfig(d_model=8, n_layers=2, d_state=16, d_input=2, dropout=0.0)).eval()
    lengths = torch.tensor([9, 5, 0])                                  # the last row is all padding
    x = torch.randn(3, 9, 2)
    x[torch.arange(9) >= lengths[:, None]] = 7.0                       # junk in the pads must not matter
    y = model(x, lengths)
    for b in range(2):
        alone = model(x[b:b + 1, : lengths[b]])
        torch.testing.assert_close(y[b, : lengths[b]], alone[0], rtol=1e-5, atol=1e-5, msg=f"row {b}: padding leaked")
    y.sum().backward()
    assert torch.isfinite(y).all(), "all-padding row gives non-finite features"
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None), "non-finite grads"


def test_dlr_kernel_at_length_16384_is_finite_with_finite_grads():
    kernel = DLRKernel(DLRConfig(d_model=2, d_state=256))               # bidirectional: both directions
    K = kernel(16384)
    assert K.shape == (2, 2, 16384) and torch.isfinite(K).all(), "non-finite kernel at L = 16384"
    K.pow(2).mean().backward()
    for name, p in kernel.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), f"non-finite gradient for {name}"


def test_dlr_ssm_params_are_real_and_named_in_ssm_params():
    model = DLR(DLRConfig(d_model=4, n_layers=1, d_state=8))
    leaves = {n.rsplit(".", 1)[-1] for n, _ in model.named_parameters()}
    assert not any(p.is_complex() for p in model.parameters()), "AdamW must not see complex parameters"
    assert SSM_PARAMS <= leaves, leaves


def test_dlr_maps_tokens_and_floats_to_features():
    tokens = DLR(DLRConfig(d_model=8, n_layers=2, d_state=16, vocab_size=20))
    floats = DLR(DLRConfig(d_model=8, n_layers=2, d_state=16, d_input=2, bidirectional=False))
    assert tokens(torch.randint(0, 20, (3, 11))).shape == (3, 11, 8)
    assert floats(torch.randn(3, 11, 2)).shape == (3, 11, 8)
