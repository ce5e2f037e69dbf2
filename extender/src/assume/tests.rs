use super::*;
use gpuledger_ledger::pb;

fn request(uid: &str, mem: u64) -> api::PodRequest {
    api::PodRequest {
        pod: Some(pb::PodRef {
            uid: uid.into(),
            namespace: "ns".into(),
            name: uid.into(),
        }),
        containers: vec![api::ContainerRequest {
            name: "c".into(),
            slices: 1,
            mem_mib: mem,
            ..Default::default()
        }],
        ..Default::default()
    }
}

/// Nodes `names`, each with one 16 GiB GPU.
fn ledger(names: &[&str]) -> Ledger {
    let mut l = Ledger::new();
    for (i, name) in names.iter().enumerate() {
        let inv = pb::NodeInventory {
            mode: Default::default(),
            isolation: String::new(),
            dra_cores: String::new(),
            node: (*name).into(),
            gpus: vec![pb::Gpu {
                uuid: format!("GPU-{name}"),
                index: 0,
                model: "A10".into(),
                memory_mib: 16_384,
                healthy: true,
                compute_capability: String::new(),
            }],
            cpu_milli: 0,
            memory_mib: 0,
        };
        let ev = pb::Event {
            seq: i as u64 + 1,
            epoch: 1,
            time_ms: 1,
            actor: None,
            body: Some(pb::event::Body::NodeRegistered(pb::NodeRegistered {
                inventory: Some(inv),
            })),
        };
        l.apply(&ev).expect("registers");
    }
    l
}

/// Where a 10,000 MiB pod `p2` fits, counting what `cache` assumes, at `now`.
fn fits_at(l: &Ledger, cache: &InFlight, now: Instant) -> Vec<String> {
    let d = Defaults::default();
    let next = d.request(request("p2", 10_000)).expect("valid");
    let names: Vec<String> = l.nodes().keys().cloned().collect();
    let mut f = placement::filter_nodes(l, &names, &next);
    cache.filter_at(l, &d, &next, &mut f, now);
    f.fits.sort();
    f.fits
}

fn fits(l: &Ledger, cache: &InFlight) -> Vec<String> {
    fits_at(l, cache, Instant::now())
}

#[test]
fn a_bind_in_flight_takes_its_capacity_until_it_fails() {
    let (l, d, cache) = (ledger(&["n1"]), Defaults::default(), InFlight::new());
    let next = d.request(request("p2", 10_000)).expect("valid");
    assert_eq!(fits(&l, &cache), ["n1"]);
    let first = cache.assume("p1", "n1", request("p1", 10_000));
    let mut f = placement::filter_nodes(&l, ["n1"], &next);
    cache.filter(&l, &d, &next, &mut f);
    assert!(f.fits.is_empty(), "{f:?}");
    assert!(f.wait[0].1.contains("in flight"), "{f:?}");
    let mut scores = [Some(7)];
    cache.scores(&l, &d, &next, &["n1"], &mut scores);
    assert_eq!(scores, [Some(0)], "a node it no longer fits on scores 0");
    // A pod's own bind does not count against it (the scheduler retries it).
    let own = d.request(request("p1", 10_000)).expect("valid");
    let mut f = placement::filter_nodes(&l, ["n1"], &own);
    cache.filter(&l, &d, &own, &mut f);
    assert_eq!(f.fits, vec!["n1"]);
    drop(first);
    assert_eq!(fits(&l, &cache), ["n1"], "a failed bind is forgotten");
    // Landed at a seq the replica has: the ledger counts it, the cache no more.
    cache.assume("p1", "n1", request("p1", 10_000)).landed(1);
    assert_eq!(fits(&l, &cache), ["n1"]);
    cache.assume("p1", "n1", request("p1", 10_000)).landed(2);
    assert!(
        fits(&l, &cache).is_empty(),
        "landed beyond the replica: still assumed"
    );
}

