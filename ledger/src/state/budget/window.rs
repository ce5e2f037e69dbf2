//! The calendar and rolling windows a budget counts in, and where a time falls in them (UTC).

use jiff::ToSpan;
use jiff::tz::TimeZone;

use super::ROLLING_BUCKETS;
use crate::pb;

const DAY_MS: i64 = 86_400_000;

/// The window a budget counts in, with what is needed to place a time in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Window {
    Rolling { len_ms: i64, bucket_ms: i64 },
    Day,
    Week,
    Month,
}

impl Window {
    pub(super) fn of(b: &pb::BudgetSet) -> Option<Window> {
        match pb::BudgetWindow::try_from(b.window).ok()? {
            pb::BudgetWindow::Rolling => Some(Window::Rolling {
                len_ms: b.rolling_ms,
                bucket_ms: (b.rolling_ms / ROLLING_BUCKETS).max(1000),
            }),
            pb::BudgetWindow::Day => Some(Window::Day),
            pb::BudgetWindow::Week => Some(Window::Week),
            pb::BudgetWindow::Month => Some(Window::Month),
            pb::BudgetWindow::Unspecified => None,
        }
    }

    /// Start of the calendar period holding `t` (UTC); None for a rolling window.
    pub(super) fn period_start(self, t: i64) -> Option<i64> {
        let day = t.div_euclid(DAY_MS) * DAY_MS;
        match self {
            Window::Rolling { .. } => None,
            Window::Day => Some(day),
            // 1970-01-01 was a Thursday: three days after a Monday.
            Window::Week => Some(day - (t.div_euclid(DAY_MS) + 3).rem_euclid(7) * DAY_MS),
            Window::Month => Some(month_start(t, 0)),
        }
    }

    /// Start of the calendar period after the one holding `t`.
    pub(super) fn next_period(self, t: i64) -> i64 {
        match self {
            Window::Rolling { len_ms, .. } => t + len_ms,
            Window::Day => t.div_euclid(DAY_MS) * DAY_MS + DAY_MS,
            Window::Week => self.period_start(t).unwrap_or(t) + 7 * DAY_MS,
            Window::Month => month_start(t, 1),
        }
    }
}

/// Midnight UTC of the first day of the month holding `t`, `ahead` months later. Times outside
/// what a calendar can hold (never an event's) clamp to the time itself.
fn month_start(t: i64, ahead: i64) -> i64 {
    let Ok(ts) = jiff::Timestamp::from_millisecond(t) else {
        return t;
    };
    let first = ts.to_zoned(TimeZone::UTC).date().first_of_month();
    first
        .checked_add(ahead.months())
        .and_then(|d| d.to_zoned(TimeZone::UTC))
        .map_or(t, |z| z.timestamp().as_millisecond())
}
