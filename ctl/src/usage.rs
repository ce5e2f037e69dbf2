//! `gpuledger usage`: GPU-MiB-hours and GPU-core-hours per namespace, pod or node, integrated
//! exactly from the ledger's events.

mod meter;
mod report;
#[cfg(test)]
mod tests;

use std::io::IsTerminal;

use anyhow::{Result, bail};
use gpuledger_proto::allocator::v1 as api;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::client::{Target, connect, read_log};
use crate::when::{TimeArg, fmt_ms, now_ms, parse_time};
use meter::{Meter, Step};

/// Milliseconds in an hour: the integrals are kept in MiB·ms and core_milli·ms.
const MS_PER_HOUR: u128 = 3_600_000;

/// The long help of `gpuledger usage`: what is counted, and in which units.
pub const LONG_ABOUT: &str = "\
GPU memory and compute held per namespace, pod or node over a time window, integrated exactly \
from the ledger.

What is counted: the ledger replayed event by event, integrated over time. An allocation holds \
its GPU memory (MiB, summed over its GPUs) and its compute share (core_milli, summed over its \
GPUs) from its reserve time to its release time:
  - reserve time = the timestamp of its Reserved event (the leader's wall clock when it chose \
the GPUs; from then on nobody else can have them, bound or not);
  - release time = the timestamp of its Released event (pod deleted or finished, node removed, \
or reservation expired). A reservation's deadline_ms is not a release: an expired reservation \
holds its GPUs until the allocator writes Released(expired);
  - an allocation not released by --until counts up to --until.
Each interval is clipped to [--since, --until). Timestamps are milliseconds and the integral is \
exact: the csv and json outputs also carry the integers (MiB x ms, core_milli x ms); hours are \
rounded to 6 decimals. When the node agent corrected which pod holds an allocation \
(IdentityCorrected), the time after the correction goes to the corrected pod. Events count in log \
order: a timestamp earlier than the one before it (clock skew between two leaders) counts as the \
one before it. --by pod groups by namespace/name, so a pod re-created under the same name is one \
row.

Units:
  GPU-MiB-HOURS   GPU memory held: MiB x hours (16384 MiB for 2 h = 32768).
  GPU-CORE-HOURS  GPU compute held: whole GPUs x hours, core_milli / 1000 (1.0 = one whole GPU \
for one hour; a 25 % share for 4 h = 1.0). An allocation without a compute share adds memory only.

The whole log is read from seq 1 (allocations reserved before --since still count inside the \
window), and reading stops at the first event at or after --until.";

/// Arguments of `gpuledger usage`.
#[derive(clap::Args, Debug)]
pub struct UsageArgs {
    #[command(flatten)]
    target: Target,
    /// Start of the window (inclusive): an RFC 3339 time (2026-11-21T10:00:00Z,
    /// 2026-11-21T11:00:00.250+01:00), `now`, or relative to now: -90s, -30m, -1h, -2d, -1h30m.
    /// Default: the ledger's first event.
    #[arg(long, value_name = "TIME", value_parser = parse_time, allow_hyphen_values = true)]
    since: Option<TimeArg>,
    /// End of the window (exclusive), in the same forms. Default: now. Allocations still held
    /// then count up to it. A time in the future is refused.
    #[arg(long, value_name = "TIME", value_parser = parse_time, allow_hyphen_values = true)]
    until: Option<TimeArg>,
    /// One row per namespace, per pod (namespace/name) or per node.
    #[arg(long, value_enum, default_value_t = By::Namespace)]
    by: By,
    /// table: aligned columns with a total; csv: a header row, then one row per group (no total);
    /// json: one document with the window, the units, the rows and the total.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    format: Format,
}

/// How rows are grouped.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum By {
    /// The pod's namespace.
    Namespace,
    /// The pod, as namespace and name.
    Pod,
    /// The node the GPUs are on.
    Node,
}

impl By {
    fn columns(self) -> &'static [&'static str] {
        match self {
            By::Namespace => &["namespace"],
            By::Pod => &["namespace", "pod"],
            By::Node => &["node"],
        }
    }

    fn name(self) -> &'static str {
        match self {
            By::Namespace => "namespace",
            By::Pod => "pod",
            By::Node => "node",
        }
    }
}

/// Output format.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// Aligned columns, a total row and a footer with the window and the units.
    Table,
    /// Comma-separated, with a header row.
    Csv,
    /// One JSON document.
    Json,
}

/// `gpuledger usage`.
pub async fn usage(a: UsageArgs) -> Result<()> {
    let now = now_ms();
    let until = a.until.map_or(now, |u| u.resolve(now));
    let since = a.since.map(|s| s.resolve(now));
    if until > now {
        bail!(
            "--until {} is in the future (now is {}): usage after now is not known yet",
            fmt_ms(until),
            fmt_ms(now)
        );
    }
    if let Some(s) = since
        && s >= until
    {
        bail!(
            "--since {} is not before --until {}: the window is empty",
            fmt_ms(s),
            fmt_ms(until)
        );
    }
    let head = {
        let mut c = connect(&a.target).await?;
        c.status(api::StatusRequest {})
            .await
            .map(|s| s.into_inner().seq)
            .unwrap_or(0)
    };
    let progress = if std::io::stderr().is_terminal() {
        ProgressBar::with_draw_target(Some(head), ProgressDrawTarget::stderr())
    } else {
        ProgressBar::hidden()
    };
    progress.set_style(
        ProgressStyle::with_template("{bar:30} seq {pos}/{len} read, {elapsed} {msg}")
            .expect("static template"),
    );
    let mut meter = Meter::new(a.by, since, until);
    read_log(&a.target, 0, |e| {
        if e.seq % 4096 == 0 {
            if e.seq > progress.length().unwrap_or(0) {
                progress.set_length(e.seq);
            }
            progress.set_position(e.seq);
        }
        Ok(meter.apply(e)? == Step::More)
    })
    .await?;
    progress.finish_and_clear();
    let report = meter.finish();
    if let Some(first) = report.first_ms
        && a.since.is_none()
        && first >= report.until_ms
    {
        bail!(
            "--until {} is not after the ledger's first event ({}): the window is empty",
            fmt_ms(report.until_ms),
            fmt_ms(first)
        );
    }
    print!("{}", report.render(a.format));
    Ok(())
}
