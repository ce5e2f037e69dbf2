use super::*;

const A: &str = "aaaaaaaa-0000-0000-0000-000000000001";
const B: &str = "bbbbbbbb-0000-0000-0000-000000000002";
const C: &str = "cccccccc-0000-0000-0000-000000000003";

/// Allocation 1 (pod A, 1000 MiB) and 2 (pod B, 2000 MiB) on G0; pod C has none.
fn view() -> View {
    let mut v = View::default();
    for (id, uid, gpu, mem) in [(1, A, "G0", 1000), (2, B, "G0", 2000)] {
        v.upsert(pb::Allocation {
            id,
            pod: Some(pb::PodRef {
                uid: uid.into(),
                namespace: "ns".into(),
                name: uid.into(),
            }),
            container: "main".into(),
            node: "n1".into(),
            shares: vec![pb::GpuShare {
                gpu_uuid: gpu.into(),
                mem_mib: mem,
                core_milli: 0,
            }],
            state: pb::AllocationState::Assigned as i32,
            ..Default::default()
        });
    }
    v
}

fn over(
    allocation_id: u64,
    pids: &[u32],
    used_mib: u64,
    limit_mib: u64,
    claimers_only: bool,
) -> Finding {
    Finding::Over(OverLimit {
        allocation_id,
        gpu: "G0".into(),
        pids: pids.to_vec(),
        used_mib,
        limit_mib,
        claimers_only,
    })
}

fn p(pid: u32, used: u64) -> GpuProcess {
    GpuProcess {
        gpu: "G0".into(),
        pid,
        used_mib: used,
    }
}

fn in_pod(uid: &str, claim: Option<u64>) -> ProcOwner {
    ProcOwner {
        pod: PodCgroup::Pod(uid.into()),
        claimed_allocations: claim.into_iter().collect(),
    }
}

fn no_pod(claim: Option<u64>) -> ProcOwner {
    ProcOwner {
        pod: PodCgroup::NoPod,
        claimed_allocations: claim.into_iter().collect(),
    }
}

#[test]
fn a_process_is_charged_to_its_cgroups_pod_whatever_its_environment_claims() {
    let v = view();
    assert_eq!(attribute(&v, "G0", &in_pod(A, None)), Attribution::Pod(1));
    // Pod B claiming pod A's allocation is still pod B's.
    assert_eq!(
        attribute(&v, "G0", &in_pod(B, Some(1))),
        Attribution::Pod(2)
    );
    // Pod C has nothing on G0: rogue, and the claim on A's allocation counts for nothing.
    assert_eq!(
        attribute(&v, "G0", &in_pod(C, Some(1))),
        Attribution::Rogue(RogueReason::OtherPod(C.into()))
    );
    // Pod A on a GPU where it has nothing: rogue too.
    assert_eq!(
        attribute(&v, "G9", &in_pod(A, Some(1))),
        Attribution::Rogue(RogueReason::OtherPod(A.into()))
    );
    let conflict = ProcOwner {
        pod: PodCgroup::Conflict(vec![A.into(), B.into()]),
        claimed_allocations: vec![1],
    };
    assert_eq!(
        attribute(&v, "G0", &conflict),
        Attribution::Rogue(RogueReason::Conflict)
    );
}

#[test]
fn only_a_process_in_no_pod_is_charged_by_its_claim() {
    let v = view();
    assert_eq!(attribute(&v, "G0", &no_pod(Some(1))), Attribution::Claim(1));
    assert_eq!(
        attribute(&v, "G0", &no_pod(None)),
        Attribution::Rogue(RogueReason::NoPod)
    );
    // A claim on an allocation that is not on this GPU, or does not exist, counts for nothing.
    assert_eq!(
        attribute(&v, "G9", &no_pod(Some(1))),
        Attribution::Rogue(RogueReason::NoPod)
    );
    assert_eq!(
        attribute(&v, "G0", &no_pod(Some(77))),
        Attribution::Rogue(RogueReason::NoPod)
    );
    // A container of several grants (a DRA request for several GPUs) names them all: the one
    // on this GPU counts.
    let several = ProcOwner {
        pod: PodCgroup::NoPod,
        claimed_allocations: vec![77, 2],
    };
    assert_eq!(attribute(&v, "G0", &several), Attribution::Claim(2));
}