/// Regression (e2e `binds_in_flight`, 1 of 61 binds refused under load): the scheduler had
/// chosen a node for the previous pod, whose bind had not reached the extender yet when the
/// next pod's filter ran.
#[test]
fn a_filtered_pod_is_assumed_on_every_feasible_node_until_its_bind_names_one() {
    let (l, cache) = (ledger(&["n1", "n2", "n3"]), InFlight::new());
    assert_eq!(fits(&l, &cache), ["n1", "n2", "n3"]);
    let _check = cache.feasible(&request("p1", 10_000), &["n1".into(), "n2".into()]);
    assert_eq!(
        fits(&l, &cache),
        ["n3"],
        "p1 may be bound to n1 or n2: neither has room for p2 as well, before its check answers"
    );
    cache.verified("p1", Some(request("p1", 10_000)));
    assert_eq!(
        fits(&l, &cache),
        ["n3"],
        "and once the API server confirmed it"
    );
    let bind = cache.assume_seen("p1", "n2").expect("filter saw p1");
    assert_eq!(fits(&l, &cache), ["n1", "n3"], "the bind named n2");
    assert!(
        cache.assume_seen("p1", "n1").is_none(),
        "a second bind finds nothing filtered"
    );
    // A later filter of p1 (the scheduler's retry) does not undo the bind under way.
    let _ = cache.feasible(&request("p1", 10_000), &["n1".into(), "n3".into()]);
    assert_eq!(fits(&l, &cache), ["n1", "n3"]);
    drop(bind);
    assert_eq!(fits(&l, &cache), ["n1", "n2", "n3"], "the bind failed");
    // A bind that finds no filtered request (another replica filtered it) assumes nothing.
    assert!(cache.assume_seen("p9", "n1").is_none());
    assert_eq!(fits(&l, &cache), ["n1", "n2", "n3"]);
}

#[test]
fn a_pod_feasible_on_many_nodes_is_assumed_only_once_its_bind_arrives() {
    let names: Vec<String> = (0..=TENTATIVE_NODES).map(|i| format!("n{i:02}")).collect();
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    let (l, cache) = (ledger(&refs), InFlight::new());
    let _check = cache.feasible(&request("p1", 10_000), &names);
    cache.verified("p1", Some(request("p1", 10_000)));
    assert_eq!(
        fits(&l, &cache),
        names,
        "too many nodes to count p1 on each"
    );
    let _bind = cache
        .assume_seen("p1", "n03")
        .expect("filter kept p1's request");
    let rest: Vec<&String> = names.iter().filter(|n| *n != "n03").collect();
    assert_eq!(
        fits(&l, &cache).iter().collect::<Vec<_>>(),
        rest,
        "the bind named n03"
    );
}

#[test]
fn a_filtered_pod_no_bind_follows_is_forgotten() {
    let (l, cache) = (ledger(&["n1", "n2"]), InFlight::new());
    let now = Instant::now();
    let _check = cache.feasible_at(&request("p1", 10_000), &["n1".into(), "n2".into()], now);
    cache.verified("p1", Some(request("p1", 10_000)));
    assert!(fits_at(&l, &cache, now + TENTATIVE_FOR / 2).is_empty());
    assert_eq!(
        fits_at(&l, &cache, now + TENTATIVE_FOR + Duration::from_millis(1)),
        ["n1", "n2"],
        "expired"
    );
    assert!(
        cache.assume_seen("p1", "n1").is_none(),
        "an expired assumption is not revived by a late bind"
    );
    // Filtered again and found nowhere feasible: it is going nowhere, so it holds nothing.
    let _check = cache.feasible(&request("p1", 10_000), &["n1".into()]);
    cache.verified("p1", Some(request("p1", 10_000)));
    assert_eq!(fits(&l, &cache), ["n2"]);
    let _ = cache.feasible(&request("p1", 10_000), &[]);
    assert_eq!(fits(&l, &cache), ["n1", "n2"]);
}

#[test]
fn the_cache_stays_bounded() {
    let (l, cache) = (ledger(&["n1"]), InFlight::new());
    let now = Instant::now();
    for i in 0..MAX_ENTRIES {
        let _ = cache.feasible_at(&request(&format!("old{i}"), 1), &["n1".into()], now);
    }
    let _ = cache.feasible_at(&request("p1", 10_000), &["n1".into()], now);
    assert_eq!(cache.lock().len(), MAX_ENTRIES, "full: p1 is not assumed");
    let later = now + TENTATIVE_FOR + Duration::from_millis(1);
    let _check = cache.feasible_at(&request("p1", 10_000), &["n1".into()], later);
    cache.verified("p1", Some(request("p1", 10_000)));
    assert_eq!(cache.lock().len(), 1, "the expired ones made room");
    assert!(fits_at(&l, &cache, later).is_empty());
}

