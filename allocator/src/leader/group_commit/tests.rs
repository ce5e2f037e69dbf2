use super::*;

const MS: Duration = Duration::from_millis(1);

fn event(seq: u64) -> pb::Event {
    pb::Event {
        seq,
        epoch: 7,
        time_ms: 0,
        actor: None,
        body: Some(pb::event::Body::QuotaSet(pb::QuotaSet {
            namespace: "a".into(),
            mem_mib: seq,
            core_milli: 0,
        })),
    }
}

/// Waiter `w`'s command, writing the events `seqs` (none: answered from the state).
fn cmd(w: u32, seqs: &[u64], may_wait: bool) -> Decided<u32> {
    Decided {
        waiter: w,
        events: seqs.iter().copied().map(event).collect(),
        reply: Reply::Done { changed: true },
        seq: seqs.last().copied().unwrap_or(0),
        may_wait,
    }
}

fn urgent(w: u32, seq: u64) -> Decided<u32> {
    cmd(w, &[seq], false)
}

fn confirm(w: u32, seq: u64) -> Decided<u32> {
    cmd(w, &[seq], true)
}

/// What the policy asked for since the last call, in words: `launch 1-2` (seqs), `ack 3 4`
/// (waiters), `fail 5: why`, `wake +5ms` (after `t0`), `step down Fenced`.
fn said(p: &mut GroupCommit<u32>, t0: Instant) -> Vec<String> {
    let mut out = Vec::new();
    while let Some(a) = p.next_action() {
        out.push(match a {
            Action::Launch { batch, .. } => {
                assert_eq!(batch.epoch, 7);
                assert_eq!(batch.first_seq, batch.events[0].seq);
                let seqs: Vec<u64> = batch.events.iter().map(|e| e.seq).collect();
                assert!(seqs.windows(2).all(|w| w[1] == w[0] + 1), "{seqs:?}");
                format!("launch {}-{}", seqs[0], seqs[seqs.len() - 1])
            }
            Action::Ack(acks) => {
                let ws: Vec<String> = acks.iter().map(|a| a.waiter.to_string()).collect();
                format!("ack {}", ws.join(" "))
            }
            Action::Fail(ws, why) => {
                let ws: Vec<String> = ws.iter().map(u32::to_string).collect();
                format!("fail {}: {why}", ws.join(" "))
            }
            Action::WakeAt(t) => format!("wake +{}ms", (t - t0).as_millis()),
            Action::StepDown(r) => format!("step down {r:?}"),
        });
    }
    out
}

fn policy(limits: BatchLimits) -> (GroupCommit<u32>, Instant) {
    let t0 = Instant::now();
    (GroupCommit::new(limits, 7, t0), t0)
}

#[test]
fn only_confirmations_wait_and_only_for_the_linger() {
    let (mut p, t0) = policy(BatchLimits::default());
    p.tick(t0, true);
    assert!(
        said(&mut p, t0).is_empty(),
        "an empty batch has nothing to write"
    );

    p.decided(t0, confirm(1, 1));
    p.tick(t0, true);
    assert_eq!(
        said(&mut p, t0),
        ["wake +5ms"],
        "nobody waits on a confirmation"
    );
    p.tick(t0 + 4 * MS, true);
    assert_eq!(said(&mut p, t0), ["wake +5ms"]);
    p.tick(t0 + 5 * MS, true);
    assert_eq!(said(&mut p, t0), ["launch 1-1"]);
    p.committed(t0 + 6 * MS);
    assert_eq!(said(&mut p, t0), ["ack 1"]);

    // Someone waits for an event of the batch: it goes at once, confirmations with it.
    p.decided(t0 + 6 * MS, confirm(2, 2));
    p.decided(t0 + 6 * MS, urgent(3, 3));
    p.tick(t0 + 6 * MS, true);
    assert_eq!(said(&mut p, t0), ["launch 2-3"]);
}

