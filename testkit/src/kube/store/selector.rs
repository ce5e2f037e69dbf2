//! Field and label selectors (`spec.nodeName=n1,app!=x`), as lists and watches take them.

use serde_json::Value;

/// One term of a field or label selector.
#[derive(Debug, Clone)]
enum Term {
    Eq(String, String),
    Ne(String, String),
    Exists(String),
    NotExists(String),
}

fn parse_selector(s: &str) -> Vec<Term> {
    s.split(',')
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .map(|t| {
            if let Some((k, v)) = t.split_once("!=") {
                Term::Ne(k.trim().into(), v.trim().into())
            } else if let Some((k, v)) = t.split_once("==") {
                Term::Eq(k.trim().into(), v.trim().into())
            } else if let Some((k, v)) = t.split_once('=') {
                Term::Eq(k.trim().into(), v.trim().into())
            } else if let Some(k) = t.strip_prefix('!') {
                Term::NotExists(k.trim().into())
            } else {
                Term::Exists(t.into())
            }
        })
        .collect()
}

fn field_value(obj: &Value, path: &str) -> String {
    let ptr = format!("/{}", path.replace('.', "/"));
    match obj.pointer(&ptr) {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Null) | None => String::new(),
        Some(v) => v.to_string(),
    }
}

fn label_value(obj: &Value, k: &str) -> Option<String> {
    obj.get("metadata")?
        .get("labels")?
        .get(k)?
        .as_str()
        .map(String::from)
}

/// A list's or a watch's `fieldSelector` and `labelSelector`.
#[derive(Debug, Clone, Default)]
pub struct Filter {
    fields: Vec<Term>,
    labels: Vec<Term>,
}

impl Filter {
    /// The filter of a `fieldSelector` and a `labelSelector` (either may be empty).
    pub fn parse(fields: &str, labels: &str) -> Filter {
        Filter {
            fields: parse_selector(fields),
            labels: parse_selector(labels),
        }
    }

    /// Whether `obj` passes both selectors. Only equality terms of a field selector count;
    /// a field that is absent equals "".
    pub fn matches(&self, obj: &Value) -> bool {
        self.fields.iter().all(|t| match t {
            Term::Eq(k, v) => field_value(obj, k) == *v,
            Term::Ne(k, v) => field_value(obj, k) != *v,
            Term::Exists(_) | Term::NotExists(_) => true,
        }) && self.labels.iter().all(|t| match t {
            Term::Eq(k, v) => label_value(obj, k).as_deref() == Some(v),
            Term::Ne(k, v) => label_value(obj, k).as_deref() != Some(v),
            Term::Exists(k) => label_value(obj, k).is_some(),
            Term::NotExists(k) => label_value(obj, k).is_none(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn selectors_and_paths() {
        let pod = json!({"metadata": {"name": "p", "labels": {"app": "x"}}, "spec": {"schedulerName": "s"}});
        let f = Filter::parse("spec.schedulerName=s,spec.nodeName=", "app=x");
        assert!(f.matches(&pod));
        let g = Filter::parse("spec.nodeName!=", "");
        assert!(!g.matches(&pod));
        assert!(!Filter::parse("", "app=y").matches(&pod));
        assert!(Filter::parse("", "!team,app").matches(&pod));
    }
}
