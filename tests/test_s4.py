"""Tests for s4.py, each named after the numerical fact it checks (float64 for equivalences, tiny sizes, CPU)."""
import contextlib

import pytest
import torch

from s4 import (RFFT, S4, SSM_PARAMS, S4Config, S4Kernel, SSMLayer, bilinear_power, fft_conv, full, hippo_legs, nplr_legs,
                s4d_init, vandermonde)


@contextlib.contextmanager
def default_dtype(dtype):
    """Build modules with float64 parameters from the start (init is computed in float64, then cast)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def bilinear_powers(A, B, C, dt, L):
    """Reference kernel C Ā^l B̄, l < L, from explicit powers of the dense bilinear-discretised matrix."""
    I = torch.eye(A.size(0), dtype=A.dtype)
    dA, dB = torch.linalg.solve(I - dt / 2 * A, I + dt / 2 * A), torch.linalg.solve(I - dt / 2 * A, dt * B)
    ks = []
    for _ in range(L):
        ks.append(C @ dB)
        dB = dA @ dB
    return torch.stack(ks)


def test_hippo_legs_matches_closed_form_and_is_normal_plus_low_rank():
    N = 7
    A, B = hippo_legs(N)
    for n in range(N):
        assert B[n] == pytest.approx((2 * n + 1) ** 0.5)
        for k in range(N):
            ref = -((2 * n + 1) * (2 * k + 1)) ** 0.5 if n > k else (-(n + 1) if n == k else 0.0)
            assert A[n, k] == pytest.approx(ref, abs=1e-12), f"A[{n},{k}]"
    P = torch.sqrt(torch.arange(N, dtype=torch.float64) + 0.5)
    S = A + torch.outer(P, P) + 0.5 * torch.eye(N, dtype=torch.float64)
    torch.testing.assert_close(S, -S.T, rtol=0, atol=1e-12, msg="A + PPᵀ + ½I is not skew-symmetric")


def test_nplr_diagonalisation_reconstructs_hippo_legs():
    N = 8
    A, B = hippo_legs(N)
    Lambda, P, Bt, V = nplr_legs(N)
    Vf = torch.cat([V, V.conj()], 1)                                   # (N, N): modes and their conjugates
    torch.testing.assert_close(Vf.conj().T @ Vf, torch.eye(N, dtype=Vf.dtype), rtol=0, atol=1e-12, msg="V not unitary")
    A_rec = Vf @ (torch.diag(full(Lambda)) - torch.outer(full(P), full(P).conj())) @ Vf.conj().T
    torch.testing.assert_close(A_rec, A.to(Vf.dtype), rtol=0, atol=1e-10, msg="V(Λ − P̃P̃*)V* != HiPPO-LegS A")
    torch.testing.assert_close(Vf @ full(Bt), B.to(Vf.dtype), rtol=0, atol=1e-10, msg="V B̃ != B")
    assert torch.allclose(Lambda.real, torch.full_like(Lambda.real, -0.5)) and (Lambda.imag > 0).all()


def test_nplr_kernel_equals_dense_bilinear_powers_of_hippo_at_init():
    N, L, dts = 8, 64, [1e-3, 0.05, 0.5]
    with default_dtype(torch.float64):
        kernel = S4Kernel(S4Config(d_model=3, d_state=N, bidirectional=False))
    with torch.no_grad():
        kernel.log_dt.copy_(torch.tensor(dts, dtype=torch.float64).log())
    A, B = hippo_legs(N)
    V = nplr_legs(N)[3]
    C = (full(torch.view_as_complex(kernel.C)) @ torch.cat([V, V.conj()], 1).conj().T).real   # (H, N): C in HiPPO basis
    ref = torch.stack([bilinear_powers(A, B, C[h], dt, L) for h, dt in enumerate(kernel.log_dt.detach().exp())])
    torch.testing.assert_close(kernel(L), ref, rtol=0, atol=1e-8, msg="generating-function kernel != C̄ Ā^l B̄")


@pytest.mark.parametrize("L", [64, 63])
def test_nplr_kernel_equals_dense_bilinear_powers_for_any_parameters(L):
    torch.manual_seed(0)
    N = 8
    with default_dtype(torch.float64):
        kernel = S4Kernel(S4Config(d_model=2, d_state=N, bidirectional=False))
    with torch.no_grad():                                              # move away from HiPPO: any trained values
        for p in (kernel.Lambda_re, kernel.Lambda_im, kernel.P, kernel.B):
            p.add_(0.3 * torch.randn_like(p))
        kernel.log_dt.copy_(torch.tensor([0.02, 0.3], dtype=torch.float64).log())
    Lambda, P, B, C, dt = kernel._params()
    for h in range(2):
        A = torch.diag(full(Lambda[h])) - torch.outer(full(P[h]), full(P[h]).conj())   # (N, N) complex, full basis
        ref = bilinear_powers(A, full(B[h]), full(C[h]), dt[h], L)
        assert ref.imag.abs().max() < 1e-12, "conjugate-pair system should have a real kernel"
        torch.testing.assert_close(kernel(L)[h], ref.real, rtol=0, atol=1e-8, msg=f"channel {h}: kernel != C̄ Ā^l B̄")


def test_s4d_init_lin_and_inv_follow_the_s4d_formulas():
    N, n = 16, torch.arange(8, dtype=torch.float64)
    lin, inv = s4d_init(N, "lin"), s4d_init(N, "inv")
    assert (lin.real == -0.5).all() and (inv.real == -0.5).all(), "Re Λ must start at −½"
    torch.testing.assert_close(lin.imag, torch.pi * n, msg="S4D-Lin: Im Λ_n = πn")
    torch.testing.assert_close(inv.imag, N / torch.pi * (N / (2 * n + 1) - 1), msg="S4D-Inv: Im Λ_n = N/π(N/(2n+1) − 1)")


def test_diag_kernel_equals_zoh_diagonal_recurrence():
    N, L = 8, 40
    with default_dtype(torch.float64):
        kernel = S4Kernel(S4Config(d_model=3, d_state=N, bidirectional=False, mode="diag", diag_init="inv"))
    Lambda, _, B, C, dt = kernel._params()
    dA = torch.exp(dt[:, None] * Lambda)                              # (H, N/2)
    x, ref = (dA - 1) / Lambda * B, []                                 # impulse response: x_0 = B̄
    for _ in range(L):
        ref.append(2 * (C * x).sum(-1).real)
        x = dA * x
    torch.testing.assert_close(kernel(L), torch.stack(ref, -1), rtol=0, atol=1e-10, msg="S4D kernel != 2Re C Ā^l B̄")


def test_fft_conv_equals_naive_sums_with_backward_branch_shifted_by_one():
    torch.manual_seed(0)
    L = 7
    u, k = torch.randn(2, 3, L, dtype=torch.float64), torch.randn(2, 3, L, dtype=torch.float64)
    causal = torch.zeros_like(u)
    bidir = torch.zeros_like(u)
    for t in range(L):
        for s in range(L):
            if s <= t:
                causal[..., t] += k[0, :, t - s] * u[..., s]
            else:                                                     # backward kernel: lag s − t − 1, u_t counted once
                bidir[..., t] += k[1, :, s - t - 1] * u[..., s]
    torch.testing.assert_close(fft_conv(u, k[0]), causal, msg="causal FFT conv != Σ_{s≤t} k_{t−s} u_s")
    torch.testing.assert_close(fft_conv(u, k), causal + bidir, msg="bidirectional FFT conv != naive sums")


@pytest.mark.parametrize("mode", ["nplr", "diag"])
def test_impulse_at_last_position_does_not_reach_t0(mode):
    L = 32
    kernel = S4Kernel(S4Config(d_model=4, d_state=8, bidirectional=False, mode=mode)).double()
    u = torch.zeros(1, 4, L, dtype=torch.float64)
    u[..., -1] = 1.0
    with torch.no_grad():
        y = fft_conv(u, kernel(L))
    assert y[..., :-1].abs().max() < 1e-12, "the convolution wrapped around: circular instead of linear"


@pytest.mark.parametrize("mode", ["nplr", "diag"])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("L", [16, 17])
@pytest.mark.parametrize("norm,prenorm", [("layer", True), ("batch", False)])
def test_layer_convolution_equals_step_by_step_recurrence(mode, dtype, tol, L, norm, prenorm):
    torch.manual_seed(0)
    cfg = S4Config(d_model=4, d_state=8, bidirectional=False, mode=mode, dropout=0.0, norm=norm, prenorm=prenorm)
    with default_dtype(dtype):
        layer = SSMLayer(cfg, S4Kernel(cfg)).eval()
    if norm == "batch":                                                # non-trivial running statistics
        layer.norm.running_mean.normal_(), layer.norm.running_var.uniform_(0.5, 2)
    u = torch.randn(2, L, 4, dtype=dtype)
    state, ys = layer.initial_state(2), []
    with torch.no_grad():
        for t in range(L):
            y_t, state = layer.step(u[:, t], state)
            ys.append(y_t)
        torch.testing.assert_close(torch.stack(ys, 1), layer(u), rtol=tol, atol=tol, msg="recurrent and FFT views disagree")


@pytest.mark.parametrize("mode", ["nplr", "diag"])
def test_unidirectional_s4_outputs_ignore_future_inputs(mode):
    torch.manual_seed(0)
    with default_dtype(torch.float64):
        model = S4(S4Config(d_model=8, n_layers=2, d_state=8, bidirectional=False, mode=mode, d_input=2)).eval()
    x, t0 = torch.randn(2, 20, 2, dtype=torch.float64), 11
    x2 = x.clone()
    x2[:, t0 + 1:] = torch.randn(2, 20 - t0 - 1, 2, dtype=torch.float64)
    with torch.no_grad():
        y, y2 = model(x), model(x2)
    torch.testing.assert_close(y2[:, : t0 + 1], y[:, : t0 + 1], rtol=0, atol=1e-10, msg="causal S4 saw the future")
    assert (y2[:, t0 + 1:] - y[:, t0 + 1:]).abs().max() > 1e-3, "changed inputs should change later outputs"


@pytest.mark.parametrize("mode", ["nplr", "diag"])
def test_bidirectional_s4_padded_batch_equals_each_sequence_alone(mode):
    torch.manual_seed(0)
    model = S4(S4Config(d_model=8, n_layers=2, d_state=8, mode=mode, vocab_size=12, dropout=0.0)).eval()
    lengths = torch.tensor([9, 5, 0])                                  # the last row is all padding
    x = torch.randint(4, 12, (3, 9)) * (torch.arange(9) < lengths[:, None])
    y = model(x, lengths)
    for b in range(2):
        alone = model(x[b:b + 1, : lengths[b]])
        torch.testing.assert_close(y[b, : lengths[b]], alone[0], rtol=1e-5, atol=1e-5, msg=f"row {b}: padding leaked")
    y.sum().backward()
    assert torch.isfinite(y).all(), "all-padding row gives non-finite features"
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None), "non-finite grads"


def test_batchnorm_in_training_ignores_pad_content():
    torch.manual_seed(0)
    model = S4(S4Config(d_model=8, n_layers=2, d_state=8, vocab_size=12, dropout=0.0, norm="batch", prenorm=False))
    lengths = torch.tensor([9, 5])
    real = torch.arange(9) < lengths[:, None]                          # (B, L)
    x = torch.randint(4, 12, (2, 9))
    y_zero_pads = model(x * real, lengths)
    y_junk_pads = model(x, lengths)                                    # same real tokens, junk in the pads
    torch.testing.assert_close(y_junk_pads[real], y_zero_pads[real], msg="BatchNorm statistics saw the pads")


def test_re_lambda_stays_negative_after_a_huge_optimizer_step():
    for mode in ("nplr", "diag"):
        kernel = S4Kernel(S4Config(d_model=2, d_state=8, mode=mode))
        opt = torch.optim.AdamW(kernel.parameters(), lr=1e4)
        kernel(16).sum().backward()
        opt.step()
        Lambda = kernel._params()[0]
        assert (Lambda.real < 0).all(), f"{mode}: Re Λ >= 0 after an update"


@pytest.mark.parametrize("mode", ["nplr", "diag"])
def test_kernel_at_length_16384_is_finite_with_finite_grads(mode):
    kernel = S4Kernel(S4Config(d_model=2, d_state=16, mode=mode))      # bidirectional: both directions
    K = kernel(16384)
    assert K.shape == (2, 2, 16384) and torch.isfinite(K).all(), "non-finite kernel at L = 16384"
    K.pow(2).mean().backward()
    for name, p in kernel.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), f"non-finite gradient for {name}"


def test_ssm_params_are_real_and_named_in_ssm_params():
    for mode in ("nplr", "diag"):
        model = S4(S4Config(d_model=4, n_layers=1, d_state=8, mode=mode))
        leaves = {n.rsplit(".", 1)[-1] for n, _ in model.named_parameters()}
        assert not any(p.is_complex() for p in model.parameters()), "AdamW must not see complex parameters"
        assert SSM_PARAMS - {"P"} <= leaves and ("P" in leaves) == (mode == "nplr"), leaves


def test_ssm_convolution_runs_in_float32_under_autocast(monkeypatch):
    seen, rfft = [], torch.fft.rfft
    monkeypatch.setattr(torch.fft, "rfft", lambda x, *a, **k: seen.append(x.dtype) or rfft(x, *a, **k))
    layer = SSMLayer(S4Config(d_model=4, d_state=8), S4Kernel(S4Config(d_model=4, d_state=8)))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(torch.randn(2, 10, 4).bfloat16())
    assert seen and all(d == torch.float32 for d in seen), f"FFT ran in {seen}"
    assert torch.isfinite(y.float()).all()


@pytest.mark.parametrize("mode", ["nplr", "diag"])
def test_s4_maps_tokens_and_floats_to_features(mode):
    tokens = S4(S4Config(d_model=8, n_layers=2, d_state=8, mode=mode, vocab_size=20))
    floats = S4(S4Config(d_model=8, n_layers=2, d_state=8, mode=mode, d_input=2, bidirectional=False))
    assert tokens(torch.randint(0, 20, (3, 11))).shape == (3, 11, 8)
    assert floats(torch.randn(3, 11, 2)).shape == (3, 11, 8)


# ----------------------------------------------------------------------------- the fast kernel pieces

@pytest.mark.parametrize("R,L", [(1, 1000), (3, 1000), (4, 5)])
def test_vandermonde_split_powers_equal_direct_powers_and_their_gradients(R, L):
    torch.manual_seed(0)                                               # L = 1000: not a multiple of the split c
    coef = torch.randn(2, R, 6, dtype=torch.complex128, requires_grad=True)
    log_w = torch.complex(-torch.rand(2, 6, dtype=torch.float64) / 50, 3 * torch.randn(2, 6, dtype=torch.float64))
    log_w.requires_grad_()
    l = torch.arange(L, dtype=torch.float64)
    direct = (coef @ torch.exp(log_w[:, :, None] * l)).real          # (2, R, L), the full (M, L) table
    split = vandermonde(coef, log_w, L)
    torch.testing.assert_close(split, direct, rtol=0, atol=1e-10, msg="split powers != Re Σ coef w^l")
    weight = torch.randn(2, R, L, dtype=torch.float64)
    g_direct = torch.autograd.grad((direct * weight).sum(), (coef, log_w))
    g_split = torch.autograd.grad((split * weight).sum(), (coef, log_w))
    for a, b in zip(g_split, g_direct):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg="split-powers gradient != direct gradient")


@pytest.mark.parametrize("m,n", [(16, 16), (15, 15), (10, 21), (10, 20)])
def test_rfft_backward_equals_torch_rfft_backward_and_is_dense(m, n):
    torch.manual_seed(0)                                               # even/odd n, with and without zero-padding
    x = torch.randn(3, 2, m, dtype=torch.float64, requires_grad=True)
    g = torch.randn(3, 2, n // 2 + 1, dtype=torch.complex128)
    torch.testing.assert_close(RFFT.apply(x, n), torch.fft.rfft(x, n=n), msg="RFFT forward != torch.fft.rfft")
    ours, = torch.autograd.grad(RFFT.apply(x, n), x, g)
    ref, = torch.autograd.grad(torch.fft.rfft(x, n=n), x, g)
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12, msg="RFFT backward != adjoint of rfft")
    assert ours.stride(-1) == 1, "gradient should be dense along the last dim (BLAS needs unit stride)"


@pytest.mark.parametrize("L", [1, 16, 37, 100])
def test_bilinear_power_equals_dense_matrix_power(L):
    torch.manual_seed(0)
    N = 8
    Lambda = torch.complex(-torch.rand(2, N // 2, dtype=torch.float64) - 0.1, 3 * torch.randn(2, N // 2, dtype=torch.float64))
    P, C = torch.randn(2, 2, N // 2, dtype=torch.complex128).unbind(0)
    dt = torch.tensor([0.01, 0.3], dtype=torch.float64)
    for h in range(2):
        A = torch.diag(full(Lambda[h])) - torch.outer(full(P[h]), full(P[h]).conj())  # (N, N) complex, full basis
        I = torch.eye(N, dtype=A.dtype)
        dA = torch.linalg.solve(I - dt[h] / 2 * A, I + dt[h] / 2 * A)
        ref = (full(C[h]) @ torch.linalg.matrix_power(dA, L))[: N // 2]
        torch.testing.assert_close(bilinear_power(Lambda, P, C, dt, L)[h], ref, rtol=0, atol=1e-10,
                                   msg=f"channel {h}: Sherman–Morrison + real squaring != C Ā^L")


def test_nplr_kernel_gradients_equal_those_of_dense_bilinear_powers():
    torch.manual_seed(0)
    N, L = 4, 21
    with default_dtype(torch.float64):
        kernel = S4Kernel(S4Config(d_model=2, d_state=N, bidirectional=False))
    with torch.no_grad():
        for p in (kernel.Lambda_re, kernel.Lambda_im, kernel.P, kernel.B):
            p.add_(0.3 * torch.randn_like(p))
    weight = torch.randn(2, L, dtype=torch.float64)
    params = list(kernel.parameters())
    ours = torch.autograd.grad((kernel(L) * weight).sum(), params)
    Lambda, P, B, C, dt = kernel._params()
    ref = []
    for h in range(2):
        A = torch.diag(full(Lambda[h])) - torch.outer(full(P[h]), full(P[h]).conj())
        ref.append(bilinear_powers(A, full(B[h]), full(C[h]), dt[h], L).real)
    ref = torch.autograd.grad((torch.stack(ref) * weight).sum(), params)
    for (name, _), a, b in zip(kernel.named_parameters(), ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-9, msg=f"gradient of {name} != dense-powers gradient")


def test_nplr_kernel_in_float32_stays_close_to_float64_at_length_4096():
    torch.manual_seed(0)                                               # HiPPO N = 64: large Im Λ, the hard case
    kernel = S4Kernel(S4Config(d_model=2, d_state=64))
    with torch.no_grad():
        K32 = kernel(4096)
        ref = kernel.double()(4096)
    err = ((K32.double() - ref).abs().max() / ref.abs().max()).item()
    assert err < 1e-4, f"float32 kernel off by {err:.1e} (relative): powers w^l made in float32 lose ~l·ε of phase"


@pytest.mark.parametrize("mode", ["nplr", "diag"])
def test_kernel_autograd_keeps_no_table_of_modes_by_length(mode):
    L, N = 4096, 64
    kernel = S4Kernel(S4Config(d_model=2, d_state=N, mode=mode))       # Hk = 4 SSMs
    sizes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t, lambda t: t):
        K = kernel(L)
    K.square().sum().backward()
    assert max(sizes) < 4 * (N // 2) * L / 8, f"autograd keeps a {max(sizes)}-element tensor: an (Hk, N/2, L) table?"
