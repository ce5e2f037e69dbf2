//! Reading what binaries export: metric names in Prometheus text, and the `gpuledger_*` names a
//! dashboard's expressions use, so tests can check one against the other.

use std::collections::BTreeSet;

/// Every name a scrape of `text` lets a query use: sample names (`x_total`, `x_bucket`, …) and
/// the family names of `# TYPE` lines, with the suffixes their type implies, so that a family
/// with no samples yet still counts as exported.
pub fn exported_names(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut it = rest.split_whitespace();
            let (Some(name), Some(kind)) = (it.next(), it.next()) else {
                continue;
            };
            out.insert(name.to_string());
            let suffixes: &[&str] = match kind {
                "counter" => &["_total", "_created"],
                "histogram" => &["_bucket", "_sum", "_count", "_created"],
                "summary" => &["_sum", "_count", "_created"],
                "info" => &["_info"],
                _ => &[],
            };
            for s in suffixes {
                out.insert(format!("{name}{s}"));
            }
        } else if !line.starts_with('#') && !line.is_empty() {
            let end = line.find(['{', ' ']).unwrap_or(line.len());
            out.insert(line[..end].to_string());
        }
    }
    out
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
    fn expressions_name_their_metrics() {
        let e = "histogram_quantile(0.99, sum by (le) (rate(gpuledger_x_seconds_bucket[5m]))) / max(gpuledger_y)";
        let n: Vec<String> = names_in_expr(e).into_iter().collect();
        assert_eq!(n, ["gpuledger_x_seconds_bucket", "gpuledger_y"]);
        assert!(names_in_expr("not_gpuledger_z").is_empty());
    }
}
