//! The openb trace files (`testdata/traces/openb/`): node and pod lists, read by header name.
//! `gpuledger simulate` replays them through the placement policies; `gpuledger-chaos run
//! --workload openb` runs their pod sizes and lifetimes on the local cluster.

use std::collections::HashMap;
use std::path::Path;

use csv::{Position, ReaderBuilder, StringRecord, Trim};

/// Why a trace file could not be read. None is retryable: the file must change.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// The file could not be read.
    #[error("cannot read {}: {error}", path.display())]
    Read {
        /// The file.
        path: std::path::PathBuf,
        /// What the system said.
        error: std::io::Error,
    },
    /// The file is not CSV.
    #[error("{}: not readable as CSV: {error}", path.display())]
    Csv {
        /// The file.
        path: std::path::PathBuf,
        /// What the CSV reader said.
        error: csv::Error,
    },
    /// A header, row or cell is not what a trace holds; the message names the file and line.
    #[error("{0}")]
    Invalid(String),
}

/// Refuse with a message naming the file and line.
macro_rules! invalid {
    ($($arg:tt)*) => {
        return Err(TraceError::Invalid(format!($($arg)*)))
    };
}

/// One node of the node list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeRow {
    /// Node name (`sn`).
    pub name: String,
    /// Allocatable CPU in millicores.
    pub cpu_milli: u64,
    /// Allocatable host memory in MiB.
    pub memory_mib: u64,
    /// Number of GPUs.
    pub gpus: u32,
    /// GPU model.
    pub model: String,
}

/// One pod of the pod list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodRow {
    /// Pod name.
    pub name: String,
    /// CPU request in millicores.
    pub cpu_milli: u64,
    /// Host memory request in MiB.
    pub memory_mib: u64,
    /// Number of GPUs (0 = CPU-only).
    pub num_gpu: u32,
    /// Share of each GPU in thousandths (1000 for multi-GPU pods).
    pub gpu_milli: u32,
    /// Accepted GPU models (empty = any).
    pub gpu_spec: Vec<String>,
    /// Seconds from the trace's start to the pod's creation (`creation_time`; 0 when the
    /// file has no such column).
    pub created_s: u64,
    /// Seconds the pod lived (`deletion_time - creation_time`), when the file says.
    pub lifetime_s: Option<u64>,
}

impl PodRow {
    /// GPU compute requested in total, in thousandths of a GPU.
    pub fn gpu_request(&self) -> u64 {
        u64::from(self.num_gpu) * u64::from(self.gpu_milli)
    }
}

/// A CSV file read into a header index and its rows, each with the line it starts on.
struct Table<'a> {
    file: &'a Path,
    columns: HashMap<String, usize>,
    rows: Vec<(u64, StringRecord)>,
}

impl<'a> Table<'a> {
    fn parse(file: &'a Path, text: &str) -> Result<Self, TraceError> {
        // Flexible, so that a short or long row gets this reader's message with its line.
        let mut reader = ReaderBuilder::new()
            .has_headers(false)
            .flexible(true)
            .trim(Trim::All)
            .from_reader(text.as_bytes());
        let mut records = reader.records().filter(|r| match r {
            Ok(rec) => !is_blank(rec),
            Err(_) => true,
        });
        let header = match records.next() {
            None => invalid!("{}: empty file, expected a CSV header", file.display()),
            Some(r) => r.map_err(|error| TraceError::Csv {
                path: file.to_path_buf(),
                error,
            })?,
        };
        let columns: HashMap<String, usize> = header
            .iter()
            .enumerate()
            .map(|(i, h)| (h.trim_start_matches('\u{feff}').to_ascii_lowercase(), i))
            .collect();
        let width = header.len();
        let mut rows = Vec::new();
        for r in records {
            let rec = r.map_err(|error| TraceError::Csv {
                path: file.to_path_buf(),
                error,
            })?;
            let line = rec.position().map_or(0, Position::line);
            if rec.len() != width {
                invalid!(
                    "{}:{line}: {} fields, the header has {width}",
                    file.display(),
                    rec.len(),
                );
            }
            rows.push((line, rec));
        }
        Ok(Table {
            file,
            columns,
            rows,
        })
    }

