use gpuledger_proto::ledger::v1::event::Body;

use super::*;
use crate::view::tests::{ev, reserved};

const WAIT: Duration = Duration::from_secs(10);

fn ids(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| s.to_string()).collect()
}

fn assigned(seq: u64, allocation_id: u64, devices: &[&str]) -> pb::Event {
    ev(
        seq,
        Body::Assigned(pb::Assigned {
            allocation_id,
            device_ids: ids(devices),
            node: "n1".into(),
        }),
    )
}

fn released(seq: u64, allocation_id: u64) -> pb::Event {
    ev(
        seq,
        Body::Released(pb::Released {
            allocation_id,
            ..Default::default()
        }),
    )
}

fn view(events: &[pb::Event]) -> View {
    let mut v = View::default();
    for e in events {
        v.apply(e);
    }
    v
}

fn allocate(devices: &[&str]) -> Allocate {
    Allocate::new(ids(devices), "n1", WAIT)
}

/// The step `f` takes, with PodResources answering that the kubelet admits the guessed pod.
fn yes(m: &mut Allocate, f: impl FnOnce(&mut Allocate) -> Step, v: &View, now: Instant) -> Step {
    match f(m) {
        Step::Confirm(_) => m.listed(Ok(Admitting::Yes), v, true, now),
        s => s,
    }
}

#[test]
fn the_oldest_pending_reservation_is_claimed_and_its_allocation_answered() {
    let t0 = Instant::now();
    let v = view(&[reserved(1, "a", "G0"), reserved(2, "b", "G1")]);
    let mut m = allocate(&["G1::0"]);
    assert!(matches!(
        yes(&mut m, |m| m.start(&v, true, t0), &v, t0),
        Step::Assign(1)
    ));
    let mut a = v.allocs[&1].clone();
    a.device_ids = ids(&["G1::0"]);
    let at = t0 + Duration::from_millis(3);
    match m.assigned(Ok(Some(a)), v.seq, at) {
        Step::Answer(got, Answered::Claimed { started, refusals }) => {
            assert_eq!((got.id, started, refusals), (1, t0, 0));
        }
        other => panic!("answered with the claim, got {other:?}"),
    }
}

#[test]
fn a_repeat_for_devices_their_container_still_has_gets_the_same_answer() {
    let t0 = Instant::now();
    let v = view(&[reserved(1, "a", "G0"), assigned(2, 1, &["G0::0"])]);
    let mut m = allocate(&["G0::0"]);
    let Step::AskOwner(held) = m.start(&v, true, t0) else {
        panic!("asks PodResources first");
    };
    assert_eq!(held.id, 1);
    assert!(matches!(
        m.owner(true, &v, true, t0),
        Step::Answer(a, Answered::Repeat) if a.id == 1
    ));
}

#[test]
fn devices_given_to_another_container_wait_for_the_old_holders_release() {
    let t0 = Instant::now();
    let mut v = view(&[
        reserved(1, "a", "G0"),
        assigned(2, 1, &["G0::0"]),
        reserved(3, "b", "G0"),
    ]);
    let mut m = allocate(&["G0::0"]);
    assert!(matches!(m.start(&v, true, t0), Step::AskOwner(_)));
    // The kubelet gave the devices to another container: `a` finished, its release is coming.
    match m.owner(false, &v, true, t0) {
        Step::Wait {
            until,
            note: Some(Note::StaleHolders(stale)),
        } => assert_eq!((until, stale), (t0 + WAIT, vec![1])),
        other => panic!("waits for the release, got {other:?}"),
    }
    let t1 = t0 + Duration::from_secs(1);
    assert!(matches!(
        m.view(&v, true, t1),
        Step::Wait { note: None, .. }
    ));
    v.apply(&released(4, 1));
    assert!(matches!(
        yes(&mut m, |m| m.view(&v, true, t1), &v, t1),
        Step::Assign(3)
    ));
}

#[test]
fn a_holder_whose_release_never_comes_with_exactly_these_devices_was_a_lost_answer() {
    let t0 = Instant::now();
    let v = view(&[reserved(1, "a", "G0"), assigned(2, 1, &["G0::0"])]);
    let mut m = allocate(&["G0::0"]);
    assert!(matches!(m.start(&v, true, t0), Step::AskOwner(_)));
    assert!(matches!(m.owner(false, &v, true, t0), Step::Wait { .. }));
    assert!(matches!(
        m.view(&v, true, t0 + WAIT),
        Step::Answer(a, Answered::Lost) if a.id == 1
    ));
}

