"""transformer.py: pre-norm Transformer backbone for LRA (Amos, Berant, Gupta, ICLR 2024;
Table 2 flavour).
attention:  y_m = Σ_n softmax_n(q_m·k_n / √hs) v_n over real keys n;
positions (cfg.pos, where the position m enters):
  rotary:     q_m ← R(mθ)q_m, k_n ← R(nθ)k_n, so q_m·k_n depends on m − n only (RoFormer, Su et
              al. 2021, eq. 34); the default, the paper's Table 2
  sinusoidal: h_m ← h_m + PE[m], PE[m, 2i] = sin(mθ_i), PE[m, 2i+1] = cos(mθ_i) (Vaswani et al.
              2017, §3.5); LRA's Transformer and the paper's Table 1
  learned:    h_m ← h_m + P[m], P an nn.Embedding(max_len, D) trained with the rest (BERT, Devlin
              et al. 2019, §3)
  none:       no position at all: the model is permutation-equivariant
For L ≥ local_min_len (PathX): block-local, query block i sees key blocks i−1, i, i+1
  -> these facts are checked in tests/test_transformer.py
"""
from dataclasses import InitVar, dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ssm import check_lengths, require   # the config and shape rules every model shares

# no SSM parameters here; the name exists so that train.py treats all three models alike
SSM_PARAMS = set()
# cfg.pos: how the position m enters (the module docstring gives each formula and its source)
POSITIONS = ("rotary", "sinusoidal", "learned", "none")


@dataclass
class TransformerConfig:
    d_model: int = 64                  # D
    n_layers: int = 2
    # nh; head size hs = D / nh (must be even for the rotary pairs)
    n_heads: int = 4
    # hidden width of the GELU MLP (4D, as in the paper's ListOps 512 -> 2048)
    d_ff: int = 256
    dropout: float = 0.1               # on embeddings, attention weights and both residual branches
    # True: position t sees only t' ≤ t (for the next-token SPT objective)
    causal: bool = False
    # rotary (q, k rotated, θ = 10000), sinusoidal or learned (added to the input), none
    pos: str = "rotary"
    # L_max: rows of the learned position table (pos="learned"); the longest input, EOS included
    max_len: int = 4096
    block_size: int = 4096             # W, tokens per block of block-local attention
    # block-local attention when the batch length L ≥ this (PathX, -256)
    local_min_len: int = 16384
    # V: tokens (B, L) -> Embedding(V, D, padding_idx=0); None: float inputs
    vocab_size: Optional[int] = None
    d_input: int = 1                   # floats (B, L, d_input) -> Linear(d_input, D)
    # the old name of pos (before it had four values), not a field: rotary=False in a checkpoint
    # or config written then is pos="sinusoidal", rotary=True is pos="rotary"
    rotary: InitVar[Optional[bool]] = None

    def __post_init__(self, rotary=None):
        """ValueError, one line naming the field, for a config no Transformer can be built from."""
        if rotary is not None:                  # an old config: its rotary flag decides pos
            old = "rotary" if rotary else "sinusoidal"
            require(self.pos in ("rotary", old), f"rotary={rotary} contradicts pos={self.pos!r}")
            self.pos = old
        require(self.pos in POSITIONS, f"pos={self.pos!r} must be one of {', '.join(POSITIONS)}")
        require(self.max_len >= 1, f"max_len={self.max_len} must be >= 1")
        require(self.d_model >= 1, f"d_model={self.d_model} must be >= 1")
        require(self.n_layers >= 1, f"n_layers={self.n_layers} must be >= 1")
        require(self.n_heads >= 1, f"n_heads={self.n_heads} must be >= 1")
        require(self.d_model % self.n_heads == 0,
                f"d_model={self.d_model} must be divisible by n_heads={self.n_heads}")
        require(self.pos != "rotary" or self.d_model // self.n_heads % 2 == 0,
                f"head size d_model/n_heads={self.d_model // self.n_heads} "
                "must be even (rotary rotates pairs of channels)")
        require(self.pos != "sinusoidal" or self.d_model % 2 == 0,
                f"d_model={self.d_model} must be even (sinusoidal codes come in sin/cos pairs)")
        require(self.d_ff >= 1, f"d_ff={self.d_ff} must be >= 1")
        require(0 <= self.dropout < 1, f"dropout={self.dropout} must be in [0, 1)")
        require(self.block_size >= 1, f"block_size={self.block_size} must be >= 1")
        require(self.vocab_size is None or self.vocab_size >= 1,
                f"vocab_size={self.vocab_size} must be None or >= 1")
        require(self.d_input >= 1, f"d_input={self.d_input} must be >= 1")