    fn column(&self, names: &[&str]) -> Result<usize, TraceError> {
        names
            .iter()
            .find_map(|n| self.columns.get(*n).copied())
            .ok_or_else(|| {
                TraceError::Invalid(format!(
                    "{}:1: missing column {:?} in the header",
                    self.file.display(),
                    names[0]
                ))
            })
    }

    fn number<T: std::str::FromStr>(
        &self,
        line: u64,
        cells: &StringRecord,
        col: usize,
        name: &str,
    ) -> Result<T, TraceError> {
        let cell = &cells[col];
        cell.parse().map_err(|_| {
            TraceError::Invalid(format!(
                "{}:{line}: column {name}: {cell:?} is not a non-negative integer",
                self.file.display(),
            ))
        })
    }
}

/// A line with nothing on it but blanks: skipped, as a blank line is.
fn is_blank(rec: &StringRecord) -> bool {
    rec.len() == 1 && rec[0].is_empty()
}

fn read(path: &Path) -> Result<String, TraceError> {
    std::fs::read_to_string(path).map_err(|error| TraceError::Read {
        path: path.to_path_buf(),
        error,
    })
}

/// Read a node list (columns `sn`, `cpu_milli`, `memory_mib`, `gpu`, `model`, in any order).
pub fn read_nodes(path: &Path) -> Result<Vec<NodeRow>, TraceError> {
    let text = read(path)?;
    parse_nodes(path, &text)
}

/// Parse a node list already read from `path`.
pub fn parse_nodes(path: &Path, text: &str) -> Result<Vec<NodeRow>, TraceError> {
    let t = Table::parse(path, text)?;
    let (sn, cpu, mem, gpu, model) = (
        t.column(&["sn", "name", "node"])?,
        t.column(&["cpu_milli"])?,
        t.column(&["memory_mib"])?,
        t.column(&["gpu", "num_gpu"])?,
        t.column(&["model", "gpu_model"])?,
    );
    let mut out = Vec::with_capacity(t.rows.len());
    for (line, cells) in &t.rows {
        let line = *line;
        let gpus: u32 = t.number(line, cells, gpu, "gpu")?;
        if gpus > 64 {
            invalid!(
                "{}:{line}: column gpu: {gpus} GPUs on one node (at most 64)",
                path.display()
            );
        }
        if cells[sn].is_empty() {
            invalid!("{}:{line}: column sn: empty node name", path.display());
        }
        out.push(NodeRow {
            name: cells[sn].to_string(),
            cpu_milli: t.number(line, cells, cpu, "cpu_milli")?,
            memory_mib: t.number(line, cells, mem, "memory_mib")?,
            gpus,
            model: cells[model].to_string(),
        });
    }
    if out.is_empty() {
        invalid!("{}: no nodes", path.display());
    }
    Ok(out)
}

/// Read a pod list (columns `name`, `cpu_milli`, `memory_mib`, `num_gpu`, `gpu_milli`,
/// `gpu_spec`, in any order; other columns are ignored).
pub fn read_pods(path: &Path) -> Result<Vec<PodRow>, TraceError> {
    let text = read(path)?;
    parse_pods(path, &text)
}