#[test]
fn a_pod_with_several_allocations_on_a_gpu_picks_by_its_claim_among_them_only() {
    let mut v = view();
    let mut second = v.allocs[&1].clone();
    second.id = 5;
    second.container = "side".into();
    v.upsert(second);
    assert_eq!(
        attribute(&v, "G0", &in_pod(A, Some(5))),
        Attribution::Pod(5)
    );
    assert_eq!(attribute(&v, "G0", &in_pod(A, None)), Attribution::Pod(1));
    assert_eq!(
        attribute(&v, "G0", &in_pod(A, Some(2))),
        Attribution::Pod(1)
    );
}

#[test]
fn a_forged_allocation_id_never_makes_the_victim_over_its_limit() {
    let v = view();
    // Pod A within its 1000 MiB; pod B (2000 MiB) uses 1500 claiming A's allocation; pod C
    // (no allocation) uses 3000 claiming A's allocation too.
    let f = judge(
        &v,
        &[
            (p(10, 900), in_pod(A, None)),
            (p(20, 1500), in_pod(B, Some(1))),
            (p(30, 3000), in_pod(C, Some(1))),
        ],
        0,
    );
    assert_eq!(
        f,
        vec![Finding::Rogue {
            gpu: "G0".into(),
            pid: 30,
            used_mib: 3000,
            reason: RogueReason::OtherPod(C.into()),
        }]
    );
    // Pod B over its own limit is pod B's violation, never A's.
    let f = judge(
        &v,
        &[
            (p(10, 900), in_pod(A, None)),
            (p(20, 2500), in_pod(B, Some(1))),
        ],
        0,
    );
    assert_eq!(f, vec![over(2, &[20], 2500, 2000, false)]);
}

#[test]
fn processes_outside_any_pod_that_claim_an_allocation_can_only_hurt_themselves() {
    let v = view();
    // Pod A's own process is within its limit; a claimer in no pod takes the total over: only
    // the claimer is named.
    let f = judge(
        &v,
        &[(p(10, 900), in_pod(A, None)), (p(40, 500), no_pod(Some(1)))],
        0,
    );
    assert_eq!(f, vec![over(1, &[40], 1400, 1000, true)]);
    // Pod A over its limit on its own: everything charged to it is named, largest first.
    let f = judge(
        &v,
        &[
            (p(10, 1100), in_pod(A, None)),
            (p(40, 1500), no_pod(Some(1))),
        ],
        0,
    );
    assert_eq!(f, vec![over(1, &[40, 10], 2600, 1000, false)]);
}

#[test]
fn each_process_may_use_its_cuda_context_beyond_the_share() {
    let v = view();
    // A container given 1000 MiB that allocated 1000 MiB in each of two processes shows
    // 1000 + 518 for the first; the allowance is per process.
    let procs = [(p(10, 1518), in_pod(A, None))];
    assert!(judge(&v, &procs, 520).is_empty());
    assert!(
        !judge(&v, &procs, 0).is_empty(),
        "without an allowance it is over"
    );
    let two = [
        (p(10, 1000), in_pod(A, None)),
        (p(11, 1030), in_pod(A, None)),
    ];
    assert!(judge(&v, &two, 520).is_empty(), "2030 <= 1000 + 2 x 520");
    let too_much = [
        (p(10, 1600), in_pod(A, None)),
        (p(11, 600), in_pod(A, None)),
    ];
    assert_eq!(judge(&v, &too_much, 520).len(), 1, "2200 > 1000 + 2 x 520");
}

#[test]
fn a_process_of_a_claims_consumer_pod_is_charged_to_the_claim_grant() {
    let mut v = view();
    // Grant 3: claim "claim-uid" on G0, reserved for pod C.
    v.upsert(pb::Allocation {
        id: 3,
        pod: Some(pb::PodRef {
            uid: "claim-uid".into(),
            namespace: "ns".into(),
            name: "gpu".into(),
        }),
        container: "c0/share".into(),
        node: "n1".into(),
        shares: vec![pb::GpuShare {
            gpu_uuid: "G0".into(),
            mem_mib: 500,
            core_milli: 0,
        }],
        state: pb::AllocationState::Bound as i32,
        claim: Some(Box::new(pb::ClaimGrant {
            request: "c0".into(),
            consumers: vec![pb::PodRef {
                uid: C.into(),
                namespace: "ns".into(),
                name: "c".into(),
            }],
            ..Default::default()
        })),
        ..Default::default()
    });
    assert_eq!(attribute(&v, "G0", &in_pod(C, None)), Attribution::Pod(3));
    // The claim's own UID is no pod's.
    assert!(matches!(
        attribute(&v, "G0", &in_pod("claim-uid", None)),
        Attribution::Rogue(_)
    ));
}
