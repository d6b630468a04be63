"""results/stats.py: the statistics behind the study's claims, in the standard library only.
paired difference:  d_s = acc(arm A, seed s) − acc(arm B, seed s); both arms of a seed share its initialisation and
                    batch order, so the seed is the unit: mean d̄ and a 95 % interval d̄ ± t_{0.975, n−1} · s_d / √n
McNemar (exact):    per seed, on the two runs' predictions of the same test examples: b = A right and B wrong,
                    c = B right and A wrong; p = min(1, 2 · P(X ≤ min(b, c))), X ~ Binomial(b + c, 1/2)
paired t test:      t = d̄ / (s_d / √n), p = 2 · P(T_{n−1} > |t|) (Student's t CDF by the regularised incomplete beta
                    function, I_x(a, b) with x = df / (df + t²), a = df/2, b = 1/2: Abramowitz & Stegun 26.7.1)
Holm (1979):        the m p-values in increasing order, p_(k) adjusted to max_{j ≤ k} min(1, (m − j + 1) p_(j))
power:              of a two-sided paired t test at level α for a true mean difference δ: P(|T'| > t_{1−α/2}) with
                    T' noncentral t, df = n − 1, noncentrality λ = δ√n / σ_d; the detectable difference at 80 %
                    power is the δ that solves power = 0.8 (given σ_d, e.g. the observed s_d)
Check: tests/test_results.py (against values computed by hand and from published tables).
"""
import math
import statistics

# t_{0.975, df}: the two-sided 95 % quantiles of Student's t (any statistics table), df 1..30; above 30 the
# 1/df expansion of the normal quantile below is within 1e-3 of the table
T975 = [12.7062, 4.3027, 3.1824, 2.7764, 2.5706, 2.4469, 2.3646, 2.3060, 2.2622, 2.2281, 2.2010, 2.1788, 2.1604,
        2.1448, 2.1314, 2.1199, 2.1098, 2.1009, 2.0930, 2.0860, 2.0796, 2.0739, 2.0687, 2.0639, 2.0595, 2.0555,
        2.0518, 2.0484, 2.0452, 2.0423]   # to 4 decimals: 3 (2.571 for 5 dof) can move a bound's last printed digit
Z975 = 1.959964


def t975(df):
    """The 0.975 quantile of Student's t with df degrees of freedom (df ≥ 1)."""
    if df < 1:
        raise ValueError(f"a t interval needs at least 2 values (df = {df})")
    if df <= len(T975):
        return T975[df - 1]
    z = Z975                                                     # Cornish–Fisher expansion, two terms
    return z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df ** 2)


def interval(values):
    """(mean, low, high) of the 95 % t interval of the mean of `values` (n ≥ 2)."""
    n, mean = len(values), statistics.fmean(values)
    half = t975(n - 1) * statistics.stdev(values) / math.sqrt(n)
    return mean, mean - half, mean + half


def binomial_tail(k, n):
    """P(X ≤ k) for X ~ Binomial(n, 1/2), exactly (integers, then one division)."""
    return sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n


def mcnemar(a, b, truth):
    """Exact two-sided McNemar test of two classifiers' predictions a, b (equal-length sequences) of the same examples
    with labels `truth` -> (only a right, only b right, p)."""
    only_a = sum(x == t != y for x, y, t in zip(a, b, truth))
    only_b = sum(y == t != x for x, y, t in zip(a, b, truth))
    n = only_a + only_b
    return only_a, only_b, 1.0 if n == 0 else min(1.0, 2 * binomial_tail(min(only_a, only_b), n))


def paired(per_seed):
    """{seed: (acc A, acc B)} -> dict(diffs by seed, mean, low, high, n) of the paired differences A − B (points)."""
    seeds = sorted(per_seed)
    diffs = [100 * (per_seed[s][0] - per_seed[s][1]) for s in seeds]
    mean, low, high = interval(diffs) if len(diffs) > 1 else (diffs[0], math.nan, math.nan)
    return dict(seeds=seeds, diffs=diffs, mean=mean, low=low, high=high, n=len(diffs))


def incomplete_beta(x, a, b):
    """The regularised incomplete beta function I_x(a, b), 0 ≤ x ≤ 1, by its continued fraction (modified Lentz;
    Numerical Recipes §6.4), to about 1e-14."""
    if x <= 0 or x >= 1:
        return 0.0 if x <= 0 else 1.0
    if x > (a + 1) / (a + b + 2):                                 # the fraction converges fast on this side only
        return 1.0 - incomplete_beta(1 - x, b, a)
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)) / a
    tiny, c, d = 1e-300, 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1 / (d if abs(d) > tiny else tiny)
    f = d
    for m in range(1, 500):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1 + numerator * d
            d = 1 / (d if abs(d) > tiny else tiny)
            c = 1 + numerator / c
            c = c if abs(c) > tiny else tiny
            f *= c * d
        if abs(c * d - 1) < 1e-15:
            break
    return front * f


