"""Tests for s4.py, each named after the numerical fact it checks (float64 for equivalences, tiny sizes, CPU).
The block's facts, shared by every kernel (FFT conv, recurrence == convolution, causality, padding): test_ssm.py."""

import pytest
import torch

import s4
import ssm
from s4 import S4Config, S4Kernel, bilinear_power, full, hippo_legs, nplr_legs, s4d_init
from conftest import default_dtype




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
    torch.testing.assert_close(inv.imag, N / torch.pi * (N / (2 * n + 1) - 1),
                               msg="S4D-Inv: Im Λ_n = N/π(N/(2n+1) − 1)")


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


def test_re_lambda_stays_negative_after_a_huge_optimizer_step():
    for mode in ("nplr", "diag"):
        kernel = S4Kernel(S4Config(d_model=2, d_state=8, mode=mode))
        opt = torch.optim.AdamW(kernel.parameters(), lr=1e4)
        kernel(16).sum().backward()
        opt.step()
        Lambda = kernel._params()[0]
        assert (Lambda.real < 0).all(), f"{mode}: Re Λ >= 0 after an update"


# ----------------------------------------------------------------------------- the fast kernel pieces

@pytest.mark.parametrize("L", [1, 16, 37, 100])
def test_bilinear_power_equals_dense_matrix_power(L):
    torch.manual_seed(0)
    N = 8
    Lambda = torch.complex(-torch.rand(2, N // 2, dtype=torch.float64) - 0.1,
                           3 * torch.randn(2, N // 2, dtype=torch.float64))
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


# ----------------------------------------------------------------------------- config and public names

@pytest.mark.parametrize("fields,message", [
    (dict(d_state=7), r"d_state=7 must be even for S4 \(N/2 conjugate pairs are stored\)"),
    (dict(d_state=0), "d_state=0 must be >= 1"),
    (dict(mode="dplr"), "mode='dplr' must be 'nplr' or 'diag'"),
    (dict(diag_init="legs"), "diag_init='legs' must be 'lin' or 'inv'"),
])
def test_s4_config_refuses_bad_fields_with_a_one_line_value_error(fields, message):
    with pytest.raises(ValueError, match=f"^{message}$"):
        S4Config(**fields)


def test_nplr_legs_refuses_an_odd_state_size():
    with pytest.raises(ValueError, match="N=5 must be even"):
        nplr_legs(5)


def test_s4_still_exports_the_block_names_that_moved_to_ssm():
    assert s4.SSMLayer is ssm.SSMLayer and s4.fft_conv is ssm.fft_conv, "old import paths `from s4 import ...` broke"
    assert {"log_dt", "Lambda_re", "Lambda_im", "P", "B"} == s4.SSM_PARAMS and callable(s4.S4)
