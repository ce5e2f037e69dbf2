//! Reading what binaries export: metric names and values in Prometheus text (parsed by
//! `prometheus-parse`), and the `gpuledger_*` names a dashboard's expressions use, so tests
//! can check one against the other. That parser splits labels at every comma, so a label
//! value holding one is misread; no gpuledger label (GPU UUIDs, node names, verbs, outcomes)
//! does.

use std::collections::BTreeSet;

use prometheus_parse::{LineInfo, SampleType, Scrape, Value};

/// Every name a scrape of `text` lets a query use: sample names (`x_total`, `x_bucket`, …) and
/// the family names of `# TYPE` lines, with the suffixes their type implies, so that a family
/// with no samples yet still counts as exported.
pub fn exported_names(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for line in text.lines() {
        match LineInfo::parse(line) {
            LineInfo::Type {
                metric_name,
                metric_alias,
                sample_type,
            } => {
                // A histogram's TYPE line comes back as `<family>_bucket` aliased to the family.
                let family = metric_alias.unwrap_or(metric_name);
                let suffixes: &[&str] = match sample_type {
                    SampleType::Counter => &["_total", "_created"],
                    SampleType::Histogram => &["_bucket", "_sum", "_count", "_created"],
                    SampleType::Summary => &["_sum", "_count", "_created"],
                    SampleType::Gauge | SampleType::Untyped => &[],
                };
                for s in suffixes {
                    out.insert(format!("{family}{s}"));
                }
                out.insert(family);
            }
            LineInfo::Sample { metric_name, .. } => {
                out.insert(metric_name.to_string());
            }
            LineInfo::Doc { .. } | LineInfo::Empty | LineInfo::Ignored => {}
        }
    }
    out
}

/// Every plain sample of a scrape (histogram and summary buckets left out), as its series
/// (`name` or `name{k="v",…}`, labels in key order) and its value.
pub fn samples(text: &str) -> Vec<(String, f64)> {
    let lines = text.lines().map(|l| Ok(l.to_string()));
    let Ok(scrape) = Scrape::parse(lines) else {
        return Vec::new();
    };
    scrape
        .samples
        .into_iter()
        .filter_map(|s| {
            let v = match s.value {
                Value::Counter(v) | Value::Gauge(v) | Value::Untyped(v) => v,
                Value::Histogram(_) | Value::Summary(_) => return None,
            };
            let series = if s.labels.is_empty() {
                s.metric
            } else {
                format!("{}{{{}}}", s.metric, s.labels)
            };
            Some((series, v))
        })
        .collect()
}

/// The value of one series (`name` or `name{k="v",…}` with its labels in key order).
pub fn value(text: &str, series: &str) -> Option<f64> {
    samples(text)
        .into_iter()
        .find_map(|(s, v)| (s == series).then_some(v))
}

/// The sum of every series of the sample name `name`, whatever their labels.
pub fn total(text: &str, name: &str) -> f64 {
    samples(text)
        .into_iter()
        .filter(|(s, _)| s.split('{').next() == Some(name))
        .map(|(_, v)| v)
        .sum()
}

/// The `gpuledger_*` metric names an expression mentions.
pub fn names_in_expr(expr: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let b = expr.as_bytes();
    let mut i = 0;
    while let Some(off) = expr[i..].find("gpuledger_") {
        let start = i + off;
        let boundary =
            start == 0 || !(b[start - 1].is_ascii_alphanumeric() || b[start - 1] == b'_');
        let mut end = start;
        while end < b.len() && (b[end].is_ascii_alphanumeric() || b[end] == b'_') {
            end += 1;
        }
        if boundary {
            out.insert(expr[start..end].to_string());
        }
        i = end;
    }
    out
}

/// Every `expr` in a Grafana dashboard JSON (panels, nested rows included).
pub fn dashboard_exprs(dashboard: &serde_json::Value) -> Vec<String> {
    fn walk(v: &serde_json::Value, out: &mut Vec<String>) {
        match v {
            serde_json::Value::Object(m) => {
                for (k, x) in m {
                    match (k.as_str(), x) {
                        ("expr", serde_json::Value::String(s)) => out.push(s.clone()),
                        _ => walk(x, out),
                    }
                }
            }
            serde_json::Value::Array(a) => a.iter().for_each(|x| walk(x, out)),
            _ => {}
        }
    }
    let mut out = Vec::new();
    walk(dashboard, &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_come_from_samples_and_type_lines() {
        let text = "# HELP a_seconds x\n# TYPE a_seconds histogram\n# TYPE b counter\nb_total{x=\"1\"} 3\nc 1\n# EOF\n";
        let n = exported_names(text);
        for want in ["a_seconds_bucket", "a_seconds_count", "b_total", "c"] {
            assert!(n.contains(want), "{want} in {n:?}");
        }
        assert!(!n.contains("a_seconds_total"));
    }

    #[test]
    fn values_by_series_and_totals_by_name() {
        let text = "# TYPE v counter\nv_total{action=\"kill\",gpu=\"g0\"} 2\nv_total{action=\"report\",gpu=\"g1\"} 3\n\
                    # TYPE m gauge\nm{gpu=\"GPU-a b\"} 1048576\nseq 7\n\
                    # TYPE h histogram\nh_bucket{le=\"1\"} 4\nh_sum 2.5\nh_count 4\n# EOF\n";
        assert_eq!(value(text, "seq"), Some(7.0));
        assert_eq!(value(text, "m{gpu=\"GPU-a b\"}"), Some(1_048_576.0));
        assert_eq!(
            value(text, "v_total{action=\"kill\",gpu=\"g0\"}"),
            Some(2.0)
        );
        assert_eq!(value(text, "v_total"), None);
        assert_eq!(value(text, "h_count"), Some(4.0));
        assert_eq!(total(text, "v_total"), 5.0);
        assert_eq!(total(text, "nothing"), 0.0);
    }

    #[test]
    fn expressions_name_their_metrics() {
        let e = "histogram_quantile(0.99, sum by (le) (rate(gpuledger_x_seconds_bucket[5m]))) / max(gpuledger_y)";
        let n: Vec<String> = names_in_expr(e).into_iter().collect();
        assert_eq!(n, ["gpuledger_x_seconds_bucket", "gpuledger_y"]);
        assert!(names_in_expr("not_gpuledger_z").is_empty());
    }
}
