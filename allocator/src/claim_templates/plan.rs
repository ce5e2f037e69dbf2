//! What the template maker decides: which template a pod needs made, and which templates no
//! pod claims any more. Pure: the shell reads the pods and templates and writes the outcome.

use std::collections::HashSet;
use std::time::Duration;

use gpuledger_request::dra::{self, MANAGED_LABEL, POD_CLAIM};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaimTemplate;
use k8s_openapi::jiff::Timestamp;

/// A stored template to delete: that very object (its UID), not a later one of its name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stored {
    /// Its namespace.
    pub namespace: String,
    /// Its name.
    pub name: String,
    /// Its UID, the delete's precondition.
    pub uid: String,
}

/// The gpuledger template pod `p` claims, by namespace and name.
fn claim_of(p: &Pod) -> Option<(String, String)> {
    let name = dra::claimed_template(p)?;
    Some((p.metadata.namespace.clone().unwrap_or_default(), name))
}

/// The template pod `p` still needs made, in its namespace: None when it claims no gpuledger
/// template, is finished or being deleted, or its claim exists already (the template is read
/// only when the claim is made); otherwise the template its requests make, or why none can be.
pub fn wanted(
    p: &Pod,
    cores: dra::CoresUnit,
) -> Option<(String, Result<ResourceClaimTemplate, String>)> {
    if p.metadata.deletion_timestamp.is_some() {
        return None;
    }
    let status = p.status.as_ref();
    if status
        .and_then(|s| s.phase.as_deref())
        .is_some_and(|ph| ph == "Succeeded" || ph == "Failed")
    {
        return None;
    }
    let made = status
        .and_then(|s| s.resource_claim_statuses.as_ref())
        .is_some_and(|cs| {
            cs.iter()
                .any(|c| c.name == POD_CLAIM && c.resource_claim_name.is_some())
        });
    if made {
        return None;
    }
    let ns = p.metadata.namespace.clone().unwrap_or_default();
    let t = dra::template_of_pod(&ns, p, cores)?;
    Some((ns, t))
}

/// Every gpuledger template some pod claims, by namespace and name.
pub fn claimed<'a>(pods: impl Iterator<Item = &'a Pod>) -> HashSet<(String, String)> {
    pods.filter_map(claim_of).collect()
}

