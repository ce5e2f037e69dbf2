//! Text kube-scheduler shows users. It hands extender text to Go's `fmt` as a format string
//! (`fmt.Errorf(result.Error)`, then `Eventf(pod, …, err.Error())`), so a `%` comes out as
//! `%!c(MISSING)` in Events and logs. Every text of an answer to the scheduler is serialized
//! through here, and none keeps a `%`.

use std::borrow::Cow;
use std::collections::BTreeMap;

use serde::Serializer;
use serde::ser::SerializeMap;

/// `s` with every `%` written as a word: "30% compute" → "30 percent compute".
pub fn without_percent(s: &str) -> Cow<'_, str> {
    if !s.contains('%') {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 16);
    let mut prev = ' ';
    for c in s.chars() {
        if c == '%' {
            out.push_str(if prev.is_whitespace() {
                "percent"
            } else {
                " percent"
            });
        } else {
            out.push(c);
        }
        prev = c;
    }
    Cow::Owned(out)
}

/// `serialize_with` for a text field.
pub fn text<S: Serializer>(s: &str, ser: S) -> Result<S::Ok, S::Error> {
    ser.serialize_str(&without_percent(s))
}

/// `serialize_with` for a node → reason map.
pub fn reasons<S: Serializer>(m: &BTreeMap<String, String>, ser: S) -> Result<S::Ok, S::Error> {
    let mut map = ser.serialize_map(Some(m.len()))?;
    for (node, why) in m {
        map.serialize_entry(node, &without_percent(why))?;
    }
    map.end()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_percent_sign_survives() {
        assert_eq!(
            without_percent("needs 30% compute free; most free: 0 MiB, 0%."),
            "needs 30 percent compute free; most free: 0 MiB, 0 percent."
        );
        assert_eq!(without_percent("a % b"), "a percent b");
        assert!(matches!(
            without_percent("no sign"),
            Cow::Borrowed("no sign")
        ));
        let m = BTreeMap::from([("n1".to_string(), "25% free".to_string())]);
        let mut out = Vec::new();
        reasons(&m, &mut serde_json::Serializer::new(&mut out)).expect("serializes");
        assert_eq!(String::from_utf8_lossy(&out), r#"{"n1":"25 percent free"}"#);
    }
}
