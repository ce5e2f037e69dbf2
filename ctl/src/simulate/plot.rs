//! A small SVG line chart: GPU allocation ratio vs arrived workload, one line per policy.

use std::fmt::Write as _;
use std::path::Path;

use super::PolicyReport;
use super::engine::at;

const COLORS: [&str; 9] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
    "#17becf",
];

/// Write the chart (mean over seeds, sampled every 1 % of arrived workload).
pub fn write(path: &Path, reports: &[PolicyReport]) -> std::io::Result<()> {
    std::fs::write(path, svg(reports))
}

fn svg(reports: &[PolicyReport]) -> String {
    let (w, h, left, right, top, bottom) = (760.0, 480.0, 60.0, 170.0, 30.0, 50.0);
    let (pw, ph) = (w - left - right, h - top - bottom);
    let x_max = reports
        .iter()
        .flat_map(|r| &r.runs)
        .filter_map(|r| r.curve.last().map(|c| c.0))
        .fold(1.0f64, f64::max)
        .min(2.0);
    let sx = |x: f64| left + x / x_max * pw;
    let sy = |y: f64| top + (1.0 - y) * ph;
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="{}" y="18" text-anchor="middle">GPU allocation ratio vs arrived workload (mean over seeds)</text>"#,
        left + pw / 2.0
    );
    for i in 0..=10 {
        let y = f64::from(i) / 10.0;
        let _ = writeln!(
            s,
            r##"<line x1="{left}" x2="{x2}" y1="{y}" y2="{y}" stroke="#ddd"/><text x="{tx}" y="{ty}" text-anchor="end">{pct}%</text>"##,
            x2 = left + pw,
            y = sy(y),
            tx = left - 6.0,
            ty = sy(y) + 4.0,
            pct = i * 10
        );
    }
    let mut x = 0.0;
    while x <= x_max + 1e-9 {
        let _ = writeln!(
            s,
            r##"<line x1="{0}" x2="{0}" y1="{top}" y2="{1}" stroke="#eee"/><text x="{0}" y="{2}" text-anchor="middle">{3:.0}%</text>"##,
            sx(x),
            top + ph,
            top + ph + 16.0,
            x * 100.0
        );
        x += 0.1;
    }
    let _ = writeln!(
        s,
        r#"<text x="{}" y="{}" text-anchor="middle">arrived workload (% of cluster GPU capacity)</text>"#,
        left + pw / 2.0,
        h - 10.0
    );
    let _ = writeln!(
        s,
        r##"<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#333"/>"##
    );
    for (k, r) in reports.iter().enumerate() {
        let color = COLORS[k % COLORS.len()];
        let end = r
            .runs
            .iter()
            .filter_map(|x| x.curve.last().map(|c| c.0))
            .fold(f64::INFINITY, f64::min);
        let mut pts = String::new();
        let mut a = 0.0;
        while a <= end.min(x_max) + 1e-9 {
            let y = r.runs.iter().map(|x| at(&x.curve, a)).sum::<f64>() / r.runs.len() as f64;
            let _ = write!(pts, "{:.1},{:.1} ", sx(a), sy(y));
            a += 0.01;
        }
        let _ = writeln!(
            s,
            r#"<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{pts}"/>"#
        );
        let ly = top + 10.0 + 18.0 * k as f64;
        let _ = writeln!(
            s,
            r#"<line x1="{0}" x2="{1}" y1="{ly}" y2="{ly}" stroke="{color}" stroke-width="3"/><text x="{2}" y="{3}">{4} ({5:.2}% unalloc.)</text>"#,
            left + pw + 10.0,
            left + pw + 30.0,
            left + pw + 35.0,
            ly + 4.0,
            r.policy,
            r.unallocated_pct_at_100()
        );
    }
    s.push_str("</svg>\n");
    s
}
