//! Every row of the Limits table in `docs/security.md` names, in its `shown by` column, the
//! test that shows its bound biting (`` `crate/tests/file.rs` `test_name` ``), and each named
//! test exists: a row cannot lose its proof, nor name a test that was renamed or removed.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail, ensure};

/// The workspace's root (this crate's parent).
fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the bench crate lies in the workspace")
        .to_path_buf()
}

/// The cells of a Markdown table row (`| a | b |`), trimmed.
fn cells(row: &str) -> Vec<&str> {
    let inner = row.trim().trim_start_matches('|').trim_end_matches('|');
    inner.split('|').map(str::trim).collect()
}

/// The rows of the first table after the heading `heading` in `doc`: its header, then its
/// body rows (the separator left out).
fn table<'a>(doc: &'a str, heading: &str) -> Result<(Vec<&'a str>, Vec<Vec<&'a str>>)> {
    let mut lines = doc.lines().skip_while(|l| l.trim() != heading);
    ensure!(lines.next().is_some(), "no heading {heading:?}");
    let mut rows = lines
        .skip_while(|l| !l.starts_with('|'))
        .take_while(|l| l.starts_with('|'));
    let header = cells(rows.next().context("no table under the heading")?);
    let body: Vec<_> = rows.skip(1).map(cells).collect();
    ensure!(!body.is_empty(), "an empty table");
    Ok((header, body))
}

/// The tests a `shown by` cell names: pairs of `` `path` `` and `` `name` `` in order.
fn named_tests(cell: &str) -> Result<Vec<(&str, &str)>> {
    let code: Vec<&str> = cell.split('`').skip(1).step_by(2).collect();
    ensure!(
        !code.is_empty() && code.len().is_multiple_of(2),
        "not pairs of `file` `test`: {cell:?}"
    );
    Ok(code.chunks(2).map(|c| (c[0], c[1])).collect())
}

/// An error unless `file` (from the workspace root) holds a test function `name`.
fn ensure_test(file: &str, name: &str) -> Result<()> {
    ensure!(
        file.ends_with(".rs") && (file.contains("/tests/") || file.ends_with("/tests.rs")),
        "{file} is not a test file"
    );
    let text =
        std::fs::read_to_string(root().join(file)).with_context(|| format!("reading {file}"))?;
    let lines: Vec<&str> = text.lines().collect();
    let signature = format!("fn {name}(");
    let Some(at) = lines.iter().position(|l| l.contains(&signature)) else {
        bail!("{file} has no fn {name}");
    };
    // Its attribute is among the lines just above (doc comments between).
    let above = &lines[at.saturating_sub(12)..at];
    let attribute = above
        .iter()
        .rev()
        .take_while(|l| {
            let l = l.trim();
            l.starts_with("///") || l.starts_with("#[")
        })
        .any(|l| l.trim().starts_with("#[tokio::test") || l.trim() == "#[test]");
    ensure!(attribute, "fn {name} in {file} is not a test");
    Ok(())
}

#[test]
fn every_limit_names_a_test_that_exists() -> Result<()> {
    let doc = std::fs::read_to_string(root().join("docs/security.md"))?;
    let (header, rows) = table(&doc, "## Limits")?;
    let shown = header
        .iter()
        .position(|h| *h == "shown by")
        .context("no `shown by` column in the Limits table")?;
    let mut wrong = Vec::new();
    for row in &rows {
        let what = row.iter().take(3).copied().collect::<Vec<_>>().join(" | ");
        let tests = row
            .get(shown)
            .context(format!("a row without its `shown by` cell: {what}"))
            .and_then(|cell| named_tests(cell));
        match tests {
            Ok(tests) => wrong.extend(
                tests
                    .into_iter()
                    .filter_map(|(f, t)| ensure_test(f, t).err())
                    .map(|e| format!("{what}: {e:#}")),
            ),
            Err(e) => wrong.push(format!("{what}: {e:#}")),
        }
    }
    ensure!(
        wrong.is_empty(),
        "{} of {} rows of the Limits table:\n{}",
        wrong.len(),
        rows.len(),
        wrong.join("\n")
    );
    Ok(())
}

#[test]
fn a_row_without_a_test_or_naming_a_missing_one_is_caught() {
    let doc = "## Limits\n\ntext\n\n| bound | shown by |\n|---|---|\n\
               | a | `bench/tests/limits_table_names_its_tests.rs` `every_limit_names_a_test_that_exists` |\n\
               | b | – |\n| c | `bench/tests/limits_table_names_its_tests.rs` `no_such_test` |\n";
    let (header, rows) = table(doc, "## Limits").expect("the table");
    assert_eq!(header, ["bound", "shown by"]);
    assert_eq!(rows.len(), 3);
    let check = |row: &Vec<&str>| {
        named_tests(row[1]).and_then(|t| t.iter().try_for_each(|(f, n)| ensure_test(f, n)))
    };
    assert!(check(&rows[0]).is_ok(), "{:?}", check(&rows[0]));
    assert!(check(&rows[1]).is_err(), "a row naming no test");
    assert!(check(&rows[2]).is_err(), "a row naming a missing test");
    assert!(ensure_test("bench/tests/limits_table_names_its_tests.rs", "root").is_err());
}
