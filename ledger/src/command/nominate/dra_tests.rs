//! Preemption on a DRA node: claim grants weighed as their pods' allocations, the nomination
//! kept against the claims of pods the preemptor outranks, and the preemptor's own claim let in.

use super::super::{Command, CommandError, Reply};
use crate::pb;
use crate::placement::preempt::{self, Evictable, NodePods};
use crate::placement::{ContainerRequest, PodRequest, Policy};
use crate::state::{Ledger, dra_device_name};

const GPU: &str = "GPU-D0";

/// Node `dra` in DRA mode with one 16000 MiB GPU, holding claim `cv` of pod `v` (8000 MiB)
/// and claim `co` shared by pods `o1` and `o2` (6000 MiB).
fn setup() -> Ledger {
    let mut l = Ledger::new();
    let inv = pb::NodeInventory {
        node: "dra".into(),
        gpus: vec![pb::Gpu {
            uuid: GPU.into(),
            index: 0,
            model: "A100".into(),
            memory_mib: 16000,
            healthy: true,
            compute_capability: String::new(),
        }],
        mode: pb::NodeMode::Dra as i32,
        ..Default::default()
    };
    l.execute(Command::RegisterNode(inv), 1, 0)
        .expect("register");
    l.execute(Command::GrantClaim(grant("cv", &["v"], 8000, 0)), 1, 1)
        .expect("grant v");
    l.execute(
        Command::GrantClaim(grant("co", &["o1", "o2"], 6000, 0)),
        1,
        2,
    )
    .expect("grant o");
    l
}

fn pod_ref(uid: &str) -> pb::PodRef {
    pb::PodRef {
        uid: uid.into(),
        namespace: "ns".into(),
        name: uid.into(),
    }
}

/// The grant of claim `claim`'s one result, `mem` MiB of the GPU, reserved for `pods`, whose
/// highest priority is `priority`.
fn grant(claim: &str, pods: &[&str], mem: u64, priority: i32) -> pb::ClaimGranted {
    pb::ClaimGranted {
        claim: Some(pb::ClaimRef {
            uid: claim.into(),
            namespace: "ns".into(),
            name: claim.into(),
        }),
        request: "c0".into(),
        node: "dra".into(),
        pool: "dra".into(),
        device: dra_device_name(GPU),
        share_id: format!("s-{claim}"),
        share: Some(pb::GpuShare {
            gpu_uuid: GPU.into(),
            mem_mib: mem,
            core_milli: 100,
        }),
        consumers: pods.iter().map(|p| pod_ref(p)).collect(),
        source: "claim".into(),
        priority,
        ..Default::default()
    }
}

fn request(uid: &str, mem: u64, priority: i32) -> PodRequest {
    PodRequest {
        pod: pod_ref(uid),
        containers: vec![ContainerRequest {
            name: "gpuledger/c0".into(),
            slices: 1,
            mem_mib: mem,
            core_milli: 100,
            ..Default::default()
        }],
        policy: Policy::Binpack,
        priority,
        dra: true,
        ..Default::default()
    }
}

fn evictable(uids: &[&str]) -> Vec<NodePods> {
    vec![NodePods {
        node: "dra".into(),
        evictable: uids
            .iter()
            .map(|u| Evictable {
                pod_uid: (*u).into(),
                priority: 5,
            })
            .collect(),
        ..Default::default()
    }]
}

#[test]
fn the_search_evicts_the_pod_a_claim_is_reserved_for_and_every_pod_of_a_shared_claim() {
    let l = setup();
    // 2000 MiB free; evicting v frees its claim's 8000.
    let plan = preempt::choose_nomination(&l, &request("p", 10000, 100), &evictable(&["v", "o1"]))
        .expect("room once v is gone");
    assert_eq!(plan.victims.len(), 1, "{plan:?}");
    assert_eq!(plan.victims[0].pod_uid, "v");
    assert_eq!(plan.placement[0].shares[0].gpu_uuid, GPU);
    // 14000 MiB needs co's room too, and evicting o1 alone frees no claim also reserved for
    // o2, which may not be evicted.
    assert_eq!(
        preempt::choose_nomination(&l, &request("p", 14000, 100), &evictable(&["v", "o1"])),
        None
    );
    // When o2 may go too, the claim's pods go together.
    let plan = preempt::choose_nomination(
        &l,
        &request("p", 14000, 100),
        &evictable(&["v", "o1", "o2"]),
    )
    .expect("room once v, o1 and o2 are gone");
    let victims: Vec<&str> = plan.victims.iter().map(|v| v.pod_uid.as_str()).collect();
    assert_eq!(victims, ["o1", "o2", "v"], "{plan:?}");
    assert!(plan.victims.iter().all(|v| v.priority == 5));
}