#[test]
fn a_full_batch_goes_at_once_and_takes_no_more_requests() {
    let limits = BatchLimits {
        max_events: 3,
        ..BatchLimits::default()
    };
    let (mut p, t0) = policy(limits);
    for (w, seq) in [(1, 1), (2, 2)] {
        p.decided(t0, confirm(w, seq));
        assert!(p.accepting());
    }
    p.decided(t0, confirm(3, 3));
    assert!(!p.accepting(), "full: requests wait in the inbox");
    p.tick(t0, true);
    assert_eq!(said(&mut p, t0), ["launch 1-3"]);
    assert!(p.accepting(), "the next batch fills while this one flies");

    // Full by bytes: one event bigger than the limit.
    let by_bytes = BatchLimits {
        max_bytes: 8,
        ..BatchLimits::default()
    };
    let (mut p, t0) = policy(by_bytes);
    p.decided(t0, confirm(1, 1));
    assert!(!p.accepting());
    p.tick(t0, true);
    assert_eq!(said(&mut p, t0), ["launch 1-1"]);
}

#[test]
fn one_transaction_flies_and_answers_wait_for_every_batch_before_them() {
    let (mut p, t0) = policy(BatchLimits::default());
    p.decided(t0, urgent(1, 1));
    p.tick(t0, true);
    assert_eq!(said(&mut p, t0), ["launch 1-1"]);
    assert_eq!(p.in_flight_waiters(), 1);
    p.decided(t0, urgent(2, 2));
    // Answered from a state that holds the write in flight: it must not be acked before it.
    p.decided(t0, cmd(3, &[], false));
    p.tick(t0 + MS, true);
    assert!(said(&mut p, t0).is_empty(), "one transaction in flight");
    assert!(!p.idle());
    p.committed(t0 + 2 * MS);
    assert_eq!(said(&mut p, t0), ["ack 1"]);
    p.tick(t0 + 2 * MS, true);
    assert_eq!(said(&mut p, t0), ["launch 2-2"]);
    p.committed(t0 + 3 * MS);
    assert_eq!(said(&mut p, t0), ["ack 2 3"], "in decision order");
    assert!(p.idle());

    // With nothing in flight, an answer from the state goes at once.
    p.decided(t0 + 4 * MS, cmd(4, &[], false));
    p.tick(t0 + 4 * MS, true);
    assert_eq!(said(&mut p, t0), ["ack 4"]);
}

#[test]
fn only_a_loaded_sequencer_holds_a_batch_and_only_for_the_load_linger() {
    let limits = BatchLimits {
        load_linger: 2 * MS,
        max_events: 20,
        ..BatchLimits::default()
    };
    let commit_of = |waiters: u32| {
        let (mut p, t0) = policy(limits);
        for w in 1..=waiters {
            p.decided(t0, urgent(w, u64::from(w)));
        }
        p.tick(t0, true);
        assert_eq!(said(&mut p, t0), [format!("launch 1-{waiters}")]);
        p.committed(t0 + 10 * MS);
        said(&mut p, t0);
        p.decided(t0 + 10 * MS, urgent(100, u64::from(waiters) + 1));
        p.tick(t0 + 10 * MS, true);
        (p, t0)
    };
    let (mut light, t0) = commit_of(LOAD_WAITERS as u32 - 1);
    assert_eq!(
        said(&mut light, t0),
        [format!("launch {0}-{0}", LOAD_WAITERS)],
        "a lightly loaded leader never delays a write"
    );
    let (mut loaded, t0) = commit_of(LOAD_WAITERS as u32);
    assert_eq!(said(&mut loaded, t0), ["wake +12ms"]);
    loaded.tick(t0 + 12 * MS, true);
    assert_eq!(said(&mut loaded, t0), ["launch 9-9"]);

    let off = BatchLimits {
        max_events: 20,
        ..BatchLimits::default()
    };
    let (mut p, t0) = policy(off);
    for w in 1..=16 {
        p.decided(t0, urgent(w, u64::from(w)));
    }
    p.tick(t0, true);
    p.committed(t0 + MS);
    said(&mut p, t0);
    p.decided(t0 + MS, urgent(17, 17));
    p.tick(t0 + MS, true);
    assert_eq!(
        said(&mut p, t0),
        ["launch 17-17"],
        "no load linger configured"
    );
}

