use super::*;
use gpuledger_ledger::{Command, ContainerRequest, Ledger, PodRequest, Reply};
use gpuledger_testkit::history::now_ms;

fn log(epoch: u64) -> (Vec<pb::EventBatch>, u64, u64) {
    let mut l = Ledger::new();
    let mut batches = Vec::new();
    let mut run = |l: &mut Ledger, cmd: Command| {
        let (events, reply) = l.execute(cmd, epoch, 0).expect("command");
        batches.push(pb::EventBatch {
            version: 1,
            first_seq: events[0].seq,
            epoch,
            events,
            ..Default::default()
        });
        reply
    };
    run(
        &mut l,
        Command::RegisterNode(gpuledger_testkit::workload::inventory(
            "n1", 2, 16_000, "T4",
        )),
    );
    let mut reserve = |l: &mut Ledger, uid: &str| {
        let request = PodRequest {
            pod: pb::PodRef {
                uid: uid.into(),
                namespace: "default".into(),
                name: uid.into(),
            },
            containers: vec![ContainerRequest {
                name: "main".into(),
                slices: 1,
                mem_mib: 4_000,
                ..Default::default()
            }],
            ..Default::default()
        };
        let cmd = Command::Reserve {
            request,
            node: "n1".into(),
            deadline_ms: 0,
        };
        match run(l, cmd) {
            Reply::Reserved { allocations, .. } => allocations[0].id,
            other => panic!("reserve answered {other:?}"),
        }
    };
    let a = reserve(&mut l, "a");
    let b = reserve(&mut l, "b");
    run(
        &mut l,
        Command::Assign {
            node: "n1".into(),
            allocation_id: a,
            device_ids: vec!["d0".into()],
        },
    );
    (batches, a, b)
}

fn op(op: &'static str, uid: &str, allocation: Option<u64>) -> Op {
    Op {
        at_ms: now_ms(),
        op,
        pod: format!("default/{uid}"),
        uid: uid.into(),
        node: "n1".into(),
        outcome: Outcome::Ok,
        allocation,
        detail: String::new(),
    }
}

#[test]
fn a_clean_history_passes() {
    let (batches, a, _) = log(7);
    let r = Replay::from_batches(batches);
    assert!(r.violations.is_empty(), "{:?}", r.violations);
    let g = check_grants(&[op("bind", "a", None), op("allocate", "a", Some(a))], &r);
    assert!(g.violations.is_empty(), "{:?}", g.violations);
    assert_eq!((g.lost, g.double), (0, 0));
}

#[test]
fn acknowledged_grants_missing_from_the_ledger_are_lost() {
    let (batches, a, b) = log(7);
    let r = Replay::from_batches(batches);
    // A bind acknowledged for a pod the ledger never reserved.
    assert_eq!(check_grants(&[op("bind", "zz", None)], &r).lost, 1);
    // An Allocate answered with another pod's allocation, or one never claimed.
    assert_eq!(check_grants(&[op("allocate", "b", Some(a))], &r).lost, 1);
    let g = check_grants(&[op("allocate", "b", Some(b))], &r);
    assert_eq!(g.lost, 1);
    assert!(g.violations[0].contains("never shows claimed"), "{g:?}");
    // Unknown outcomes are not acknowledgements.
    let mut unknown = op("bind", "zz", None);
    unknown.outcome = Outcome::Unknown;
    assert_eq!(check_grants(&[unknown], &r).lost, 0);
}

#[test]
fn one_pod_answered_two_allocations_is_a_double_grant() {
    let (batches, a, b) = log(7);
    let r = Replay::from_batches(batches);
    let g = check_grants(
        &[op("allocate", "a", Some(a)), op("allocate", "a", Some(b))],
        &r,
    );
    assert_eq!(g.double, 1, "{g:?}");
}

#[test]
fn broken_logs_are_caught_on_replay() {
    // Epochs going down.
    let (mut batches, _, _) = log(7);
    batches[2].epoch = 3;
    let r = Replay::from_batches(batches);
    assert!(r.violations.iter().any(|v| v.contains("epoch went down")));
    // A gap in the seq.
    let (mut batches, _, _) = log(7);
    batches.remove(1);
    let r = Replay::from_batches(batches);
    assert!(
        r.violations.iter().any(|v| v.contains("seq gap")),
        "{:?}",
        r.violations
    );
    // A GPU over capacity.
    let (mut batches, _, _) = log(7);
    if let Some(pb::event::Body::Reserved(x)) = &mut batches[1].events[0].body {
        x.shares[0].mem_mib = 1_000_000;
    }
    let r = Replay::from_batches(batches);
    assert!(!r.violations.is_empty());
}