def rotary_angles(L, hs, device=None, base=10000.0):
    """Angles m·θ_i, m = 0..L−1, θ_i = base^(−2i/hs), i < hs/2 (RoFormer §3.2.2; Vaswani et al.
    2017 §3.5).

    Returns (L, hs/2) float64: in float32, m·θ_0 at m = 65536 (PathX-256) is already ~4e-3 rad off.
    """
    theta = base ** (-torch.arange(0, hs, 2, dtype=torch.float64, device=device) / hs)  # (hs/2,)
    return torch.arange(L, dtype=torch.float64, device=device)[:, None] * theta  # (L, hs/2)


def rotate(x, angles):
    """Rotary position embedding: rotate each pair (x_2i, x_2i+1) at position m by angle m·θ_i
    (RoFormer eq. 34).

    x: (..., L, hs) float, angles: (L, hs/2) float64 from rotary_angles. Returns (..., L, hs) in
    x's dtype. Rotations compose, R(mθ)ᵀR(nθ) = R((n−m)θ), so rotated q·k depends on the offset
    n − m only.
    """
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)              # (L, hs/2) each
    x1, x2 = x[..., 0::2], x[..., 1::2]                                 # (..., L, hs/2) each
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1).flatten(-2)  # (..., L, hs)


def sinusoidal_embedding(L, D, device=None):
    """Absolute position code PE[m, 2i] = sin(m·θ_i), PE[m, 2i+1] = cos(m·θ_i),
    θ_i = 10000^(−2i/D) (Vaswani et al. 2017, §3.5): the frequencies of rotary, added to the input
    instead. Returns (L, D) float64."""
    angles = rotary_angles(L, D, device)                                        # (L, D/2)
    return torch.stack((angles.sin(), angles.cos()), -1).flatten(-2)            # (L, D)


def key_mask(pos, lengths, L):
    """Which keys a query may see: the real ones, 0 ≤ pos < lengths[b] (pads sit at positions
    ≥ lengths[b]).

    pos: (..., K) long key positions (may lie outside [0, L) at the sequence edges); lengths: (B,)
    long. Returns (B, ..., K) bool. A row with no real key (an all-padding sequence, or a block
    window holding only pads) serves pad queries only: it may see every key inside the sequence
    instead, so no softmax row is empty (CPU SDPA returns 0 for an empty row, GPU kernels may
    return NaN, in outputs and gradients). Real outputs never read pad queries, so they are
    unchanged.
    """
    inside = (pos >= 0) & (pos < L)                                             # (..., K)
    real = inside & (pos < lengths.to(pos.device).view(-1, *[1] * pos.dim()))   # (B, ..., K)
    return real | (inside & ~real.any(-1, keepdim=True))                        # (B, ..., K)


def attention(q, k, v, lengths=None, causal=False, dropout_p=0.0):
    """Full multi-head softmax attention through F.scaled_dot_product_attention (Vaswani et al.
    2017, §3.2).

    q, k, v: (B, nh, L, hs) float; lengths: (B,) long or None (no padding). Returns (B, nh, L, hs).
    Without a mask (no padding, or causal) a GPU runs the flash kernel. Causal needs no padding
    mask: pads come after every real position, so the causal mask alone keeps real queries off pad
    keys.
    """
    if causal or lengths is None:
        # (B, nh, L, hs)
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=causal)
    L = q.size(2)
    mask = key_mask(torch.arange(L, device=q.device), lengths, L)               # (B, L)
    mask = mask[:, None, None, :]                         # (B, 1, 1, L): same for every query
    # (B, nh, L, hs)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)


def block_local_attention(q, k, v, block_size, lengths=None, causal=False, dropout_p=0.0):
    """Block-local attention for long inputs (the paper's PathX setting): cut the sequence into
    non-overlapping blocks of W = block_size; the queries of block i attend to the keys of blocks
    i−1, i, i+1 (causal: i−1 and i, causally).

    q, k, v: (B, nh, L, hs) float; lengths: (B,) long or None (no padding). Returns (B, nh, L, hs).
    Equals full attention under the block-band mask |i − j| ≤ 1 (tests/test_transformer.py), in
    O(L·W) memory. An unpadded batch and every causal one (as in attention(), the causal mask alone
    keeps real queries off pads) need no mask at all, so a GPU can run its fused kernels; a padded
    bidirectional batch masks its key windows.
    """
    if lengths is None or causal:
        return unmasked_local_attention(q, k, v, block_size, causal, dropout_p)  # (B, nh, L, hs)
    return padded_local_attention(q, k, v, block_size, lengths, dropout_p)       # (B, nh, L, hs)