/// Parse a pod list already read from `path`.
pub fn parse_pods(path: &Path, text: &str) -> Result<Vec<PodRow>, TraceError> {
    let t = Table::parse(path, text)?;
    let (name, cpu, mem, num, milli) = (
        t.column(&["name"])?,
        t.column(&["cpu_milli"])?,
        t.column(&["memory_mib"])?,
        t.column(&["num_gpu"])?,
        t.column(&["gpu_milli"])?,
    );
    let spec = t.columns.get("gpu_spec").copied();
    let created = t.columns.get("creation_time").copied();
    let deleted = t.columns.get("deletion_time").copied();
    let mut out = Vec::with_capacity(t.rows.len());
    for (line, cells) in &t.rows {
        let line = *line;
        let num_gpu: u32 = t.number(line, cells, num, "num_gpu")?;
        let gpu_milli: u32 = t.number(line, cells, milli, "gpu_milli")?;
        if num_gpu > 64 {
            invalid!(
                "{}:{line}: column num_gpu: {num_gpu} GPUs (at most 64)",
                path.display()
            );
        }
        let gpu_milli = match (num_gpu, gpu_milli) {
            (0, 0) => 0,
            (0, m) => invalid!(
                "{}:{line}: column gpu_milli: {m} with num_gpu 0 (a CPU-only pod has gpu_milli 0)",
                path.display()
            ),
            (1, m @ 1..=1000) => m,
            (1, m) => invalid!(
                "{}:{line}: column gpu_milli: {m} is outside 1..=1000",
                path.display()
            ),
            // Multi-GPU pods take whole GPUs.
            (_, 1000) => 1000,
            (n, m) => invalid!(
                "{}:{line}: column gpu_milli: {m} with num_gpu {n} (multi-GPU pods use whole GPUs, 1000)",
                path.display()
            ),
        };
        if cells[name].is_empty() {
            invalid!("{}:{line}: column name: empty pod name", path.display());
        }
        let gpu_spec = spec
            .map(|c| {
                cells[c]
                    .split('|')
                    .map(str::trim)
                    .filter(|s| !s.is_empty())
                    .map(String::from)
                    .collect()
            })
            .unwrap_or_default();
        let created_s: u64 = match created {
            Some(c) => t.number(line, cells, c, "creation_time")?,
            None => 0,
        };
        let lifetime_s = match deleted {
            Some(d) if !cells[d].is_empty() => {
                let end: u64 = t.number(line, cells, d, "deletion_time")?;
                if end < created_s {
                    invalid!(
                        "{}:{line}: column deletion_time: {end} is before creation_time {created_s}",
                        path.display()
                    );
                }
                Some(end - created_s)
            }
            _ => None,
        };
        out.push(PodRow {
            name: cells[name].to_string(),
            cpu_milli: t.number(line, cells, cpu, "cpu_milli")?,
            memory_mib: t.number(line, cells, mem, "memory_mib")?,
            num_gpu,
            gpu_milli,
            gpu_spec,
            created_s,
            lifetime_s,
        });
    }
    if out.is_empty() {
        invalid!("{}: no pods", path.display());
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const NODES: &str = "sn,cpu_milli,memory_mib,gpu,model\nn1,1000,2048,2,A100\n";

    #[test]
    fn quoted_fields_blank_lines_and_a_bom_read_as_csv() {
        let pods = "\u{feff}name, cpu_milli ,memory_mib,num_gpu,gpu_milli,gpu_spec\r\n\
                    \r\n\
                    \"p,1\",100,200,1,500,\"A100|V100\"\r\n   \r\n\
                    p2,100,200,0,0,\r\n";
        let rows = parse_pods(Path::new("pods.csv"), pods).expect("parses");
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[0].name, "p,1");
        assert_eq!(rows[0].gpu_spec, ["A100", "V100"]);
        assert_eq!(rows[0].gpu_request(), 500);
        assert_eq!(rows[1].gpu_spec, Vec::<String>::new());
        assert_eq!(
            parse_nodes(Path::new("n.csv"), NODES).expect("parses")[0].gpus,
            2
        );
    }

    #[test]
    fn a_short_row_is_named_by_its_line() {
        let pods = "name,cpu_milli,memory_mib,num_gpu,gpu_milli\n\np1,1,2,0,0\np2,1,2\n";
        let err = parse_pods(Path::new("pods.csv"), pods).expect_err("refused");
        assert_eq!(err.to_string(), "pods.csv:4: 3 fields, the header has 5");
    }
}
