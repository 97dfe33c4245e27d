"""Chi-square goodness of fit for the sampling tests: small cells pooled, a 99.9% limit."""
import numpy as np


def chi2_limit(df: int) -> float:
    """The 99.9% quantile of chi-square with ``df`` degrees of freedom (Wilson-Hilferty)."""
    a = 2.0 / (9 * df)
    return df * (1 - a + 3.09 * a ** 0.5) ** 3


def chi2(counts: np.ndarray, probs: np.ndarray, n: int) -> tuple[float, int]:
    """(statistic, degrees of freedom) of ``counts`` [K] from ``n`` draws against ``probs`` [K];
    cells expecting 5 or fewer draws are pooled into one."""
    expected = probs * n
    big = expected > 5
    stat = ((counts[big] - expected[big]) ** 2 / expected[big]).sum()
    rest = expected[~big].sum()
    if rest > 0:
        stat += (counts[~big].sum() - rest) ** 2 / rest
    return float(stat), int(big.sum()) - 1 + (rest > 0)