#[test]
fn a_fenced_write_fails_its_waiters_and_everything_pending_then_steps_down() {
    let (mut p, t0) = policy(BatchLimits::default());
    p.decided(t0, urgent(1, 1));
    p.tick(t0, true);
    said(&mut p, t0);
    p.decided(t0, urgent(2, 2));
    p.fenced();
    assert_eq!(
        said(&mut p, t0),
        [
            format!("fail 1: {FENCED}"),
            format!("fail 2: {LOST}"),
            "step down Fenced".into()
        ]
    );
    assert!(p.stopping() && !p.accepting());
    p.tick(t0 + MS, true);
    p.stop(StepDown::Shutdown);
    assert!(said(&mut p, t0).is_empty(), "leadership ends once");
}

#[test]
fn an_etcd_error_leaves_the_outcome_unknown() {
    let (mut p, t0) = policy(BatchLimits::default());
    p.decided(t0, urgent(1, 1));
    p.tick(t0, true);
    said(&mut p, t0);
    p.failed(LogError::Timeout(Duration::from_secs(2)));
    let out = said(&mut p, t0);
    assert_eq!(out[0], format!("fail 1: {UNKNOWN}"));
    assert!(out[1].starts_with("step down Etcd(Timeout"), "{out:?}");
}

#[test]
fn leadership_lost_with_a_write_in_flight_waits_for_its_outcome() {
    for (outcome, answer) in [
        ("committed", "ack 1".to_string()),
        ("failed", format!("fail 1: {STOPPED_IN_FLIGHT}")),
        ("fenced", format!("fail 1: {STOPPED_IN_FLIGHT}")),
    ] {
        let (mut p, t0) = policy(BatchLimits::default());
        p.decided(t0, urgent(1, 1));
        p.tick(t0, true);
        said(&mut p, t0);
        p.decided(t0, urgent(2, 2));
        p.stop(StepDown::LeaseLost);
        assert_eq!(
            said(&mut p, t0),
            [format!("fail 2: {LOST}")],
            "pending fails at once; the write in flight may still commit"
        );
        assert!(!p.accepting());
        match outcome {
            "committed" => p.committed(t0 + MS),
            "failed" => p.failed(LogError::Timeout(Duration::from_secs(2))),
            _ => p.fenced(),
        }
        assert_eq!(
            said(&mut p, t0),
            [answer, "step down LeaseLost".to_string()],
            "{outcome}: the first reason stands"
        );
    }
}

#[test]
fn an_expired_lease_launches_nothing() {
    let (mut p, t0) = policy(BatchLimits::default());
    p.decided(t0, urgent(1, 1));
    p.decided(t0, confirm(2, 2));
    p.tick(t0, false);
    assert_eq!(
        said(&mut p, t0),
        [
            format!("fail 1 2: {LEASE_EXPIRED}"),
            "step down LeaseLost".into()
        ]
    );
}

#[test]
fn a_bug_or_shutdown_with_nothing_in_flight_steps_down_at_once() {
    let (mut p, t0) = policy(BatchLimits::default());
    p.decided(t0, confirm(1, 1));
    p.stop(StepDown::Bug("broken".into()));
    assert_eq!(
        said(&mut p, t0),
        [
            format!("fail 1: {LOST}"),
            "step down Bug(\"broken\")".into()
        ]
    );
}

#[test]
fn a_batch_etcd_refused_for_space_fails_with_what_followed_and_leadership_goes_on() {
    let (mut p, t0) = policy(BatchLimits::default());
    p.decided(t0, urgent(1, 1));
    p.tick(t0, true);
    assert_eq!(said(&mut p, t0), ["launch 1-1"]);
    // Decided on top of the batch in flight.
    p.decided(t0, urgent(2, 2));
    p.refused("no space");
    assert_eq!(said(&mut p, t0), ["fail 1: no space", "fail 2: no space"]);
    assert!(!p.stopping(), "a refused batch does not end the leadership");
    assert!(p.idle(), "nothing in flight, nothing pending");
    // The next request, decided again from the committed state, goes out as usual.
    p.decided(t0 + MS, urgent(3, 1));
    p.tick(t0 + MS, true);
    assert_eq!(said(&mut p, t0), ["launch 1-1"]);
    p.committed(t0 + 2 * MS);
    assert_eq!(said(&mut p, t0), ["ack 3"]);
}
