//! Times on the command line and in the output: RFC 3339 and times relative to now in,
//! RFC 3339 in UTC out, at the ledger's millisecond resolution.

use jiff::Timestamp;

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
    match t.parse::<Timestamp>() {
        // Floor, not truncation: a time a fraction of a millisecond before the epoch is -1.
        Ok(at) => Ok(TimeArg::At(
            i64::try_from(at.as_nanosecond().div_euclid(1_000_000))
                .expect("jiff's range is within i64 milliseconds"),
        )),
        Err(e) => Err(format!("{t:?} is not a time ({e}); {help}")),
    }
}

pub use gpuledger_crd::parse_duration_ms;

/// An RFC 3339 time (or an ISO 8601 relative of it, such as a space for the `T`) as
/// milliseconds since the Unix epoch.
pub fn parse_rfc3339(s: &str) -> Result<i64, jiff::Error> {
    s.parse::<Timestamp>().map(|t| t.as_millisecond())
}

/// RFC 3339 in UTC, with as many fractional digits as the time has (none for whole seconds).
pub fn fmt_time(ms: i64) -> String {
    Timestamp::from_millisecond(ms).map_or_else(|_| ms.to_string(), |t| t.to_string())
}

/// RFC 3339 in UTC with milliseconds always shown: the ledger's resolution, in a fixed width.
pub fn fmt_ms(ms: i64) -> String {
    Timestamp::from_millisecond(ms).map_or_else(|_| ms.to_string(), |t| format!("{t:.3}"))
}

/// The wall clock now, in milliseconds since the Unix epoch.
pub fn now_ms() -> i64 {
    Timestamp::now().as_millisecond()
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
        for other_form in ["-3 hours", "-1.5h", "-1h ago", "now--1h", "-1mo", "-1w"] {
            let e = parse_time(other_form).expect_err(other_form);
            assert!(e.contains("unknown unit"), "{other_form:?}: {e}");
        }
    }

    #[test]
    fn times_print_in_utc_at_the_ledgers_resolution() {
        assert_eq!(fmt_time(0), "1970-01-01T00:00:00Z");
        assert_eq!(fmt_time(1_500), "1970-01-01T00:00:01.5Z");
        assert_eq!(fmt_time(-1), "1969-12-31T23:59:59.999Z");
        assert_eq!(fmt_ms(1_700_000_000_000), "2023-11-14T22:13:20.000Z");
        assert_eq!(fmt_ms(1_500), "1970-01-01T00:00:01.500Z");
        assert_eq!(fmt_ms(i64::MAX), i64::MAX.to_string());
        assert_eq!(
            parse_rfc3339("2023-11-14T23:13:20.1+01:00").ok(),
            Some(1_700_000_000_100)
        );
    }
}