/// The managed templates in `listed` that no pod claims and that are older than `after` at
/// `now` (a template just made waits for the pod it was made for to be seen).
pub fn collectable(
    listed: &[ResourceClaimTemplate],
    claimed: &HashSet<(String, String)>,
    now: Timestamp,
    after: Duration,
) -> Vec<Stored> {
    let after = i64::try_from(after.as_millis()).unwrap_or(i64::MAX);
    listed
        .iter()
        .filter_map(|t| {
            let m = &t.metadata;
            let managed = m
                .labels
                .as_ref()
                .and_then(|l| l.get(MANAGED_LABEL))
                .is_some_and(|v| v == "true");
            let (ns, name, uid) = (m.namespace.clone()?, m.name.clone()?, m.uid.clone()?);
            let born = m.creation_timestamp.as_ref()?.0.as_millisecond();
            let old = now.as_millisecond().saturating_sub(born) >= after;
            (managed
                && old
                && m.deletion_timestamp.is_none()
                && !claimed.contains(&(ns.clone(), name.clone())))
            .then_some(Stored {
                namespace: ns,
                name,
                uid,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuledger_request::dra::{
        ClaimRequest, CoresUnit, REQUESTS_ANNOTATION, encode_requests, template,
    };
    use k8s_openapi::api::core::v1::{
        PodResourceClaim, PodResourceClaimStatus, PodSpec, PodStatus,
    };
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    fn reqs(mib: u64) -> Vec<ClaimRequest> {
        vec![ClaimRequest {
            container: 0,
            name: "c0".into(),
            count: 1,
            mem_mib: Some(mib),
            core_milli: 200,
        }]
    }

    /// A pod as the webhook converts it: claims the template `reqs` make, records `annotated`.
    fn converted(reqs: &[ClaimRequest], annotated: &[ClaimRequest]) -> Pod {
        let mut p = Pod::default();
        p.metadata.namespace = Some("team".into());
        p.metadata.name = Some("p".into());
        p.metadata.uid = Some("u".into());
        p.metadata.annotations =
            Some([(REQUESTS_ANNOTATION.to_string(), encode_requests(annotated))].into());
        p.spec = Some(PodSpec {
            resource_claims: Some(vec![PodResourceClaim {
                name: POD_CLAIM.into(),
                resource_claim_template_name: template("team", reqs, CoresUnit::Thousandths)
                    .metadata
                    .name,
                ..Default::default()
            }]),
            ..Default::default()
        });
        p
    }

    #[test]
    fn a_converted_pod_gets_the_template_it_claims() {
        let p = converted(&reqs(3000), &reqs(3000));
        let (ns, t) = wanted(&p, CoresUnit::Thousandths).unwrap();
        assert_eq!(ns, "team");
        assert_eq!(
            t.unwrap(),
            template("team", &reqs(3000), CoresUnit::Thousandths)
        );
    }

    #[test]
    fn a_pod_whose_requests_make_another_template_gets_none() {
        // Names the 3000 MiB template, records a 16 GiB request: no template for either.
        let p = converted(&reqs(3000), &reqs(16_384));
        let why = wanted(&p, CoresUnit::Thousandths).unwrap().1.unwrap_err();
        assert!(why.contains("makes gpuledger-"), "{why}");
        // A forged annotation is refused before any name is computed.
        let mut p = converted(&reqs(3000), &reqs(3000));
        p.metadata.annotations =
            Some([(REQUESTS_ANNOTATION.into(), "[{\"container\":0}]".into())].into());
        assert!(wanted(&p, CoresUnit::Thousandths).unwrap().1.is_err());
    }

    #[test]
    fn pods_that_need_nothing_made() {
        let mut p = converted(&reqs(3000), &reqs(3000));
        p.status = Some(PodStatus {
            resource_claim_statuses: Some(vec![PodResourceClaimStatus {
                name: POD_CLAIM.into(),
                resource_claim_name: Some("p-gpuledger-x".into()),
            }]),
            ..Default::default()
        });
        assert!(
            wanted(&p, CoresUnit::Thousandths).is_none(),
            "its claim exists"
        );
        let mut p = converted(&reqs(3000), &reqs(3000));
        p.status = Some(PodStatus {
            phase: Some("Succeeded".into()),
            ..Default::default()
        });
        assert!(wanted(&p, CoresUnit::Thousandths).is_none(), "finished");
        let mut p = converted(&reqs(3000), &reqs(3000));
        p.spec.as_mut().unwrap().resource_claims.as_mut().unwrap()[0]
            .resource_claim_template_name = Some("theirs".into());
        assert!(
            wanted(&p, CoresUnit::Thousandths).is_none(),
            "not a gpuledger template"
        );
        assert!(wanted(&Pod::default(), CoresUnit::Thousandths).is_none());
    }

    fn stored(ns: &str, name: &str, born_ms: i64, managed: bool) -> ResourceClaimTemplate {
        let mut t = ResourceClaimTemplate::default();
        t.metadata.namespace = Some(ns.into());
        t.metadata.name = Some(name.into());
        t.metadata.uid = Some(format!("uid-{name}"));
        t.metadata.creation_timestamp = Some(Time(Timestamp::from_millisecond(born_ms).unwrap()));
        if managed {
            t.metadata.labels = Some([(MANAGED_LABEL.to_string(), "true".to_string())].into());
        }
        t
    }

    #[test]
    fn only_old_unclaimed_managed_templates_are_collected() {
        let now = Timestamp::from_millisecond(1_000_000).unwrap();
        let after = Duration::from_secs(600);
        let old = 1_000_000 - 600_000;
        let listed = vec![
            stored("team", "gpuledger-claimed", old, true),
            stored("team", "gpuledger-young", old + 1, true),
            stored("team", "gpuledger-unmanaged", old, false),
            stored("team", "gpuledger-stale", old, true),
            stored("other", "gpuledger-claimed", old, true),
        ];
        let p = converted(&reqs(3000), &reqs(3000));
        let mut claimed = claimed(std::iter::once(&p));
        assert_eq!(claimed.len(), 1);
        claimed.insert(("team".into(), "gpuledger-claimed".into()));
        let out = collectable(&listed, &claimed, now, after);
        let names: Vec<_> = out
            .iter()
            .map(|s| (s.namespace.as_str(), s.name.as_str()))
            .collect();
        assert_eq!(
            names,
            [("team", "gpuledger-stale"), ("other", "gpuledger-claimed")]
        );
        assert_eq!(out[0].uid, "uid-gpuledger-stale");
    }
}
