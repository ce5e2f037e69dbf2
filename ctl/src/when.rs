//! Times on the command line and in the output: RFC 3339 and times relative to now in,
//! RFC 3339 in UTC out, at the ledger's millisecond resolution.

use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

/// A time as given on the command line, resolved against one `now`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TimeArg {
    /// Milliseconds since the Unix epoch.
    At(i64),
    /// Milliseconds relative to now (0 = now, negative = the past).
    FromNow(i64),
}

impl TimeArg {
    /// Milliseconds since the Unix epoch, relative times taken from `now_ms`.
    pub fn resolve(self, now_ms: i64) -> i64 {
        match self {
            TimeArg::At(t) => t,
            TimeArg::FromNow(d) => now_ms.saturating_add(d),
        }
    }
}

/// Parse `now`, `-1h30m`, `now-15m` or an RFC 3339 time.
pub fn parse_time(s: &str) -> Result<TimeArg, String> {
    let t = s.trim();
    let help = "expected an RFC 3339 time such as 2026-11-21T10:00:00Z, `now`, \
                or a time before now such as -90s, -30m, -1h, -2d or -1h30m";
    if t.eq_ignore_ascii_case("now") {
        return Ok(TimeArg::FromNow(0));
    }
    let rel = t.strip_prefix("now").unwrap_or(t);
    if let Some(d) = rel.strip_prefix('-') {
        return parse_duration_ms(d)
            .map(|ms| TimeArg::FromNow(-ms))
            .map_err(|e| format!("{e}; {help}"));
    }
    match OffsetDateTime::parse(t, &Rfc3339) {
        Ok(at) => i64::try_from(at.unix_timestamp_nanos().div_euclid(1_000_000))
            .map(TimeArg::At)
            .map_err(|_| format!("{t:?} is out of range")),
        Err(e) => Err(format!("{t:?} is not a time ({e}); {help}")),
    }
}

/// `1h30m` → milliseconds. Units: s, m, h, d.
fn parse_duration_ms(s: &str) -> Result<i64, String> {
    if s.is_empty() {
        return Err("a duration is missing after '-'".into());
    }
    let mut total: i64 = 0;
    let mut num = String::new();
    for c in s.chars() {
        if c.is_ascii_digit() {
            num.push(c);
            continue;
        }
        let unit: i64 = match c {
            's' => 1_000,
            'm' => 60_000,
            'h' => 3_600_000,
            'd' => 86_400_000,
            other => return Err(format!("unknown unit {other:?} in duration {s:?}")),
        };
        if num.is_empty() {
            return Err(format!(
                "a number is missing before {c:?} in duration {s:?}"
            ));
        }
        let n: i64 = num
            .parse()
            .map_err(|_| format!("duration {s:?} is too large"))?;
        total = n
            .checked_mul(unit)
            .and_then(|v| total.checked_add(v))
            .ok_or_else(|| format!("duration {s:?} is too large"))?;
        num.clear();
    }
    if !num.is_empty() {
        return Err(format!("duration {s:?} ends without a unit (s, m, h or d)"));
    }
    Ok(total)
}

/// An RFC 3339 time as milliseconds since the Unix epoch.
pub fn parse_rfc3339(s: &str) -> Result<i64, time::error::Parse> {
    OffsetDateTime::parse(s, &Rfc3339).map(|t| (t.unix_timestamp_nanos() / 1_000_000) as i64)
}

/// RFC 3339 in UTC, with as many fractional digits as the time has (none for whole seconds).
pub fn fmt_time(ms: i64) -> String {
    OffsetDateTime::from_unix_timestamp_nanos(i128::from(ms) * 1_000_000)
        .ok()
        .and_then(|t| t.format(&Rfc3339).ok())
        .unwrap_or_else(|| ms.to_string())
}

/// RFC 3339 in UTC with milliseconds always shown: the ledger's resolution, in a fixed width.
pub fn fmt_ms(ms: i64) -> String {
    let f = time::macros::format_description!(
        "[year]-[month]-[day]T[hour]:[minute]:[second].[subsecond digits:3]Z"
    );
    OffsetDateTime::from_unix_timestamp_nanos(i128::from(ms) * 1_000_000)
        .ok()
        .and_then(|t| t.format(&f).ok())
        .unwrap_or_else(|| ms.to_string())
}

/// The wall clock now, in milliseconds since the Unix epoch.
pub fn now_ms() -> i64 {
    i64::try_from(OffsetDateTime::now_utc().unix_timestamp_nanos() / 1_000_000)
        .expect("the clock is within i64 milliseconds")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_parse_absolute_and_relative() {
        assert_eq!(parse_time("1970-01-01T00:00:01.5Z"), Ok(TimeArg::At(1_500)));
        assert_eq!(parse_time("1970-01-01T01:00:00+01:00"), Ok(TimeArg::At(0)));
        assert_eq!(parse_time("now"), Ok(TimeArg::FromNow(0)));
        assert_eq!(parse_time("-1h30m"), Ok(TimeArg::FromNow(-5_400_000)));
        assert_eq!(parse_time("now-2d"), Ok(TimeArg::FromNow(-172_800_000)));
        for bad in ["yesterday", "-1x", "-h", "-15", "", "2026-13-01T00:00:00Z"] {
            assert!(parse_time(bad).is_err(), "{bad:?} parsed");
        }
        assert!(parse_time("-99999999999999999999d").is_err());
    }
}