#[test]
fn a_pod_sharing_a_claim_is_evicted_with_the_others_only_when_that_frees_room() {
    let l = setup();
    // 8000 MiB: v alone suffices, and o1 + o2 (6000) do not; the search does not take the
    // unit where one pod frees the room.
    let plan =
        preempt::choose_nomination(&l, &request("p", 9000, 100), &evictable(&["v", "o1", "o2"]))
            .expect("room once v is gone");
    let victims: Vec<&str> = plan.victims.iter().map(|v| v.pod_uid.as_str()).collect();
    assert_eq!(victims, ["v"]);
    // 7000 MiB: evicting the two pods of co (6000 + 2000 free) is enough, and two pods of
    // priority 1 are cheaper than one of priority 5.
    let mut pods = evictable(&["v", "o1", "o2"]);
    for e in &mut pods[0].evictable {
        if e.pod_uid.starts_with('o') {
            e.priority = 1;
        }
    }
    let plan = preempt::choose_nomination(&l, &request("p", 7000, 100), &pods)
        .expect("room once o1 and o2 are gone");
    let victims: Vec<&str> = plan.victims.iter().map(|v| v.pod_uid.as_str()).collect();
    assert_eq!(victims, ["o1", "o2"], "{plan:?}");
    // The ledger takes a nomination whose victims are all of a shared claim's pods, and
    // refuses one that leaves one of them running: the claim is not freed then.
    let nominate = |victims: &[&str]| {
        let mut n = plan.nomination(&request("p", 7000, 100), i64::MAX, &|u| Some(pod_ref(u)));
        n.victims
            .retain(|v| victims.contains(&v.pod.as_ref().unwrap().uid.as_str()));
        l.clone().execute(
            Command::Nominate {
                nomination: n,
                leaving: Vec::new(),
            },
            1,
            10,
        )
    };
    assert!(
        matches!(nominate(&["o1"]), Err(CommandError::NoCapacity(_))),
        "one of a shared claim's two pods frees nothing"
    );
    assert!(matches!(
        nominate(&["o1", "o2"]),
        Ok((_, Reply::Done { changed: true }))
    ));
}

#[test]
fn the_nominated_room_is_certified_only_for_the_preemptor_or_a_pod_that_outranks_it() {
    let mut l = setup();
    let req = request("p", 10000, 100);
    let plan = preempt::choose_nomination(&l, &req, &evictable(&["v"])).expect("plan");
    let nomination = plan.nomination(&req, 90_000, &|u| Some(pod_ref(u)));
    let (_, r) = l
        .execute(
            Command::Nominate {
                nomination,
                leaving: Vec::new(),
            },
            1,
            10,
        )
        .expect("a DRA node takes nominations");
    assert!(matches!(r, Reply::Done { changed: true }));
    assert!(l.check().is_ok());
    let v = l.allocs_of_pod("cv")[0].id;
    l.execute(
        Command::Release {
            pod_uid: String::new(),
            container: String::new(),
            allocation_id: v,
            reason: "claim-deleted".into(),
        },
        1,
        11,
    )
    .expect("v's claim gone");

    // 10000 MiB are free now, all of it kept for p.
    for prio in [50, 100] {
        let e = l
            .execute(
                Command::GrantClaim(grant("cl", &["low"], 10000, prio)),
                1,
                12,
            )
            .expect_err("kept for p");
        assert!(
            matches!(&e, CommandError::NoCapacity(m) if m.contains("kept for pod ns/p (priority 100)")),
            "priority {prio}: {e}"
        );
    }
    // Nothing beside the kept room is free, and a pod that outranks p is not held back.
    let mut probe = l.clone();
    probe
        .execute(Command::GrantClaim(grant("cs", &["small"], 1, 50)), 1, 12)
        .expect_err("no room beside 10000 kept of 10000 free");
    probe
        .execute(
            Command::GrantClaim(grant("ch", &["high"], 10000, 200)),
            1,
            12,
        )
        .expect("a pod of higher priority takes it");

    // The preemptor's own claim takes its room.
    l.execute(Command::GrantClaim(grant("cp", &["p"], 10000, 100)), 1, 13)
        .expect("the nominee is certified");
    assert!(l.check().is_ok());
}
