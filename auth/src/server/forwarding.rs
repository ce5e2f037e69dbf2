//! How a follower forwards a write for its caller: the headers that name the caller, or carry
//! its token, so that the leader judges the write as the caller's.

use base64::Engine;
use http::HeaderValue;

use crate::identity::{Caller, Holder, Role};

/// The header through which a follower tells the leader whom it forwards a write for, when
/// that caller authenticated with a client certificate. Honoured only from an allocator that
/// itself authenticated with a client certificate (it holds the allocator's key); anyone
/// else's is dropped and counted.
pub const ON_BEHALF_OF: &str = "x-gpuledger-on-behalf-of";

/// The header through which a follower hands the leader the `authorization` value of the
/// caller it forwards a write for (a ServiceAccount token): the leader reviews the token
/// itself, so a forwarder can vouch only for a caller whose credential it holds.
pub const FORWARDED_AUTHORIZATION: &str = "x-gpuledger-forwarded-authorization";

/// The value of [`ON_BEHALF_OF`] that names `caller`.
pub fn on_behalf_of(caller: &Caller) -> HeaderValue {
    on_behalf_of_holder(&Holder {
        caller: caller.clone(),
        instance: String::new(),
    })
}

/// The value of [`ON_BEHALF_OF`] that names `holder` (the leader counts the forwarded call
/// against the same holder as the caller's own calls).
pub fn on_behalf_of_holder(holder: &Holder) -> HeaderValue {
    let caller = &holder.caller;
    let json = serde_json::json!({
        "role": caller.role.kind(),
        "node": caller.node(),
        "subject": caller.subject,
        "instance": holder.instance,
    });
    let v = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(json.to_string());
    HeaderValue::from_str(&v).expect("base64 is a valid header value")
}

/// The holder an [`ON_BEHALF_OF`] value names (one that names none: `claim`).
pub(super) fn decode_on_behalf_of(v: &HeaderValue) -> Option<Holder> {
    let raw = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(v.as_bytes())
        .ok()?;
    let j: serde_json::Value = serde_json::from_slice(&raw).ok()?;
    let subject = j.get("subject")?.as_str()?.to_string();
    let role = match j.get("role")?.as_str()? {
        "allocator" => Role::Allocator,
        "extender" => Role::Extender,
        "viewer" => Role::Viewer,
        "admin" => Role::Admin,
        "node-agent" => Role::NodeAgent {
            node: j.get("node")?.as_str()?.to_string(),
        },
        _ => return None,
    };
    let instance = j
        .get("instance")
        .and_then(|i| i.as_str())
        .filter(|i| !i.is_empty() && i.len() <= 128)
        .unwrap_or("claim")
        .to_string();
    Some(Holder {
        caller: Caller { role, subject },
        instance,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forwarding_headers_round_trip() {
        for role in [
            Role::Extender,
            Role::NodeAgent { node: "n-1".into() },
            Role::Admin,
        ] {
            let c = Caller {
                role,
                subject: "system:serviceaccount:gpuledger:x".into(),
            };
            let h = Holder {
                caller: c.clone(),
                instance: "cert:0a1b".into(),
            };
            assert_eq!(decode_on_behalf_of(&on_behalf_of_holder(&h)), Some(h));
            assert_eq!(
                decode_on_behalf_of(&on_behalf_of(&c)).map(|h| (h.caller, h.instance)),
                Some((c, "claim".into()))
            );
        }
        assert_eq!(decode_on_behalf_of(&HeaderValue::from_static("e30")), None);
        assert_eq!(decode_on_behalf_of(&HeaderValue::from_static("%%")), None);
    }
}
