//! A namespace's consumption integrals: advanced when its holdings change, asked about any
//! time after, and when a spent rolling budget recovers.

use super::window::Window;
use super::{Bucket, NsUsage};

impl NsUsage {
    /// Count the holdings from `last_ms` to `t` (t ≥ last_ms) under `window`.
    pub(super) fn advance(&mut self, t: i64, window: Option<Window>) {
        let from = self.last_ms;
        if t <= from {
            return;
        }
        let (m, c) = (u128::from(self.mem_mib), u128::from(self.core_milli));
        let ms = (t - from) as u128;
        self.mib_ms += m * ms;
        self.core_ms += c * ms;
        self.last_ms = t;
        match window {
            None => {}
            Some(Window::Rolling { len_ms, bucket_ms }) => {
                // Older than the window at t can never count again.
                let lo = from.max(t - len_ms).max(self.window_start_ms);
                let mut s = lo;
                while s < t {
                    let b0 = s.div_euclid(bucket_ms) * bucket_ms;
                    let e = (b0 + bucket_ms).min(t);
                    self.add(b0, m * (e - s) as u128, c * (e - s) as u128);
                    s = e;
                }
                self.evict(t - len_ms, bucket_ms);
            }
            Some(w) => {
                let p = w.period_start(t).unwrap_or(t);
                if p > self.window_start_ms {
                    self.window_start_ms = p;
                    self.buckets.clear();
                    self.bucket_sum = (0, 0);
                }
                let lo = from.max(self.window_start_ms);
                if t > lo {
                    let d = (t - lo) as u128;
                    self.add(p, m * d, c * d);
                }
            }
        }
    }

    pub(super) fn add(&mut self, start_ms: i64, mib: u128, core: u128) {
        if mib == 0 && core == 0 {
            return;
        }
        match self.buckets.back_mut() {
            Some(b) if b.start_ms == start_ms => {
                b.mib_ms += mib;
                b.core_ms += core;
            }
            _ => self.buckets.push_back(Bucket {
                start_ms,
                mib_ms: mib,
                core_ms: core,
            }),
        }
        self.bucket_sum.0 += mib;
        self.bucket_sum.1 += core;
    }

    /// Drop buckets that end at or before `cut`.
    pub(super) fn evict(&mut self, cut: i64, bucket_ms: i64) {
        while let Some(b) = self.buckets.front().copied() {
            if b.start_ms + bucket_ms > cut {
                break;
            }
            self.buckets.pop_front();
            self.bucket_sum.0 -= b.mib_ms;
            self.bucket_sum.1 -= b.core_ms;
        }
    }

    /// Start counting afresh under a new window from `t` (history under another window is
    /// not kept, so it cannot be recounted).
    pub(super) fn restart(&mut self, t: i64, window: Option<Window>) {
        self.buckets.clear();
        self.bucket_sum = (0, 0);
        self.window_start_ms = match window.and_then(|w| w.period_start(t)) {
            Some(p) => p.max(t),
            None => t,
        };
    }

    /// Consumption inside `window` at `now` (≥ last_ms), in (MiB·ms, core_milli·ms), with
    /// the holdings extended from `last_ms` to `now`.
    pub(super) fn used_at(&self, now: i64, window: Window) -> (u128, u128) {
        let (m, c) = (u128::from(self.mem_mib), u128::from(self.core_milli));
        match window {
            Window::Rolling { len_ms, bucket_ms } => {
                let cut = now - len_ms;
                let (mut um, mut uc) = self.bucket_sum;
                for b in self
                    .buckets
                    .iter()
                    .take_while(|b| b.start_ms + bucket_ms <= cut)
                {
                    um -= b.mib_ms;
                    uc -= b.core_ms;
                }
                let lo = self.last_ms.max(cut).max(self.window_start_ms);
                let d = (now - lo).max(0) as u128;
                (um + m * d, uc + c * d)
            }
            w => {
                let p = w.period_start(now).unwrap_or(now);
                let lo = self.last_ms.max(p).max(self.window_start_ms);
                let d = (now - lo).max(0) as u128;
                if p > self.window_start_ms {
                    (m * d, c * d)
                } else {
                    (self.bucket_sum.0 + m * d, self.bucket_sum.1 + c * d)
                }
            }
        }
    }
}

/// The first time after `now` at which a spent rolling budget is within its amount again, if
/// the namespace keeps holding what it holds: buckets leave the window one by one while the
/// holdings keep adding. None when the holdings alone spend the amount within one window.
pub(super) fn recovery_rolling(
    u: &NsUsage,
    now: i64,
    len_ms: i64,
    bucket_ms: i64,
    mib: bool,
    limit: u128,
) -> Option<i64> {
    let rate = u128::from(if mib { u.mem_mib } else { u.core_milli });
    if rate * len_ms as u128 >= limit {
        return None;
    }
    for b in &u.buckets {
        let at = b.start_ms + bucket_ms + len_ms;
        if at <= now {
            continue;
        }
        let (m, c) = u.used_at(at, Window::Rolling { len_ms, bucket_ms });
        if (if mib { m } else { c }) < limit {
            return Some(at);
        }
    }
    Some(now.max(u.last_ms) + len_ms)
}