/// Regression (issue 28): made-up `/filter` calls made a node refuse real pods for 15 s.
#[test]
fn a_made_up_pod_holds_nothing_once_checked_and_a_real_one_only_its_own_request() {
    let (l, cache) = (ledger(&["n1"]), InFlight::new());
    let check = cache.feasible(&request("junk", 10_000), &["n1".into()]);
    assert!(
        check.is_some(),
        "a filtered pod is checked against the API server"
    );
    assert!(
        fits(&l, &cache).is_empty(),
        "until its check answers, filter's request counts (the next pod's filter comes first)"
    );
    cache.verified("junk", None);
    drop(check);
    assert!(
        cache.lock().is_empty(),
        "the API server does not have it: forgotten"
    );
    assert_eq!(fits(&l, &cache), ["n1"], "and it holds nothing any more");
    assert!(
        cache.assume_seen("junk", "n1").is_none(),
        "nor does a bind find its JSON"
    );
    // A real pod whose filter JSON claims 10,000 MiB but asks for 1: it holds 1.
    let check = cache.feasible(&request("p1", 10_000), &["n1".into()]);
    cache.verified("p1", Some(request("p1", 1)));
    drop(check);
    assert_eq!(fits(&l, &cache), ["n1"], "counted with the pod's own 1 MiB");
    // Every check busy: a filtered pod counts with filter's request, for UNCHECKED_FOR only.
    let busy: Vec<Verify> = (0..MAX_VERIFYING)
        .filter_map(|i| cache.feasible(&request(&format!("q{i}"), 1), &["n1".into()]))
        .collect();
    assert_eq!(busy.len(), MAX_VERIFYING);
    drop(busy);
    for i in 0..MAX_VERIFYING {
        cache.verified(&format!("q{i}"), Some(request(&format!("q{i}"), 1)));
    }
    let _held: Vec<Verify> = (0..MAX_VERIFYING)
        .filter_map(|i| cache.feasible(&request(&format!("r{i}"), 1), &["n1".into()]))
        .collect();
    assert!(
        cache
            .feasible(&request("late", 10_000), &["n1".into()])
            .is_none(),
        "no check slot left"
    );
    let now = Instant::now();
    assert!(fits_at(&l, &cache, now).is_empty(), "late counts at once");
    assert_eq!(
        fits_at(&l, &cache, now + UNCHECKED_FOR + Duration::from_millis(1)),
        ["n1"],
        "and only for UNCHECKED_FOR"
    );
    assert_eq!(cache.unverified().get(), 2, "junk and late");
}

/// Regression (e2e `binds_in_flight` on a loaded control plane, 1 to 14 of 60 binds refused):
/// a bind that arrived before its filter's check answered found nothing it could take, and the
/// pod counted nowhere while the bind read it from the API server.
#[test]
fn a_bind_arriving_before_its_check_keeps_the_pod_counted() {
    let (l, cache) = (ledger(&["n1", "n2"]), InFlight::new());
    let check = cache.feasible(&request("p1", 10_000), &["n1".into(), "n2".into()]);
    assert!(check.is_some());
    assert!(fits(&l, &cache).is_empty(), "counted on both nodes");
    let bind = cache
        .assume_seen("p1", "n2")
        .expect("the bind takes filter's request until it has read the pod");
    assert_eq!(
        fits(&l, &cache),
        ["n1"],
        "counted on n2 alone, without a gap"
    );
    bind.confirm(request("p1", 1));
    assert_eq!(
        fits(&l, &cache),
        ["n1", "n2"],
        "with the pod's own request once the bind read it"
    );
    cache.verified("p1", None);
    assert_eq!(
        fits(&l, &cache),
        ["n1", "n2"],
        "a late check does not undo the bind"
    );
    drop(bind);
    drop(check);
}
