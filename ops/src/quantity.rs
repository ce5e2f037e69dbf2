//! Kubernetes resource quantities ("3", "500m", "32Gi", "2e3"), as pods and nodes write them.

/// A parsed Kubernetes quantity ("3", "3k", "3Gi", "500m", "1.5", "2e3").
pub fn parse(s: &str) -> Result<f64, String> {
    let t = s.trim();
    let bad = || format!("{s:?} is not a Kubernetes quantity");
    if t.is_empty() {
        return Err(bad());
    }
    let num_end = t
        .char_indices()
        .find(|&(i, c)| !(c.is_ascii_digit() || c == '.' || ((c == '+' || c == '-') && i == 0)))
        .map_or(t.len(), |(i, _)| i);
    let (num, suffix) = t.split_at(num_end);
    if num.is_empty() || num == "+" || num == "-" || num.matches('.').count() > 1 {
        return Err(bad());
    }
    let value: f64 = num.parse().map_err(|_| bad())?;
    let mult = match suffix {
        "" => 1.0,
        "n" => 1e-9,
        "u" => 1e-6,
        "m" => 1e-3,
        "k" => 1e3,
        "M" => 1e6,
        "G" => 1e9,
        "T" => 1e12,
        "P" => 1e15,
        "E" => 1e18,
        "Ki" => 1024.0,
        "Mi" => 1024.0 * 1024.0,
        "Gi" => 1024.0 * 1024.0 * 1024.0,
        "Ti" => 1024.0f64.powi(4),
        "Pi" => 1024.0f64.powi(5),
        "Ei" => 1024.0f64.powi(6),
        e if e.starts_with(['e', 'E']) => {
            let exp: i32 = e[1..].parse().map_err(|_| bad())?;
            10f64.powi(exp)
        }
        _ => return Err(bad()),
    };
    let v = value * mult;
    if !v.is_finite() {
        return Err(bad());
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantities() {
        assert_eq!(parse("3k"), Ok(3000.0));
        assert_eq!(parse("3000"), Ok(3000.0));
        assert_eq!(parse("3Gi"), Ok(3.0 * 1024.0 * 1024.0 * 1024.0));
        assert_eq!(parse("500m"), Ok(0.5));
        assert_eq!(parse("1.5"), Ok(1.5));
        assert_eq!(parse("2e3"), Ok(2000.0));
        assert_eq!(parse("-1"), Ok(-1.0));
        for bad in ["", "k", "3x", "1.2.3", "3 k", "--1", "e3"] {
            assert!(parse(bad).is_err(), "{bad:?} parsed");
        }
    }
}
