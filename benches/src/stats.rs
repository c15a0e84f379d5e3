//! Medians, spreads and intervals of rounds, and how they print.

/// Keeps the shorter of `best` and `seconds`; a skipped run (NaN) keeps the other.
pub(crate) fn keep_best(best: &mut f64, seconds: f64) {
    if best.is_nan() || seconds < *best {
        *best = seconds;
    }
}

/// The median of `values` (the mean of the middle two for an even count); NaN for none.
pub(crate) fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    match values.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => values[n / 2],
        n => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    }
}

/// The lowest and highest of the rounds' `values` (a skipped round, NaN, counts for neither).
pub(crate) fn spread(values: &[f64]) -> (f64, f64) {
    let lowest = values.iter().copied().fold(f64::NAN, f64::min);
    let highest = values.iter().copied().fold(f64::NAN, f64::max);
    (lowest, highest)
}

/// A 95% confidence interval of the median of `values`, free of any assumption about their
/// distribution: the order statistics `k` and `n + 1 - k` where fewer than 2.5% of
/// `Binomial(n, 1/2)` draws fall below `k`. `None` under 6 values, too few for one.
pub(crate) fn median_interval(values: &[f64]) -> Option<(f64, f64)> {
    let mut sorted: Vec<f64> = values.iter().copied().filter(|v| !v.is_nan()).collect();
    sorted.sort_by(f64::total_cmp);
    let n = sorted.len();
    // P(X <= j) for X ~ Binomial(n, 1/2), summed term by term: C(n, j) / 2^n, kept as a
    // logarithm so that 2^-n does not underflow past about a thousand rounds.
    let mut ln_term = -(n as f64) * std::f64::consts::LN_2;
    let mut below = 0.0;
    let mut k = 0;
    for j in 0..n {
        below += ln_term.exp();
        if below > 0.025 {
            break;
        }
        k = j + 1;
        ln_term += ((n - j) as f64 / (j + 1) as f64).ln();
    }
    (k >= 1).then(|| (sorted[k - 1], sorted[n - k]))
}

/// " (best of N: A B C)", every round's rate in the order run, where there was more than one.
pub(crate) fn rounds_text(rates: &[f64]) -> String {
    if rates.len() > 1 {
        format!(" (best of {}: {})", rates.len(), joined(rates, 1))
    } else {
        String::new()
    }
}

/// `values` with `decimals` decimals each, separated by spaces.
pub(crate) fn joined(values: &[f64], decimals: usize) -> String {
    let values: Vec<String> = values.iter().map(|v| format!("{v:.decimals$}")).collect();
    values.join(" ")
}

/// What one connection count's rounds of tensorwire / raw quinn say.
pub(crate) struct RoundsSummary {
    pub(crate) median: f64,
    /// The lowest and highest round.
    pub(crate) range: (f64, f64),
    /// The median's 95% interval ([`median_interval`]).
    pub(crate) interval: Option<(f64, f64)>,
}

impl RoundsSummary {
    pub(crate) fn of(rounds: &[f64]) -> Self {
        Self {
            median: median(&mut rounds.to_vec()),
            range: spread(rounds),
            interval: median_interval(rounds),
        }
    }
}

/// ", rounds LOW to HIGH" where there was more than one round, else nothing.
pub(crate) fn spread_text(runs: usize, (lowest, highest): (f64, f64)) -> String {
    if runs > 1 {
        format!(", rounds {lowest:.3} to {highest:.3}")
    } else {
        String::new()
    }
}

#[cfg(test)]
mod tests {
    use super::median_interval;

    #[test]
    pub(crate) fn the_median_interval_takes_the_order_statistics_of_the_binomial() {
        // 12 rounds: P(X <= 2) = 0.019 and P(X <= 3) = 0.073, so the 3rd and 10th values.
        let rounds: Vec<f64> = (1..=12).rev().map(f64::from).collect();
        assert_eq!(median_interval(&rounds), Some((3.0, 10.0)));
        // 6 rounds: P(X = 0) = 0.016, the whole range.
        assert_eq!(
            median_interval(&[6.0, 1.0, 5.0, 2.0, 4.0, 3.0]),
            Some((1.0, 6.0))
        );
        // 100 rounds: the 40th and 61st (the textbook's k = 40).
        let rounds: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(median_interval(&rounds), Some((40.0, 61.0)));
        // 2,000 rounds, where 2^-n underflows: k = 956 (n/2 - 1.96 * sqrt(n)/2, rounded
        // down, as the normal approximation has it).
        let rounds: Vec<f64> = (1..=2000).map(f64::from).collect();
        assert_eq!(median_interval(&rounds), Some((956.0, 1045.0)));
    }

    #[test]
    pub(crate) fn too_few_rounds_have_no_median_interval() {
        assert_eq!(median_interval(&[1.0, 2.0, 3.0, 4.0, 5.0]), None);
        // A skipped round (NaN) is no round.
        let with_skipped = [1.0, 2.0, 3.0, 4.0, 5.0, f64::NAN];
        assert_eq!(median_interval(&with_skipped), None);
        assert_eq!(median_interval(&[]), None);
    }
}
