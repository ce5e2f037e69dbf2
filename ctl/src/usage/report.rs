//! The usage report: exact integrals as hours, in a table, CSV or JSON.

use std::collections::BTreeMap;

use gpuledger_ledger::CORE_MILLI_PER_GPU;
use serde::Serialize;

use super::{By, Format, MS_PER_HOUR};
use crate::table::Table;
use crate::when::fmt_ms;

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
    pub(super) fn add(&mut self, o: &Acc) {
        self.allocations += o.allocations;
        self.mib_ms += o.mib_ms;
        self.core_milli_ms += o.core_milli_ms;
    }
}

/// The result of a usage run.
#[derive(Debug)]
pub struct Report {
    pub(super) by: By,
    pub(super) since_ms: i64,
    pub(super) until_ms: i64,
    pub(super) seq: u64,
    /// The ledger's first event time (None: the ledger is empty).
    pub(super) first_ms: Option<i64>,
    pub(super) rows: BTreeMap<Vec<String>, Acc>,
    pub(super) total: Acc,
}

/// `v / per_hour` rounded half up to 6 decimals, computed in integers.
fn hours(v: u128, per_hour: u128) -> String {
    let micro = (v * 1_000_000 + per_hour / 2) / per_hour;
    format!("{}.{:06}", micro / 1_000_000, micro % 1_000_000)
}

fn mib_hours(a: &Acc) -> String {
    hours(a.mib_ms, MS_PER_HOUR)
}

pub(super) fn core_hours(a: &Acc) -> String {
    hours(
        a.core_milli_ms,
        MS_PER_HOUR * u128::from(CORE_MILLI_PER_GPU),
    )
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
        let mut w = csv::Writer::from_writer(Vec::new());
        let header = self.by.columns().iter().copied().chain([
            "allocations",
            "gpu_mib_hours",
            "gpu_core_hours",
            "gpu_mib_ms",
            "gpu_core_milli_ms",
        ]);
        w.write_record(header)
            .expect("writing to memory does not fail");
        for (key, a) in &self.rows {
            let figures = [
                a.allocations.to_string(),
                mib_hours(a),
                core_hours(a),
                a.mib_ms.to_string(),
                a.core_milli_ms.to_string(),
            ];
            w.write_record(key.iter().chain(&figures))
                .expect("writing to memory does not fail");
        }
        let bytes = w.into_inner().expect("flushing to memory does not fail");
        String::from_utf8(bytes).expect("CSV of UTF-8 strings is UTF-8")
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hours_round_half_up_in_integers() {
        assert_eq!(hours(3_600_000, MS_PER_HOUR), "1.000000");
        assert_eq!(hours(1_800, MS_PER_HOUR), "0.000500");
        assert_eq!(hours(1, MS_PER_HOUR), "0.000000");
        assert_eq!(hours(2, MS_PER_HOUR), "0.000001");
    }

    #[test]
    fn csv_quotes_what_needs_it() {
        let acc = Acc {
            allocations: 1,
            mib_ms: 3_600_000,
            core_milli_ms: 0,
        };
        let rows = [
            (vec!["a,b".to_string(), "say \"hi\"".to_string()], acc),
            (vec!["plain".to_string(), "p".to_string()], acc),
        ];
        let r = Report {
            by: By::Pod,
            since_ms: 0,
            until_ms: 1,
            seq: 1,
            first_ms: Some(0),
            rows: rows.into_iter().collect(),
            total: acc,
        };
        assert_eq!(
            r.render(Format::Csv),
            "namespace,pod,allocations,gpu_mib_hours,gpu_core_hours,gpu_mib_ms,gpu_core_milli_ms\n\
             \"a,b\",\"say \"\"hi\"\"\",1,1.000000,0.000000,3600000,0\n\
             plain,p,1,1.000000,0.000000,3600000,0\n"
        );
    }
}
