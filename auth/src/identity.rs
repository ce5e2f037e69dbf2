//! Who a verified caller is: its role, and for a node agent the node it runs on.

use std::fmt;

/// The trust domain of gpuledger's SPIFFE IDs (`spiffe://gpuledger/<role>[/<name>]`).
pub const TRUST_DOMAIN: &str = "gpuledger";

/// What a caller may do is decided by its role (and, for a node agent, its node).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Role {
    /// Another allocator replica (forwards writes to the leader, reads the log).
    Allocator,
    /// The kube-scheduler extender and admission webhook.
    Extender,
    /// The node agent of one node: may touch that node's part of the ledger only.
    NodeAgent {
        /// The node it runs on, as verified (its pod's `spec.nodeName`, or its certificate).
        node: String,
    },
    /// An operator who may read (status, inspect, audit, usage, verify).
    Viewer,
    /// An operator who may also write (remove a node, release an allocation).
    Admin,
}

impl Role {
    /// The role's name as it appears in SPIFFE IDs, rules and metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            Role::Allocator => "allocator",
            Role::Extender => "extender",
            Role::NodeAgent { .. } => "node-agent",
            Role::Viewer => "viewer",
            Role::Admin => "admin",
        }
    }
}

/// A caller whose identity was verified (by a token review or a client certificate).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Caller {
    /// What it may do.
    pub role: Role,
    /// Who it is, for logs and the audit trail: the Kubernetes user name
    /// (`system:serviceaccount:<ns>:<name>`) or the certificate's SPIFFE ID.
    pub subject: String,
}

impl Caller {
    /// The node of a node agent (None for every other role).
    pub fn node(&self) -> Option<&str> {
        match &self.role {
            Role::NodeAgent { node } => Some(node),
            _ => None,
        }
    }
}

impl fmt::Display for Caller {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.role {
            Role::NodeAgent { node } => write!(f, "node-agent of {node} ({})", self.subject),
            r => write!(f, "{} ({})", r.kind(), self.subject),
        }
    }
}

/// Whom a per-caller limit (requests in flight, streams, heavy reads) counts a request
/// against: a verified caller and which of its holders sent it. Many callers can share one
/// identity (every operator's token is the viewer ServiceAccount's, the extender's replicas
/// share theirs), and none of them may use up the others' share: the holder is the pod of a
/// pod-bound token, else the token, or the client certificate.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Holder {
    /// The verified identity.
    pub caller: Caller,
    /// Which of its holders: `pod:<uid>`, `token:<digest>` or `cert:<digest>`.
    pub instance: String,
}

impl fmt::Display for Holder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} [{}]", self.caller, self.instance)
    }
}

/// The first bytes of `digest` in hex: enough to tell a caller's holders apart, never the
/// credential.
pub fn short_digest(prefix: &str, digest: &[u8]) -> String {
    use std::fmt::Write;
    let mut s = String::from(prefix);
    for b in digest.iter().take(8) {
        let _ = write!(s, "{b:02x}");
    }
    s
}

/// Why an identity could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdentityError {
    /// The SPIFFE ID is not one of gpuledger's.
    #[error(
        "not a gpuledger identity: {0:?} (expected spiffe://gpuledger/<allocator|extender|node-agent/<node>|viewer/<name>|admin/<name>>)"
    )]
    Unknown(String),
    /// A node or operator name that is not a valid Kubernetes object name.
    #[error(
        "invalid name {0:?} in identity (a Kubernetes object name: lower-case alphanumerics, '-' and '.', at most 253 characters)"
    )]
    BadName(String),
}

/// Whether `s` is a valid Kubernetes object name (DNS-1123 subdomain), as node names are.
pub fn is_object_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && label
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                && !label.starts_with('-')
                && !label.ends_with('-')
        })
}

/// The SPIFFE ID that a client certificate of `role` carries as its URI SAN; `name` names an
/// operator (ignored for the other roles).
pub fn spiffe_id(role: &Role, name: &str) -> String {
    match role {
        Role::Allocator | Role::Extender => format!("spiffe://{TRUST_DOMAIN}/{}", role.kind()),
        Role::NodeAgent { node } => format!("spiffe://{TRUST_DOMAIN}/node-agent/{node}"),
        Role::Viewer | Role::Admin => format!("spiffe://{TRUST_DOMAIN}/{}/{name}", role.kind()),
    }
}

/// The caller a SPIFFE ID names.
pub fn from_spiffe_id(id: &str) -> Result<Caller, IdentityError> {
    let unknown = || IdentityError::Unknown(id.to_string());
    let path = id
        .strip_prefix("spiffe://")
        .and_then(|rest| rest.strip_prefix(TRUST_DOMAIN))
        .and_then(|rest| rest.strip_prefix('/'))
        .ok_or_else(unknown)?;
    let mut parts = path.split('/');
    let (kind, name) = (parts.next().unwrap_or(""), parts.next());
    if parts.next().is_some() {
        return Err(unknown());
    }
    let named = |name: Option<&str>| match name {
        Some(n) if is_object_name(n) => Ok(n.to_string()),
        Some(n) => Err(IdentityError::BadName(n.to_string())),
        None => Err(unknown()),
    };
    let role = match (kind, name) {
        ("allocator", None) => Role::Allocator,
        ("extender", None) => Role::Extender,
        ("node-agent", n) => Role::NodeAgent { node: named(n)? },
        ("viewer", n) => {
            named(n)?;
            Role::Viewer
        }
        ("admin", n) => {
            named(n)?;
            Role::Admin
        }
        _ => return Err(unknown()),
    };
    Ok(Caller {
        role,
        subject: id.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spiffe_ids_round_trip_for_every_role() {
        for role in [
            Role::Allocator,
            Role::Extender,
            Role::NodeAgent {
                node: "gpu-node-3.zone-a".into(),
            },
            Role::Viewer,
            Role::Admin,
        ] {
            let id = spiffe_id(&role, "alice");
            let c = from_spiffe_id(&id).expect(&id);
            assert_eq!(c.role, role);
            assert_eq!(c.subject, id);
        }
    }

    #[test]
    fn foreign_or_malformed_ids_are_refused() {
        for id in [
            "spiffe://other/extender",
            "spiffe://gpuledger/extender/extra",
            "spiffe://gpuledger/node-agent",
            "spiffe://gpuledger/node-agent/",
            "spiffe://gpuledger/node-agent/Upper",
            "spiffe://gpuledger/node-agent/a/b",
            "spiffe://gpuledger/root",
            "spiffe://gpuledgerx/extender",
            "https://gpuledger/extender",
            "",
        ] {
            assert!(from_spiffe_id(id).is_err(), "{id} must be refused");
        }
    }

    #[test]
    fn object_names_follow_dns_1123() {
        assert!(is_object_name("gpu-node-0"));
        assert!(is_object_name("a.b-c.d"));
        assert!(!is_object_name("-a"));
        assert!(!is_object_name("a..b"));
        assert!(!is_object_name(&"a".repeat(254)));
        assert!(!is_object_name("a_b"));
    }
}
