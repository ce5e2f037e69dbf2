use gpuledger_ledger::{Command, pb};
use k8s_openapi::serde_json::{Value, json};

use super::*;
use crate::claim_watch::plan::{DRIVER, Step as PlanStep};

/// Node `n1` in DRA mode with one 16000 MiB GPU (`GPU-n1-0`).
fn ledger() -> Ledger {
    let mut l = Ledger::new();
    let mut inv = gpuledger_testkit::workload::inventory("n1", 1, 16_000, "A100");
    inv.mode = pb::NodeMode::Dra as i32;
    l.execute(Command::RegisterNode(inv), 1, 0)
        .expect("register");
    l
}

/// Claim `uid` asking 4000 MiB and 300 cores, allocated on n1's GPU when `allocated`.
fn claim(uid: &str, allocated: bool) -> Box<Claim> {
    let results: Vec<Value> = if allocated {
        vec![
            json!({"request": "c0", "driver": DRIVER, "pool": "n1", "device": "gpu-n1-0",
                    "shareID": "s-1", "consumedCapacity": {"memory": "4000Mi", "cores": "300"}}),
        ]
    } else {
        Vec::new()
    };
    let c = Claim::from_json(&json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": "c", "namespace": "ns", "uid": uid, "resourceVersion": "7",
                     "generation": 1},
        "spec": {"devices": {"requests": [{"name": "c0", "exactly": {
            "deviceClassName": DRIVER,
            "capacity": {"requests": {"memory": "4000Mi", "cores": "300"}}}}]}},
        "status": {"allocation": {"devices": {"results": results}},
                   "reservedFor": [{"resource": "pods", "name": "p", "uid": "pod-1"}]}
    }))
    .expect("claim");
    Box::new(c)
}

/// [`ledger`] with claim `u1`'s result granted.
fn granted() -> Ledger {
    let mut l = ledger();
    let PlanStep::Grant { grant } = plan::plan_claim(&l, &claim("u1", true)).steps[0].1.clone()
    else {
        panic!("no grant");
    };
    l.execute(Command::GrantClaim(grant), 2, 0).expect("grant");
    l
}

fn start(uid: &str) -> Certification {
    let (m, first) = Certification::start(uid, format!("ResourceClaim ns/c ({uid})"));
    assert!(matches!(first, Step::Read { fresh: false }), "{first:?}");
    m
}

#[test]
fn a_cached_claim_with_a_result_to_grant_is_carried_and_settles_once_written() {
    let l = ledger();
    let mut m = start("u1");
    let step = m.read(Read::Claim(Ok(claim("u1", true))), false, &l);
    let Step::Carry(c, p) = step else {
        panic!("not carried: {step:?}");
    };
    assert_eq!(c.claim.uid, "u1");
    assert!(
        matches!(p.steps[..], [(_, PlanStep::Grant { .. })]),
        "{p:?}"
    );
    assert!(matches!(
        m.written(Written::Done),
        Step::Done(Outcome::Settled)
    ));
    // A claim that needs nothing settles without a write.
    let mut m = start("u2");
    assert!(matches!(
        m.read(Read::Claim(Ok(claim("u2", false))), false, &l),
        Step::Done(Outcome::Settled)
    ));
}

#[test]
fn a_claim_that_keeps_changing_is_read_afresh_then_left_after_every_attempt() {
    let l = ledger();
    let mut m = start("u1");
    let mut reads = 0;
    let mut step = Step::Read { fresh: false };
    loop {
        step = match step {
            Step::Read { fresh } => {
                reads += 1;
                assert_eq!(fresh, reads > 1, "read {reads}");
                m.read(Read::Claim(Ok(claim("u1", true))), fresh, &l)
            }
            Step::Carry(..) => m.written(Written::Conflict),
            other => {
                break assert!(
                    matches!(other, Step::Done(Outcome::KeptChanging)),
                    "{other:?}"
                );
            }
        };
    }
    assert_eq!(reads, ATTEMPTS);
}

#[test]
fn a_claim_replaced_or_gone_releases_the_grants_of_the_deleted_one() {
    let l = granted();
    // The cache shows another claim of that name: only the API server's word releases.
    let mut m = start("u1");
    assert!(matches!(
        m.read(Read::Claim(Ok(claim("u9", true))), false, &l),
        Step::Read { fresh: true }
    ));
    match m.read(Read::Claim(Ok(claim("u9", true))), true, &l) {
        Step::Release(r) => {
            assert_eq!(r.len(), 1);
            assert_eq!(r[0].reason, "claim-deleted");
        }
        s => panic!("not released: {s:?}"),
    }
    let mut m = start("u1");
    assert!(matches!(m.read(Read::Gone, true, &l), Step::Release(r) if r.len() == 1));
}

#[test]
fn releases_are_decided_only_from_the_claim_the_api_server_has() {
    let l = granted();
    // Deallocated in the cache: read afresh before releasing.
    let mut m = start("u1");
    assert!(matches!(
        m.read(Read::Claim(Ok(claim("u1", false))), false, &l),
        Step::Read { fresh: true }
    ));
    match m.read(Read::Claim(Ok(claim("u1", false))), true, &l) {
        Step::Carry(_, p) => assert_eq!(p.releases.len(), 1, "{p:?}"),
        s => panic!("not carried: {s:?}"),
    }
}

#[test]
fn unreadable_claims_and_failed_io_end_it_with_their_reason() {
    let l = ledger();
    let mut m = start("u1");
    assert_eq!(
        format!("{:?}", m.read(Read::Claim(Err("bad".into())), false, &l)),
        format!("{:?}", Step::Done(Outcome::Unreadable("bad".into())))
    );
    let mut m = start("u1");
    assert!(matches!(
        m.read(Read::Failed("down".into()), true, &l),
        Step::Done(Outcome::ReadFailed(_))
    ));
    let mut m = start("u1");
    let _ = m.read(Read::Claim(Ok(claim("u1", true))), false, &l);
    assert!(matches!(
        m.written(Written::Failed("403".into())),
        Step::Done(Outcome::WriteFailed(_))
    ));
}
