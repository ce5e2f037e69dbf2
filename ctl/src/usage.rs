//! `gpuledger usage`: GPU-MiB-hours and GPU-core-hours per namespace, pod or node, integrated
//! exactly from the ledger's events.

use std::collections::{BTreeMap, HashMap};
use std::io::IsTerminal;

use anyhow::{Result, bail};
use gpuledger_ledger::pb::event::Body;
use gpuledger_ledger::{Alloc, CORE_MILLI_PER_GPU, Ledger, pb};
use gpuledger_proto::allocator::v1 as api;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde::Serialize;
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

use crate::client::{Target, connect};
use crate::ledger_cmds::read_log;
use crate::table::Table;

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

    fn key(self, a: &Holder) -> Vec<String> {
        match self {
            By::Namespace => vec![a.pod.namespace.clone()],
            By::Pod => vec![a.pod.namespace.clone(), a.pod.name.clone()],
            By::Node => vec![a.node.clone()],
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

/// A time as given on the command line, resolved against one `now`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TimeArg {
    /// Milliseconds since the Unix epoch.
    At(i64),
    /// Milliseconds relative to now (0 = now, negative = the past).
    FromNow(i64),
}

impl TimeArg {
    fn resolve(self, now_ms: i64) -> i64 {
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

/// Who holds an allocation's shares now, and how much.
#[derive(Debug, Clone)]
struct Holder {
    pod: pb::PodRef,
    node: String,
    mem_mib: u64,
    core_milli: u64,
    /// Start of the current holding (effective ms).
    since_ms: i64,
    /// Groups this allocation was already counted in (normally one).
    counted: Vec<Vec<String>>,
}

impl Holder {
    fn of(a: &Alloc, at_ms: i64) -> Holder {
        Holder {
            pod: a.pod.clone(),
            node: a.node.clone(),
            mem_mib: a.shares.iter().map(|s| s.mem_mib).sum(),
            core_milli: a.shares.iter().map(|s| u64::from(s.core_milli)).sum(),
            since_ms: at_ms,
            counted: Vec::new(),
        }
    }
}

/// Usage of one group: exact integrals and the number of allocations that held GPUs in it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Acc {
    /// Allocations with a holding of positive length inside the window.
    pub allocations: u64,
    /// Σ MiB × ms.
    pub mib_ms: u128,
    /// Σ core_milli × ms.
    pub core_milli_ms: u128,
}

impl Acc {
    fn add(&mut self, o: &Acc) {
        self.allocations += o.allocations;
        self.mib_ms += o.mib_ms;
        self.core_milli_ms += o.core_milli_ms;
    }
}

/// What reading the log tells the caller.
#[derive(Debug, PartialEq, Eq)]
pub enum Step {
    /// Keep reading.
    More,
    /// The event is at or after the window's end: nothing later can count.
    Done,
}

/// Integrates the ledger's allocations over a window, one event at a time. Pure: no IO, no clock.
pub struct Meter {
    by: By,
    since_ms: Option<i64>,
    until_ms: i64,
    ledger: Ledger,
    holders: HashMap<u64, Holder>,
    groups: BTreeMap<Vec<String>, Acc>,
    first_ms: Option<i64>,
    last_ms: Option<i64>,
}

impl Meter {
    /// A meter over `[since, until)`; `since` None = the first event's time.
    pub fn new(by: By, since_ms: Option<i64>, until_ms: i64) -> Meter {
        Meter {
            by,
            since_ms,
            until_ms,
            ledger: Ledger::new(),
            holders: HashMap::new(),
            groups: BTreeMap::new(),
            first_ms: None,
            last_ms: None,
        }
    }

    /// Fold one event (in log order, from seq 1).
    pub fn apply(&mut self, e: &pb::Event) -> Result<Step> {
        let t = self.last_ms.map_or(e.time_ms, |l| l.max(e.time_ms));
        if self.first_ms.is_none() {
            if e.seq != 1 {
                bail!(
                    "the log starts at seq {}, not 1: the events before it are not readable, \
                     and allocations reserved there would be missing",
                    e.seq
                );
            }
            self.first_ms = Some(t);
            self.since_ms.get_or_insert(t);
        }
        if t >= self.until_ms {
            return Ok(Step::Done);
        }
        self.last_ms = Some(t);
        self.ledger.apply(e).map_err(|err| {
            anyhow::anyhow!("the log does not replay (run gpuledger verify): {err}")
        })?;
        match &e.body {
            Some(Body::Reserved(r)) => {
                let a = self
                    .ledger
                    .alloc(r.allocation_id)
                    .expect("a Reserved the ledger accepted is live");
                self.holders.insert(r.allocation_id, Holder::of(a, t));
            }
            Some(Body::Released(r)) => {
                if let Some(h) = self.holders.remove(&r.allocation_id) {
                    self.close(h, t);
                }
            }
            Some(Body::IdentityCorrected(c)) => {
                for id in [c.from_allocation_id, c.to_allocation_id] {
                    let Some(old) = self.holders.remove(&id) else {
                        continue;
                    };
                    let counted = old.counted.clone();
                    self.close(old, t);
                    let a = self
                        .ledger
                        .alloc(id)
                        .expect("a corrected allocation the ledger accepted is live");
                    let mut h = Holder::of(a, t);
                    h.counted = counted;
                    self.holders.insert(id, h);
                }
            }
            _ => {}
        }
        Ok(Step::More)
    }

    /// Close the holding `h` at `end_ms`, adding its part inside the window to its group.
    fn close(&mut self, mut h: Holder, end_ms: i64) {
        let since = self.since_ms.unwrap_or(i64::MIN);
        let lo = h.since_ms.max(since);
        let hi = end_ms.min(self.until_ms);
        if hi <= lo {
            return;
        }
        let ms = (hi - lo) as u128;
        let key = self.by.key(&h);
        let acc = self.groups.entry(key.clone()).or_default();
        acc.mib_ms += u128::from(h.mem_mib) * ms;
        acc.core_milli_ms += u128::from(h.core_milli) * ms;
        if !h.counted.contains(&key) {
            acc.allocations += 1;
            h.counted.push(key);
        }
    }

    /// Close every holding still open at the window's end; the rows by group key.
    pub fn finish(mut self) -> Report {
        let mut open: Vec<(u64, Holder)> = self.holders.drain().collect();
        open.sort_by_key(|(id, _)| *id);
        for (_, h) in open {
            self.close(h, self.until_ms);
        }
        let mut total = Acc::default();
        for a in self.groups.values() {
            total.add(a);
        }
        Report {
            by: self.by,
            since_ms: self.since_ms.unwrap_or(self.until_ms),
            until_ms: self.until_ms,
            seq: self.ledger.seq(),
            first_ms: self.first_ms,
            rows: self.groups,
            total,
        }
    }
}

/// The result of a usage run.
#[derive(Debug)]
pub struct Report {
    by: By,
    since_ms: i64,
    until_ms: i64,
    seq: u64,
    /// The ledger's first event time (None: the ledger is empty).
    first_ms: Option<i64>,
    rows: BTreeMap<Vec<String>, Acc>,
    total: Acc,
}

/// `v / per_hour` rounded half up to 6 decimals, computed in integers.
fn hours(v: u128, per_hour: u128) -> String {
    let micro = (v * 1_000_000 + per_hour / 2) / per_hour;
    format!("{}.{:06}", micro / 1_000_000, micro % 1_000_000)
}

fn mib_hours(a: &Acc) -> String {
    hours(a.mib_ms, MS_PER_HOUR)
}

fn core_hours(a: &Acc) -> String {
    hours(
        a.core_milli_ms,
        MS_PER_HOUR * u128::from(CORE_MILLI_PER_GPU),
    )
}

/// RFC 3339 in UTC with milliseconds always shown: the ledger's resolution, in a fixed width.
fn fmt_ms(ms: i64) -> String {
    let f = time::macros::format_description!(
        "[year]-[month]-[day]T[hour]:[minute]:[second].[subsecond digits:3]Z"
    );
    OffsetDateTime::from_unix_timestamp_nanos(i128::from(ms) * 1_000_000)
        .ok()
        .and_then(|t| t.format(&f).ok())
        .unwrap_or_else(|| ms.to_string())
}

fn csv_field(s: &str) -> String {
    if s.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_string()
    }
}

#[derive(Serialize)]
struct JsonRow {
    #[serde(flatten)]
    key: BTreeMap<&'static str, String>,
    allocations: u64,
    gpu_mib_hours: f64,
    gpu_core_hours: f64,
    gpu_mib_ms: u128,
    gpu_core_milli_ms: u128,
}

#[derive(Serialize)]
struct JsonUnits {
    gpu_mib_hours: &'static str,
    gpu_core_hours: &'static str,
    gpu_mib_ms: &'static str,
    gpu_core_milli_ms: &'static str,
}

#[derive(Serialize)]
struct JsonReport {
    since: String,
    until: String,
    since_ms: i64,
    until_ms: i64,
    by: &'static str,
    seq: u64,
    units: JsonUnits,
    rows: Vec<JsonRow>,
    total: JsonRow,
}

fn json_row(key: BTreeMap<&'static str, String>, a: &Acc) -> JsonRow {
    JsonRow {
        key,
        allocations: a.allocations,
        gpu_mib_hours: a.mib_ms as f64 / MS_PER_HOUR as f64,
        gpu_core_hours: a.core_milli_ms as f64
            / (MS_PER_HOUR * u128::from(CORE_MILLI_PER_GPU)) as f64,
        gpu_mib_ms: a.mib_ms,
        gpu_core_milli_ms: a.core_milli_ms,
    }
}

impl Report {
    /// The report in the chosen format.
    pub fn render(&self, format: Format) -> String {
        match format {
            Format::Table => self.table(),
            Format::Csv => self.csv(),
            Format::Json => self.json(),
        }
    }

    fn table(&self) -> String {
        let mut header: Vec<String> = self.by.columns().iter().map(|c| c.to_uppercase()).collect();
        header.extend(
            ["ALLOCATIONS", "GPU-MiB-HOURS", "GPU-CORE-HOURS"]
                .iter()
                .map(|s| (*s).to_string()),
        );
        let header: Vec<&str> = header.iter().map(String::as_str).collect();
        let mut t = Table::new(&header);
        for (key, a) in &self.rows {
            let mut row = key.clone();
            row.extend([a.allocations.to_string(), mib_hours(a), core_hours(a)]);
            t.row(row);
        }
        let mut total = vec!["TOTAL".to_string()];
        total.resize(self.by.columns().len(), String::new());
        total.extend([
            self.total.allocations.to_string(),
            mib_hours(&self.total),
            core_hours(&self.total),
        ]);
        t.row(total);
        let mut out = t.render();
        out.push_str(&format!(
            "\nwindow [{}, {}) = {} h, by {}; ledger read to seq {}\n\
             GPU-MiB-HOURS: GPU memory held, MiB x hours. GPU-CORE-HOURS: GPU compute held, \
             whole GPUs x hours (core_milli/1000; 1.0 = one GPU for one hour).\n",
            fmt_ms(self.since_ms),
            fmt_ms(self.until_ms),
            hours((self.until_ms - self.since_ms).max(0) as u128, MS_PER_HOUR),
            self.by.name(),
            self.seq
        ));
        out
    }

    fn csv(&self) -> String {
        let mut out = self.by.columns().join(",");
        out.push_str(",allocations,gpu_mib_hours,gpu_core_hours,gpu_mib_ms,gpu_core_milli_ms\n");
        for (key, a) in &self.rows {
            let cells: Vec<String> = key.iter().map(|k| csv_field(k)).collect();
            out.push_str(&format!(
                "{},{},{},{},{},{}\n",
                cells.join(","),
                a.allocations,
                mib_hours(a),
                core_hours(a),
                a.mib_ms,
                a.core_milli_ms
            ));
        }
        out
    }

    fn json(&self) -> String {
        let cols = self.by.columns();
        let rows = self
            .rows
            .iter()
            .map(|(key, a)| json_row(cols.iter().copied().zip(key.iter().cloned()).collect(), a))
            .collect();
        let r = JsonReport {
            since: fmt_ms(self.since_ms),
            until: fmt_ms(self.until_ms),
            since_ms: self.since_ms,
            until_ms: self.until_ms,
            by: self.by.name(),
            seq: self.seq,
            units: JsonUnits {
                gpu_mib_hours: "GPU memory held: MiB x hours",
                gpu_core_hours: "GPU compute held: whole GPUs x hours (core_milli / 1000)",
                gpu_mib_ms: "exact: MiB x milliseconds",
                gpu_core_milli_ms: "exact: core_milli x milliseconds (1000 core_milli = one GPU)",
            },
            rows,
            total: json_row(BTreeMap::new(), &self.total),
        };
        let mut s = serde_json::to_string_pretty(&r).expect("plain data serializes");
        s.push('\n');
        s
    }
}

fn now_ms() -> i64 {
    i64::try_from(OffsetDateTime::now_utc().unix_timestamp_nanos() / 1_000_000)
        .expect("the clock is within i64 milliseconds")
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

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(seq: u64, time_ms: i64, body: Body) -> pb::Event {
        pb::Event {
            seq,
            epoch: 1,
            time_ms,
            body: Some(body),
        }
    }

    fn node() -> Body {
        Body::NodeRegistered(pb::NodeRegistered {
            inventory: Some(pb::NodeInventory {
                node: "n1".into(),
                gpus: (0..2)
                    .map(|i| pb::Gpu {
                        uuid: format!("G{i}"),
                        index: i,
                        model: "A100".into(),
                        memory_mib: 40_000,
                        healthy: true,
                    })
                    .collect(),
                cpu_milli: 0,
                memory_mib: 0,
            }),
        })
    }

    fn reserve(id: u64, ns: &str, name: &str, shares: &[(&str, u64, u32)]) -> Body {
        Body::Reserved(pb::Reserved {
            allocation_id: id,
            pod: Some(pb::PodRef {
                uid: format!("uid-{name}"),
                namespace: ns.into(),
                name: name.into(),
            }),
            container: "main".into(),
            node: "n1".into(),
            shares: shares
                .iter()
                .map(|(g, m, c)| pb::GpuShare {
                    gpu_uuid: (*g).into(),
                    mem_mib: *m,
                    core_milli: *c,
                })
                .collect(),
            deadline_ms: 0,
            cpu_milli: 0,
            memory_mib: 0,
            policy: "binpack".into(),
        })
    }

    fn release(id: u64) -> Body {
        Body::Released(pb::Released {
            allocation_id: id,
            reason: "pod deleted".into(),
            node: "n1".into(),
        })
    }

    fn run(events: &[pb::Event], by: By, since: Option<i64>, until: i64) -> Report {
        let mut m = Meter::new(by, since, until);
        for e in events {
            if m.apply(e).expect("applies") == Step::Done {
                break;
            }
        }
        m.finish()
    }

    #[test]
    fn clips_to_the_window_and_counts_open_allocations_to_until() {
        let events = [
            ev(1, 0, node()),
            ev(2, 1_000, reserve(2, "a", "p", &[("G0", 1_000, 250)])),
            ev(
                3,
                5_000,
                reserve(3, "b", "q", &[("G0", 2_000, 0), ("G1", 2_000, 0)]),
            ),
            ev(4, 9_000, release(2)),
        ];
        let r = run(&events, By::Namespace, Some(3_000), 20_000);
        // p: [3000, 9000) = 6000 ms × 1000 MiB, × 250 core_milli.
        let a = r.rows[&vec!["a".to_string()]];
        assert_eq!(a.mib_ms, 6_000_000);
        assert_eq!(a.core_milli_ms, 1_500_000);
        assert_eq!(a.allocations, 1);
        // q: [5000, 20000) open at until, on two GPUs: 15000 × 4000 MiB.
        let b = r.rows[&vec!["b".to_string()]];
        assert_eq!(b.mib_ms, 60_000_000);
        assert_eq!(b.core_milli_ms, 0);
        assert_eq!(r.total.mib_ms, 66_000_000);
    }

    #[test]
    fn default_since_is_the_first_event_and_reading_stops_at_until() {
        let events = [
            ev(1, 500, node()),
            ev(2, 1_000, reserve(2, "a", "p", &[("G0", 1_000, 1_000)])),
            ev(3, 4_000, release(2)),
            ev(4, 4_000, reserve(4, "a", "p2", &[("G1", 10, 10)])),
        ];
        let r = run(&events, By::Pod, None, 4_000);
        assert_eq!(r.since_ms, 500);
        assert_eq!(r.rows.len(), 1, "p2 starts at until: {:?}", r.rows);
        let p = r.rows[&vec!["a".to_string(), "p".to_string()]];
        assert_eq!(p.core_milli_ms, 3_000_000);
        assert_eq!(core_hours(&p), "0.000833");
    }

    #[test]
    fn a_backwards_timestamp_counts_as_the_one_before() {
        let events = [
            ev(1, 0, node()),
            ev(2, 10_000, reserve(2, "a", "p", &[("G0", 100, 0)])),
            ev(3, 7_000, release(2)),
        ];
        let r = run(&events, By::Node, None, 20_000);
        assert!(r.rows.is_empty(), "{:?}", r.rows);
    }

    #[test]
    fn an_identity_correction_moves_the_rest_of_the_time() {
        let events = [
            ev(1, 0, node()),
            ev(2, 0, reserve(2, "a", "p", &[("G0", 100, 0)])),
            ev(3, 0, reserve(3, "b", "q", &[("G1", 300, 0)])),
            ev(
                4,
                1_000,
                Body::IdentityCorrected(pb::IdentityCorrected {
                    from_allocation_id: 2,
                    to_allocation_id: 3,
                    device_ids: vec![],
                    node: "n1".into(),
                }),
            ),
        ];
        let r = run(&events, By::Namespace, None, 3_000);
        // a: 100 MiB for 1 s, then 300 MiB for 2 s; b: the opposite.
        assert_eq!(r.rows[&vec!["a".to_string()]].mib_ms, 100_000 + 600_000);
        assert_eq!(r.rows[&vec!["b".to_string()]].mib_ms, 300_000 + 200_000);
        assert_eq!(r.rows[&vec!["a".to_string()]].allocations, 2);
    }

    #[test]
    fn a_log_that_does_not_start_at_seq_1_is_refused() {
        let mut m = Meter::new(By::Namespace, None, 10);
        let err = m.apply(&ev(5, 0, node())).expect_err("refused");
        assert!(err.to_string().contains("starts at seq 5"), "{err}");
    }

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

    #[test]
    fn hours_round_half_up_in_integers() {
        assert_eq!(hours(3_600_000, MS_PER_HOUR), "1.000000");
        assert_eq!(hours(1_800, MS_PER_HOUR), "0.000500");
        assert_eq!(hours(1, MS_PER_HOUR), "0.000000");
        assert_eq!(hours(2, MS_PER_HOUR), "0.000001");
    }

    #[test]
    fn csv_quotes_what_needs_it() {
        assert_eq!(csv_field("a,b"), "\"a,b\"");
        assert_eq!(csv_field("plain"), "plain");
    }
}