#[test]
fn holders_that_do_not_match_the_devices_exactly_are_refused_when_the_wait_ends() {
    let t0 = Instant::now();
    let v = view(&[
        reserved(1, "a", "G0"),
        assigned(2, 1, &["G0::0"]),
        reserved(3, "b", "G1"),
        assigned(4, 3, &["G1::0"]),
    ]);
    let mut m = allocate(&["G0::0", "G1::0"]);
    assert!(matches!(
        m.start(&v, true, t0),
        Step::Wait {
            note: Some(Note::StaleHolders(_)),
            ..
        }
    ));
    match m.view(&v, true, t0 + WAIT) {
        Step::Refuse(s) => {
            assert_eq!(s.code(), Code::Unavailable);
            assert!(s.message().contains("[1, 3]"), "{}", s.message());
        }
        other => panic!("refused, got {other:?}"),
    }
}

#[test]
fn refused_guesses_look_again_after_the_view_moves_and_then_give_up() {
    let t0 = Instant::now();
    let mut v = view(&[reserved(1, "a", "G0")]);
    let mut m = allocate(&["G0::0"]);
    assert!(matches!(
        yes(&mut m, |m| m.start(&v, true, t0), &v, t0),
        Step::Assign(1)
    ));
    let mut now = t0;
    for refusal in 1..=MAX_REFUSALS {
        now += Duration::from_millis(10);
        match m.assigned(Err(Status::already_exists("taken")), v.seq, now) {
            Step::Wait {
                until,
                note: Some(Note::Refused { allocation: 1, .. }),
            } => assert_eq!(until, now + REREAD_WAIT, "refusal {refusal}"),
            other => panic!("waits for the ledger after refusal {refusal}, got {other:?}"),
        }
        // Nothing new yet: still waiting.
        assert!(matches!(m.view(&v, true, now), Step::Wait { .. }));
        v.apply(&ev(v.seq + 1, Body::LeaderElected(Default::default())));
        assert!(matches!(
            yes(&mut m, |m| m.view(&v, true, now), &v, now),
            Step::Assign(1)
        ));
    }
    match m.assigned(Err(Status::already_exists("taken")), v.seq, now) {
        Step::Refuse(s) => assert_eq!(s.code(), Code::AlreadyExists),
        other => panic!("the sixth refusal is the answer, got {other:?}"),
    }
}

#[test]
fn a_refusal_after_the_wait_or_of_another_kind_is_the_answer() {
    let t0 = Instant::now();
    let v = view(&[reserved(1, "a", "G0")]);
    let mut m = allocate(&["G0::0"]);
    assert!(matches!(
        yes(&mut m, |m| m.start(&v, true, t0), &v, t0),
        Step::Assign(1)
    ));
    assert!(matches!(
        m.assigned(Err(Status::not_found("gone")), v.seq, t0 + WAIT),
        Step::Refuse(s) if s.code() == Code::NotFound
    ));
    let mut m = allocate(&["G0::0"]);
    assert!(matches!(
        yes(&mut m, |m| m.start(&v, true, t0), &v, t0),
        Step::Assign(1)
    ));
    assert!(matches!(
        m.assigned(Err(Status::permission_denied("no")), v.seq, t0),
        Step::Refuse(s) if s.code() == Code::PermissionDenied
    ));
}

#[test]
fn without_a_pending_reservation_the_allocate_waits_then_is_refused() {
    let t0 = Instant::now();
    let mut v = View::default();
    let mut m = allocate(&["G0::0"]);
    assert!(matches!(
        m.start(&v, false, t0),
        Step::Wait { until, note: None } if until == t0 + WAIT
    ));
    // A reservation in a view not yet synced is not claimed.
    v.apply(&reserved(1, "a", "G0"));
    assert!(matches!(m.view(&v, false, t0), Step::Wait { .. }));
    let mut m = allocate(&["G0::0", "G1::0"]);
    assert!(matches!(m.start(&v, true, t0), Step::Wait { .. }));
    match m.view(&v, true, t0 + WAIT) {
        Step::Refuse(s) => {
            assert_eq!(s.code(), Code::FailedPrecondition);
            assert!(
                s.message()
                    .contains("no pending gpuledger reservation of 2 slice(s) on node n1"),
                "{}",
                s.message()
            );
        }
        other => panic!("refused, got {other:?}"),
    }
}

