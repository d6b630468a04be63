"""results/stats.py: the statistics behind the study's claims, in the standard library only.
paired difference:  d_s = acc(arm A, seed s) − acc(arm B, seed s); both arms of a seed share its initialisation and
                    batch order, so the seed is the unit: mean d̄ and a 95 % interval d̄ ± t_{0.975, n−1} · s_d / √n
McNemar (exact):    per seed, on the two runs' predictions of the same test examples: b = A right and B wrong,
                    c = B right and A wrong; p = min(1, 2 · P(X ≤ min(b, c))), X ~ Binomial(b + c, 1/2)
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
