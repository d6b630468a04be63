"""transformer.py: pre-norm Transformer backbone for LRA (Amos, Berant, Gupta, ICLR 2024; Table 2 flavour).
attention: y_m = Σ_n softmax_n(q_m·k_n / √hs) v_n over real keys n;  rotary: q_m ← R(mθ)q_m, k_n ← R(nθ)k_n,
           so q_m·k_n depends on m − n only (RoFormer, Su et al. 2021).  For L ≥ local_min_len (PathX):
           block-local, query block i sees key blocks i−1, i, i+1  -> both facts checked in tests/test_transformer.py
"""
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

SSM_PARAMS = set()  # no SSM parameters here; train.py treats all three models alike (CONTRACT.md)


@dataclass
class TransformerConfig:
    d_model: int = 64                  # D
    n_layers: int = 2
    n_heads: int = 4                   # nh; head size hs = D / nh (must be even for the rotary pairs)
    d_ff: int = 256                    # hidden width of the GELU MLP (4D, as in the paper's ListOps 512 -> 2048)
    dropout: float = 0.1               # on embeddings, attention weights and both residual branches
    causal: bool = False               # True: position t sees only t' ≤ t (for the next-token SPT objective)
    rotary: bool = True                # rotary on q, k with θ = 10000; False: sinusoidal absolute embeddings
    block_size: int = 4096             # W, tokens per block of block-local attention
    local_min_len: int = 16384         # block-local attention when the batch length L ≥ this (PathX, -256)
    vocab_size: Optional[int] = None   # V: tokens (B, L) -> Embedding(V, D, padding_idx=0); None: float inputs
    d_input: int = 1                   # floats (B, L, d_input) -> Linear(d_input, D)


def rotary_angles(L, hs, device=None, base=10000.0):
    """Angles m·θ_i, m = 0..L−1, θ_i = base^(−2i/hs), i < hs/2 (RoFormer §3.2.2; Vaswani et al. 2017 §3.5).

    Returns (L, hs/2) float64: in float32, m·θ_0 at m = 65536 (PathX-256) is already ~4e-3 rad off.
    """
    theta = base ** (-torch.arange(0, hs, 2, dtype=torch.float64, device=device) / hs)  # (hs/2,)
    return torch.arange(L, dtype=torch.float64, device=device)[:, None] * theta         # (L, hs/2)


def rotate(x, angles):
    """Rotary position embedding: rotate each pair (x_2i, x_2i+1) at position m by angle m·θ_i (RoFormer eq. 34).

    x: (..., L, hs) float, angles: (L, hs/2) float64 from rotary_angles. Returns (..., L, hs) in x's dtype.
    Rotations compose, R(mθ)ᵀR(nθ) = R((n−m)θ), so rotated q·k depends on the offset n − m only.
    """
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)                  # (L, hs/2) each
    x1, x2 = x[..., 0::2], x[..., 1::2]                                           # (..., L, hs/2) each
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1).flatten(-2)  # (..., L, hs)


def sinusoidal_embedding(L, D, device=None):
    """Absolute position code PE[m, 2i] = sin(m·θ_i), PE[m, 2i+1] = cos(m·θ_i), θ_i = 10000^(−2i/D)
    (Vaswani et al. 2017, §3.5): the frequencies of rotary, added to the input instead. Returns (L, D) float64."""
    angles = rotary_angles(L, D, device)                                          # (L, D/2)
    return torch.stack((angles.sin(), angles.cos()), -1).flatten(-2)              # (L, D)


def key_mask(pos, lengths, L):
    """Which keys a query may see: the real ones, 0 ≤ pos < lengths[b] (pads sit at positions ≥ lengths[b]).

    pos: (..., K) long key positions (may lie outside [0, L) at the sequence edges); lengths: (B,) long.
    Returns (B, ..., K) bool. A row with no real key (an all-padding sequence, or a block window holding only pads)
    serves pad queries only: it may see every key inside the sequence instead, so no softmax row is empty
    (CPU SDPA returns 0 for an empty row, GPU kernels may return NaN, in outputs and gradients). Real outputs never
    read pad queries, so they are unchanged.
    """
    inside = (pos >= 0) & (pos < L)                                               # (..., K)
    real = inside & (pos < lengths.to(pos.device).view(-1, *[1] * pos.dim()))     # (B, ..., K)
    return real | (inside & ~real.any(-1, keepdim=True))                          # (B, ..., K)