def unmasked_local_attention(q, k, v, W, causal, dropout_p):
    """Block-local attention with no mask: block i's window, blocks i−1 .. i+1 (causal: i−1, i), is
    cut to the keys that exist, so nothing needs masking. The blocks whose window is whole run as
    one batched SDPA call; the first block and the last one or two, whose windows the sequence ends
    cut short, run one call each.
    Causal: the window (block i−1, block i) runs as one causal sequence of 2W (is_causal=True), of
    which block i's half is kept: query W + r sees keys 0 .. W + r, exactly its band. The first
    half's queries are computed and dropped, a quarter of the causal scores, the price of having
    no mask. q, k, v: (B, nh, L, hs) -> (B, nh, L, hs).
    """
    B, nh, L, hs = q.shape
    n_win = 2 if causal else 3                                        # blocks per key window
    # ⌈L/W⌉ blocks; blocks 1..n_inner: whole windows
    nb, n_inner = -(-L // W), max(0, L // W - n_win + 1)

    def window(t, i):  # block i's window, cut to [0, L): (B, nh, ≤ n_win·W, hs)
        return t[:, :, max(0, (i - 1) * W) : min((i + n_win - 1) * W, L)]

    def edge_block(i):  # block i in a call of its own: (B, nh, ≤ W, hs)
        n_q = min(W, L - i * W)                                         # block i's queries
        if causal:                                                      # block i ends its window
            y = F.scaled_dot_product_attention(window(q, i), window(k, i), window(v, i),
                                               dropout_p=dropout_p,
                                               is_causal=True)          # (B, nh, ≤ 2W, hs)
            return y[:, :, -n_q:]                                       # (B, nh, n_q, hs)
        qi = q[:, :, i * W : i * W + n_q]                               # (B, nh, n_q, hs)
        return F.scaled_dot_product_attention(qi, window(k, i), window(v, i),
                                              dropout_p=dropout_p)      # (B, nh, n_q, hs)

    ys = [edge_block(0)]
    # window i = keys [(i−1)W, (i−1+n_win)W), i = 1..n_inner: n_win·W-long slices, W apart
    if n_inner > 0:
        span = (n_inner + n_win - 1) * W                        # the keys of all inner windows
        kw, vw = (t[:, :, :span].unfold(2, n_win * W, W).transpose(-1, -2).flatten(1, 2)
                  for t in (k, v))                              # (B, nh·n_inner, n_win·W, hs)
        if causal:
            # (B, nh·n_inner, 2W, hs)
            qw = q[:, :, :span].unfold(2, 2 * W, W).transpose(-1, -2).flatten(1, 2)
        else:
            # (B, nh·n_inner, W, hs)
            qw = q[:, :, W : (n_inner + 1) * W].reshape(B, nh * n_inner, W, hs)
        # (.., 2W or W, hs)
        y = F.scaled_dot_product_attention(qw, kw, vw, dropout_p=dropout_p, is_causal=causal)
        ys.append(y[:, :, -W:].reshape(B, nh, n_inner * W, hs))         # (B, nh, n_inner·W, hs)
    ys += [edge_block(i) for i in range(n_inner + 1, nb)]               # (B, nh, ≤ W, hs) each
    return torch.cat(ys, 2)                                             # (B, nh, L, hs)


def padded_local_attention(q, k, v, W, lengths, dropout_p):
    """Block-local attention of a padded bidirectional batch: each block's window of 3W keys is cut
    out of the keys, zero-padded by W on the left and up to whole blocks on the right; key_mask
    hides that zero padding and the pads of each sequence, and SDPA runs on the batch of B·nb
    blocks. q, k, v: (B, nh, L, hs); lengths: (B,) long. Returns (B, nh, L, hs)."""
    B, nh, L, hs = q.shape
    nb = -(-L // W)                                                     # number of blocks, ⌈L/W⌉

    # (B, nh, L, hs) -> (B·nb, nh, n·W, hs): window i = padded blocks i..i+n−1
    def blocks(t, left, n):
        t = F.pad(t, (0, 0, left, (nb + n - 1) * W - left - L))         # (B, nh, (nb+n−1)·W, hs)
        t = t.unfold(2, n * W, W).transpose(-1, -2)                     # (B, nh, nb, n·W, hs)
        return t.transpose(1, 2).reshape(B * nb, nh, n * W, hs)         # (B·nb, nh, n·W, hs)

    qb = blocks(q, 0, 1)                                                # (B·nb, nh, W, hs)
    kw, vw = blocks(k, W, 3), blocks(v, W, 3)                           # (B·nb, nh, 3W, hs) each
    # (nb, 1): window i starts at (i−1)W
    start = (torch.arange(nb, device=q.device)[:, None] - 1) * W
    pos = start + torch.arange(3 * W, device=q.device)                  # (nb, 3W) key positions
    mask = key_mask(pos, lengths, L).view(B * nb, 1, 1, 3 * W)          # (B·nb, 1, 1, 3W)
    # (B·nb, nh, W, hs)
    y = F.scaled_dot_product_attention(qb, kw, vw, attn_mask=mask, dropout_p=dropout_p)
    y = y.view(B, nb, nh, W, hs).transpose(1, 2).reshape(B, nh, nb * W, hs)  # (B, nh, nb·W, hs)
    return y[:, :, :L]                                                  # (B, nh, L, hs)


class TransformerLayer(nn.Module):
    """Pre-norm block (Xiong et al. 2020): x + Drop(Attn(LN(x))), then x + Drop(MLP(LN(x))),
    MLP = Linear-GELU-Linear.

    forward(x (B, L, D) float, lengths (B,) long or None, angles (L, hs/2) float64 or None)
    -> (B, L, D). Attention is full for L < cfg.local_min_len, block-local otherwise.
    """

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.cfg = cfg
        self.norm1, self.norm2 = nn.LayerNorm(cfg.d_model), nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.out = nn.Linear(cfg.d_model, cfg.d_model)
        self.mlp = nn.Sequential(nn.Linear(cfg.d_model, cfg.d_ff), nn.GELU(),
                                 nn.Linear(cfg.d_ff, cfg.d_model))
        self.drop = nn.Dropout(cfg.dropout)

    def project(self, x, angles):
        """q, k, v of the normalised input x (B, L, D), q and k rotated when angles (L, hs/2) are
        given -> 3 × (B, nh, L, hs)."""
        cfg, (B, L, D) = self.cfg, x.shape
        # 3 × (B, nh, L, hs)
        q, k, v = self.qkv(x).view(B, L, 3, cfg.n_heads, D // cfg.n_heads).permute(2, 0, 3, 1, 4)
        if angles is not None:
            q, k = rotate(q, angles), rotate(k, angles)         # (B, nh, L, hs) each; v unrotated
        return q, k, v

    def attend(self, x, lengths, angles):
        cfg, (B, L, D) = self.cfg, x.shape
        q, k, v = self.project(x, angles)                       # 3 × (B, nh, L, hs)
        p = cfg.dropout if self.training else 0.0
        if L >= cfg.local_min_len:
            # (B, nh, L, hs)
            y = block_local_attention(q, k, v, cfg.block_size, lengths, cfg.causal, p)
        else:
            y = attention(q, k, v, lengths, cfg.causal, p)                      # (B, nh, L, hs)
        return self.out(y.transpose(1, 2).reshape(B, L, D))                     # (B, L, D)

    def attention_probs(self, x, lengths=None, angles=None):
        """The attention weights a_mn = softmax_n(q_m·k_n / √hs) of full attention (no dropout)
        under the masks attend() uses: the key-padding mask (key_mask) and, if cfg.causal, n ≤ m.
        x: (B, L, D) the layer's input before norm1; lengths (B,) long or None. Returns
        (B, nh, L, L) float, each row summing to 1. For analysis (tools/attention_offsets.py): it
        materialises the (L, L) scores that SDPA avoids; block-local layers are not covered."""
        q, k, _ = self.project(self.norm1(x), angles)            # (B, nh, L, hs) each
        L = q.size(2)
        scores = q @ k.transpose(-1, -2) / q.size(-1) ** 0.5      # (B, nh, L, L)
        allowed = torch.ones(L, L, dtype=torch.bool, device=q.device)   # (L, L)
        if self.cfg.causal:
            allowed = allowed.tril()
        if lengths is not None and not self.cfg.causal:  # causal: pads come last, as in attention()
            allowed = allowed & key_mask(torch.arange(L, device=q.device), lengths, L)[:, None, None]
        return scores.masked_fill(~allowed, float("-inf")).softmax(-1)     # (B, nh, L, L)

    def forward(self, x, lengths=None, angles=None):
        x = x + self.drop(self.attend(self.norm1(x), lengths, angles))
        return x + self.drop(self.mlp(self.norm2(x)))


class Transformer(nn.Module):
    """Backbone: encoder -> (+ absolute position code) -> dropout -> n_layers × TransformerLayer
    -> final LayerNorm.

    forward(inputs, lengths=None) -> (B, L, D) float features (no head; models.py holds the heads).
    inputs: (B, L) long tokens when cfg.vocab_size is set, else (B, L, d_input) float. lengths:
    (B,) long; None means no padding: steps.collate passes None for a batch without pads (it
    knows that on the host; finding it out here would make the host wait for the device), and then
    no attention call gets a mask. Raises ValueError when lengths is not of shape (B,), or when
    pos="learned" and L > cfg.max_len. Positions ≥ lengths[b] are padding and do not change the
    features at real positions. Whether attention is block-local depends on the padded batch
    length L, so that guarantee needs a lone sequence and its padded batch on the same side of
    local_min_len; in LRA every task that long (PathX, PathX-256) has fixed length.
    """

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.cfg = cfg
        if cfg.vocab_size is not None:
            self.encoder = nn.Embedding(cfg.vocab_size, cfg.d_model, padding_idx=0)
        else:
            self.encoder = nn.Linear(cfg.d_input, cfg.d_model)
        if cfg.pos == "learned":   # BERT's table, N(0, 1) like the token embedding above
            self.pos_embedding = nn.Embedding(cfg.max_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(TransformerLayer(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.d_model)

    def positions(self, L, device=None):
        """Where the positions 0..L−1 enter, by cfg.pos -> (angles, code): angles (L, hs/2) float64
        for rotary (else None), code (L, D) added to the encoded input for sinusoidal (float64)
        and learned (the table's rows), else None."""
        cfg = self.cfg
        if cfg.pos == "rotary":
            return rotary_angles(L, cfg.d_model // cfg.n_heads, device), None   # (L, hs/2)
        if cfg.pos == "sinusoidal":
            return None, sinusoidal_embedding(L, cfg.d_model, device)           # (L, D)
        if cfg.pos == "learned":
            require(L <= cfg.max_len, f"input length {L} > max_len={cfg.max_len}, the rows of the "
                    "learned position table: build the model with a larger max_len")
            return None, self.pos_embedding.weight[:L]                          # (L, D)
        return None, None

    def embed(self, inputs):
        """The encoded input plus its absolute position code, before dropout -> (h (B, L, D) float,
        angles (L, hs/2) float64 or None)."""
        h = self.encoder(inputs)                                                # (B, L, D)
        # bf16 (autocast Linear) -> float32: one residual dtype
        h = h.to(torch.promote_types(h.dtype, torch.float32))
        angles, code = self.positions(h.size(1), h.device)
        if code is not None:
            h = h + code.to(h.dtype)                                            # (B, L, D)
        return h, angles

    def forward(self, inputs, lengths=None):
        check_lengths(lengths, inputs.size(0))
        h, angles = self.embed(inputs)                                          # (B, L, D)
        h = self.drop(h)
        for layer in self.layers:
            h = layer(h, lengths, angles)                                       # (B, L, D)
        return self.norm(h)                                                     # (B, L, D)


if __name__ == "__main__":      # python transformer.py: rotary scores depend on the offset n − m only
    torch.manual_seed(0)
    L, hs = 12, 8
    q, k = torch.randn(hs, dtype=torch.float64), torch.randn(hs, dtype=torch.float64)   # one query, one key
    angles = rotary_angles(L, hs)                                                        # (L, hs/2)
    qs, ks = rotate(q.expand(L, hs), angles), rotate(k.expand(L, hs), angles)          # (L, hs) each
    scores = qs @ ks.T                                                                   # (L, L): q_m · k_n
    along = max((scores.diagonal(d) - scores.diagonal(d)[0]).abs().max().item() for d in range(-L + 1, L))
    print(f"rotary: the same q and k placed at every position; scores q_m·k_n ({L}×{L}) by offset n − m:")
    print("  " + "  ".join(f"{d:+d}: {scores.diagonal(d)[0].item():+.3f}" for d in range(-3, 4)))
    print(f"largest spread along any diagonal (same offset, other positions): {along:.1e}")
    code = sinusoidal_embedding(L, hs)                                                   # (L, hs)
    absolute = (q + code) @ (k + code).T                                                 # added to the input
    spread = max((absolute.diagonal(d) - absolute.diagonal(d)[0]).abs().max().item() for d in range(-L + 1, L))
    print(f"sinusoidal (added to the input instead): the spread along a diagonal is {spread:.2f}")