def t_pvalue(t, df):
    """Two-sided p-value of Student's t statistic t with df degrees of freedom: 2 · P(T > |t|) = I_{df/(df+t²)}(df/2,
    1/2)."""
    return incomplete_beta(df / (df + t * t), df / 2, 0.5)


def paired_test(diffs):
    """The paired t test of differences (n ≥ 2, not all equal) -> (t, p two-sided)."""
    n, mean, sd = len(diffs), statistics.fmean(diffs), statistics.stdev(diffs)
    t = mean / (sd / math.sqrt(n))
    return t, t_pvalue(t, n - 1)


def holm(pvalues):
    """Holm's step-down adjusted p-values (Holm 1979), in the order given: reject where adjusted p < α."""
    m, order = len(pvalues), sorted(range(len(pvalues)), key=lambda i: pvalues[i])
    adjusted, running = [0.0] * m, 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * pvalues[i]))
        adjusted[i] = running
    return adjusted


def t_quantile(q, df):
    """The q quantile of Student's t (0.5 < q < 1), by bisection on the CDF."""
    low, high = 0.0, 1e3
    for _ in range(200):
        mid = (low + high) / 2
        low, high = (mid, high) if 1 - t_pvalue(mid, df) / 2 < q else (low, mid)
    return (low + high) / 2


def noncentral_t_sf(c, df, ncp, steps=4000):
    """P(T' > c) for T' = (Z + ncp) / √(V/df), Z ~ N(0, 1), V ~ χ²_df: the normal tail integrated over the χ² density
    of V (Simpson's rule on [0, df + 40√(2df) + 40])."""
    top = df + 40 * math.sqrt(2 * df) + 40
    h, total = top / steps, 0.0
    log_norm = -(df / 2) * math.log(2) - math.lgamma(df / 2)
    for k in range(steps + 1):
        v = k * h
        if v == 0:
            continue                                             # the density is 0 there for df > 2, finite else
        density = math.exp(log_norm + (df / 2 - 1) * math.log(v) - v / 2)
        tail = 0.5 * math.erfc((c * math.sqrt(v / df) - ncp) / math.sqrt(2))
        total += (1 if k == steps else 4 if k % 2 else 2) * density * tail
    return total * h / 3


def power_paired_t(delta, sd, n, alpha=0.05):
    """Power of the two-sided paired t test at level alpha, n pairs, true mean difference delta, sd of differences."""
    df, ncp = n - 1, delta * math.sqrt(n) / sd
    c = t_quantile(1 - alpha / 2, df)
    return noncentral_t_sf(c, df, ncp) + noncentral_t_sf(c, df, -ncp)    # both tails


def detectable_difference(sd, n, power=0.8, alpha=0.05):
    """The smallest true mean difference that a two-sided paired t test of n pairs (sd of the differences) detects
    with the given power, by bisection on power_paired_t (0 when sd = 0: every difference is certain)."""
    if sd == 0:
        return 0.0
    low, high = 0.0, 20 * sd
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if power_paired_t(mid, sd, n, alpha) < power else (low, mid)
    return (low + high) / 2


# ---- the texts summary.md prints (results/summarize.py)

def interval_text(d):
    """'+6.3 [+5.5, +7.0]' of a paired result (points)."""
    return f"{d['mean']:+.1f} [{d['low']:+.1f}, {d['high']:+.1f}]"


def accuracy_text(rs):
    """'64.2 [63.1, 65.3] (n=6)': test accuracy %, mean and 95 % t interval over seeds."""
    accs = [100 * r["test"] for r in rs]
    if len(accs) < 2:
        return f"{accs[0]:.1f} (n=1)"
    mean, low, high = interval(accs)
    return f"{mean:.1f} [{low:.1f}, {high:.1f}] (n={len(accs)})"


def mcnemar_text(a, b):
    """Per seed, the exact McNemar p of two runs' test predictions, 'p1 / p2 / ...' and how many are < 0.05."""
    ps = []
    for seed in sorted(set(a) & set(b)):
        pa, pb = a[seed]["predictions"], b[seed]["predictions"]
        if not pa or not pb or pa["labels"] != pb["labels"] or pa["index_sha1"] != pb["index_sha1"]:
            ps.append(None)
            continue
        ps.append(mcnemar(pa["predictions"], pb["predictions"], pa["labels"])[2])
    shown = " / ".join("–" if p is None else f"{p:.2g}" for p in ps)
    return f"{shown} ({sum(p is not None and p < 0.05 for p in ps)} of {len(ps)} < 0.05)"