def attention(q, k, v, lengths=None, causal=False, dropout_p=0.0):
    """Full multi-head softmax attention through F.scaled_dot_product_attention (Vaswani et al. 2017, §3.2).

    q, k, v: (B, nh, L, hs) float; lengths: (B,) long or None (no padding). Returns (B, nh, L, hs).
    Without a mask (no padding, or causal) a GPU runs the flash kernel. Causal needs no padding mask: pads come
    after every real position, so the causal mask alone keeps real queries off pad keys.
    """
    if causal or lengths is None:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=causal)  # (B, nh, L, hs)
    L = q.size(2)
    mask = key_mask(torch.arange(L, device=q.device), lengths, L)                 # (B, L)
    mask = mask[:, None, None, :]                                                 # (B, 1, 1, L): same for every query
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)  # (B, nh, L, hs)


def block_local_attention(q, k, v, block_size, lengths=None, causal=False, dropout_p=0.0):
    """Block-local attention for long inputs (the paper's PathX setting): cut the sequence into non-overlapping blocks
    of W = block_size; the queries of block i attend to the keys of blocks i−1, i, i+1 (causal: i−1 and i, causally).

    q, k, v: (B, nh, L, hs) float; lengths: (B,) long or None. Returns (B, nh, L, hs). Equals full attention under
    the block-band mask |i − j| ≤ 1 (tests/test_transformer.py). No (L, L) mask or score matrix: each block's
    window of keys is cut out of the keys, zero-padded by W on the left and up to whole blocks on the right
    (the padding is masked), and SDPA runs on the batch of B·nb blocks (causal: block 0 apart), O(L·W) memory.
    """
    B, nh, L, hs = q.shape
    W = block_size
    nb = -(-L // W)                                                               # number of blocks, ⌈L/W⌉
    n_win = 2 if causal else 3                                                    # blocks per key window
    lengths = torch.full((B,), L, device=q.device) if lengths is None else lengths

    def blocks(t, left, n):  # (B, nh, L, hs) -> (B·nb, nh, n·W, hs): window i = padded blocks i..i+n−1
        t = F.pad(t, (0, 0, left, (nb + n - 1) * W - left - L))                  # (B, nh, (nb+n−1)·W, hs)
        t = t.unfold(2, n * W, W).transpose(-1, -2)                               # (B, nh, nb, n·W, hs)
        return t.transpose(1, 2).reshape(B * nb, nh, n * W, hs)                   # (B·nb, nh, n·W, hs)

    qb = blocks(q, 0, 1)                                                          # (B·nb, nh, W, hs)
    kw, vw = blocks(k, W, n_win), blocks(v, W, n_win)                             # (B·nb, nh, n_win·W, hs) each
    if not causal:
        start = (torch.arange(nb, device=q.device)[:, None] - 1) * W              # (nb, 1): window i starts at (i−1)W
        pos = start + torch.arange(3 * W, device=q.device)                        # (nb, 3W) key positions
        mask = key_mask(pos, lengths, L).view(B * nb, 1, 1, 3 * W)                # (B·nb, 1, 1, 3W)
        y = F.scaled_dot_product_attention(qb, kw, vw, attn_mask=mask, dropout_p=dropout_p)  # (B·nb, nh, W, hs)
    else:
        # query r of block i (position iW + r) sees window key j (position (i−1)W + j) iff j ≤ r + W. As in
        # attention(), the causal mask alone keeps real queries off pads. Block 0 has no previous block (its first
        # W window keys are zero padding), so it runs on its own block with a plain causal mask.
        band = torch.ones(W, 2 * W, dtype=torch.bool, device=q.device).tril(W)   # (W, 2W)
        qb, kw, vw = (t.view(B, nb, nh, -1, hs) for t in (qb, kw, vw))           # (B, nb, nh, W or 2W, hs)
        first = F.scaled_dot_product_attention(qb[:, 0], kw[:, 0, :, W:], vw[:, 0, :, W:],
                                               dropout_p=dropout_p, is_causal=True)  # (B, nh, W, hs)
        rest = F.scaled_dot_product_attention(qb[:, 1:].flatten(0, 1), kw[:, 1:].flatten(0, 1),
                                              vw[:, 1:].flatten(0, 1), attn_mask=band,
                                              dropout_p=dropout_p)               # (B·(nb−1), nh, W, hs)
        y = torch.cat((first[:, None], rest.view(B, nb - 1, nh, W, hs)), 1)      # (B, nb, nh, W, hs)
    y = y.view(B, nb, nh, W, hs).transpose(1, 2).reshape(B, nh, nb * W, hs)       # (B, nh, nb·W, hs)
    return y[:, :, :L]                                                            # (B, nh, L, hs)


class TransformerLayer(nn.Module):
    """Pre-norm block (Xiong et al. 2020): x + Drop(Attn(LN(x))), then x + Drop(MLP(LN(x))), MLP = Linear-GELU-Linear.

    forward(x (B, L, D) float, lengths (B,) long or None, angles (L, hs/2) float64 or None) -> (B, L, D).
    Attention is full for L < cfg.local_min_len, block-local otherwise.
    """

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        assert cfg.d_model % (2 * cfg.n_heads) == 0, "need an even head size hs = d_model / n_heads (rotary pairs)"
        self.cfg = cfg
        self.norm1, self.norm2 = nn.LayerNorm(cfg.d_model), nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.out = nn.Linear(cfg.d_model, cfg.d_model)
        self.mlp = nn.Sequential(nn.Linear(cfg.d_model, cfg.d_ff), nn.GELU(), nn.Linear(cfg.d_ff, cfg.d_model))
        self.drop = nn.Dropout(cfg.dropout)

    def attend(self, x, lengths, angles):
        cfg, (B, L, D) = self.cfg, x.shape
        q, k, v = self.qkv(x).view(B, L, 3, cfg.n_heads, D // cfg.n_heads).permute(2, 0, 3, 1, 4)  # 3 × (B, nh, L, hs)
        if angles is not None:
            q, k = rotate(q, angles), rotate(k, angles)                           # (B, nh, L, hs) each; v unrotated
        p = cfg.dropout if self.training else 0.0
        if L >= cfg.local_min_len:
            y = block_local_attention(q, k, v, cfg.block_size, lengths, cfg.causal, p)  # (B, nh, L, hs)
        else:
            y = attention(q, k, v, lengths, cfg.causal, p)                        # (B, nh, L, hs)
        return self.out(y.transpose(1, 2).reshape(B, L, D))                       # (B, L, D)

    def forward(self, x, lengths=None, angles=None):
        x = x + self.drop(self.attend(self.norm1(x), lengths, angles))
        return x + self.drop(self.mlp(self.norm2(x)))


class Transformer(nn.Module):
    """Backbone: encoder -> (+ sinusoidal PE) -> dropout -> n_layers × TransformerLayer -> final LayerNorm.

    forward(x, lengths=None) -> (B, L, D) float features (no head; train.py owns the heads).
    x: (B, L) long tokens when cfg.vocab_size is set, else (B, L, d_input) float. lengths: (B,) long or None;
    positions ≥ lengths[b] are padding and do not change the features at real positions. Whether attention is
    block-local depends on the padded batch length L, so that guarantee needs a lone sequence and its padded batch
    on the same side of local_min_len; in LRA every task that long (PathX, PathX-256) has fixed length.
    """

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.cfg = cfg
        if cfg.vocab_size is not None:
            self.encoder = nn.Embedding(cfg.vocab_size, cfg.d_model, padding_idx=0)
        else:
            self.encoder = nn.Linear(cfg.d_input, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(TransformerLayer(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.d_model)

    def forward(self, x, lengths=None):
        cfg = self.cfg
        h = self.encoder(x)                                                       # (B, L, D)
        L = h.size(1)
        if lengths is not None and bool((lengths >= L).all()):
            lengths = None                                                        # nothing padded: no mask, flash kernel
        angles = rotary_angles(L, cfg.d_model // cfg.n_heads, h.device) if cfg.rotary else None  # (L, hs/2)
        if not cfg.rotary:
            h = h + sinusoidal_embedding(L, cfg.d_model, h.device).to(h.dtype)  # (B, L, D)
        h = self.drop(h)
        for layer in self.layers:
            h = layer(h, lengths, angles)                                         # (B, L, D)
        return self.norm(h)                                                       # (B, L, D)