#[test]
fn devices_assigned_while_looking_are_the_answer_and_an_empty_assign_is_a_bug() {
    let t0 = Instant::now();
    let mut v = View::default();
    let mut m = allocate(&["G0::0"]);
    assert!(matches!(m.start(&v, true, t0), Step::Wait { .. }));
    v.apply(&reserved(1, "a", "G0"));
    v.apply(&assigned(2, 1, &["G0::0"]));
    assert!(matches!(
        m.view(&v, true, t0),
        Step::Answer(a, Answered::Assigned) if a.id == 1
    ));
    let v = view(&[reserved(1, "a", "G0")]);
    let mut m = allocate(&["G0::0"]);
    assert!(matches!(
        yes(&mut m, |m| m.start(&v, true, t0), &v, t0),
        Step::Assign(1)
    ));
    assert!(matches!(
        m.assigned(Ok(None), v.seq, t0),
        Step::Refuse(s) if s.code() == Code::Internal
    ));
    assert!(
        matches!(m.view(&v, true, t0), Step::Refuse(s) if s.code() == Code::Internal),
        "an input out of turn is refused, not a panic"
    );
}

fn listing(pods: &[(&str, &[&str])]) -> podres::ListPodResourcesResponse {
    podres::ListPodResourcesResponse {
        pod_resources: pods
            .iter()
            .map(|(name, devices)| podres::PodResources {
                name: name.to_string(),
                namespace: "ns".into(),
                containers: vec![podres::ContainerResources {
                    name: "main".into(),
                    devices: vec![podres::ContainerDevices {
                        resource_name: "gpuledger.io/gpu".into(),
                        device_ids: ids(devices),
                        topology: None,
                    }],
                    cpu_ids: Vec::new(),
                }],
            })
            .collect(),
    }
}

#[test]
fn only_a_pod_the_kubelet_knows_without_devices_is_being_admitted() {
    let v = view(&[reserved(1, "a", "G0")]);
    let a = &v.allocs[&1];
    let r = "gpuledger.io/gpu";
    assert_eq!(admitting(&listing(&[("pod-a", &[])]), a, r), Admitting::Yes);
    assert!(matches!(
        admitting(&listing(&[("pod-x", &[])]), a, r),
        Admitting::No(_)
    ));
    assert!(matches!(
        admitting(&listing(&[("pod-a", &["G0::1"])]), a, r),
        Admitting::No(_)
    ));
}

#[test]
fn a_reservation_whose_pod_is_not_being_admitted_is_passed_over_and_never_claimed() {
    let t0 = Instant::now();
    let v = view(&[reserved(1, "a", "G0"), reserved(2, "b", "G1")]);
    let mut m = allocate(&["G1::0"]);
    assert!(matches!(m.start(&v, true, t0), Step::Confirm(x) if x.id == 1));
    assert!(matches!(
        m.listed(Ok(Admitting::No("not known".into())), &v, true, t0),
        Step::Confirm(x) if x.id == 2
    ));
    assert!(matches!(
        m.listed(Ok(Admitting::Yes), &v, true, t0),
        Step::Assign(2)
    ));

    // Nobody's pod is being admitted: wait for a reservation, then refuse, saying why.
    let v = view(&[reserved(1, "a", "G0")]);
    let mut m = allocate(&["G1::0"]);
    assert!(matches!(m.start(&v, true, t0), Step::Confirm(_)));
    assert!(matches!(
        m.listed(Ok(Admitting::No("not known".into())), &v, true, t0),
        Step::Wait { .. }
    ));
    match m.view(&v, true, t0 + WAIT) {
        Step::Refuse(s) => assert!(
            s.message()
                .contains("not placed by the gpuledger scheduler")
                && !s.message().contains("pod-a"),
            "{}",
            s.message()
        ),
        other => panic!("refused, got {other:?}"),
    }

    // Without PodResources nothing is handed out.
    let mut m = allocate(&["G1::0"]);
    assert!(matches!(m.start(&v, true, t0), Step::Confirm(_)));
    assert!(matches!(
        m.listed(Err(Status::unavailable("gone")), &v, true, t0),
        Step::Refuse(s) if s.code() == Code::Unavailable
    ));
}
