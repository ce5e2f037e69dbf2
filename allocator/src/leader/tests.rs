//! The shell around the policy, on an in-memory log and paused time: linger, fencing, lease
//! loss, etcd errors and shutdown as the waiters and the log see them. The same behaviours
//! against a real etcd are in `allocator/tests/` (leader_fencing, no_lost_grant, ...).

use gpuledger_ledger::Reply;
use gpuledger_ops::clock::TestClock;
use gpuledger_testkit::workload::{inventory, pod};
use tokio::task::JoinHandle;

use super::*;
use crate::election::{LeaseKeeper, lease};
use crate::log::memory::MemLog;
use crate::writer::{self, Writer};

const START_MS: i64 = 1_700_000_000_000;

struct Rig {
    shared: Arc<Shared>,
    writer: Writer,
    log: MemLog,
    keeper: LeaseKeeper,
    stop: CancellationToken,
    leader: JoinHandle<StepDown>,
}

/// A leader on a fresh in-memory log, leading already, with a lease good for `lease_for`.
async fn lead(limits: BatchLimits, lease_for: Duration) -> Rig {
    let clock = Arc::new(TestClock::new(START_MS));
    let shared = Shared::with_clock("r1".into(), "127.0.0.1:1".into(), clock);
    let log = MemLog::new();
    let (keeper, lease) = lease(Instant::now() + lease_for);
    let stop = CancellationToken::new();
    let stopped = stop.clone();
    let (writer, inbox) = writer::channel(shared.actor());
    let l = Leader {
        shared: shared.clone(),
        inbox,
        log: log.clone(),
        fence: log.elect("election/r1"),
        limits,
        snapshot_every: 0,
        archive: None,
    };
    let leader = tokio::spawn(async move { l.run(&lease, stopped).await });
    let mut role = shared.role.subscribe();
    role.wait_for(|r| r.role == Role::Leader)
        .await
        .expect("the leader starts");
    Rig {
        shared,
        writer,
        log,
        keeper,
        stop,
        leader,
    }
}

/// Hand `cmd` to the sequencer; the answer comes on the returned channel.
async fn submit(writer: &Writer, cmd: Command) -> oneshot::Receiver<Result<Committed, WriteError>> {
    writer
        .send(cmd, pb::Actor::default())
        .await
        .unwrap_or_else(|e| panic!("the sequencer takes requests: {e}"))
}

async fn write(writer: &Writer, cmd: Command) -> Result<Committed, WriteError> {
    submit(writer, cmd).await.await.expect("an answer")
}

fn node() -> Command {
    Command::RegisterNode(inventory("n1", 2, 40_000, "A100"))
}

fn reserve(uid: &str) -> Command {
    Command::Reserve {
        request: crate::service::pod_request(Some(pod(uid, 1_000, 0))).expect("a valid request"),
        node: "n1".into(),
        deadline_ms: START_MS + 60_000,
    }
}

fn confirm(uid: &str) -> Command {
    Command::ConfirmBound {
        pod_uid: uid.into(),
        node: "n1".into(),
        reason: "test".into(),
    }
}

fn unavailable(r: Result<Committed, WriteError>) -> String {
    match r {
        Err(WriteError::Unavailable(why)) => why,
        other => panic!("expected Unavailable, got {other:?}"),
    }
}

#[tokio::test(start_paused = true)]
async fn a_lone_confirmation_lingers_and_a_reservation_does_not() {
    let origin = Instant::now();
    let rig = lead(BatchLimits::default(), Duration::from_secs(3600)).await;
    write(&rig.writer, node()).await.expect("registered");

    let t = Instant::now();
    let r = write(&rig.writer, reserve("p1")).await.expect("reserved");
    assert!(matches!(r.reply, Reply::Reserved { created: true, .. }));
    let at = *rig.log.appended_at().last().expect("appended");
    assert_eq!(at - t, Duration::ZERO, "someone waits: no linger");

    tokio::time::sleep(Duration::from_millis(40)).await;
    let t = Instant::now();
    write(&rig.writer, confirm("p1")).await.expect("confirmed");
    let at = *rig.log.appended_at().last().expect("appended");
    assert_eq!(at - t, BatchLimits::default().confirm_linger);

    // Every event is stamped by the injected clock (which moved with the paused time).
    let batches = rig.log.batches();
    let bound = batches
        .last()
        .and_then(|b| b.events.last())
        .expect("an event");
    assert_eq!(
        bound.time_ms,
        START_MS + (t - origin).as_millis() as i64,
        "stamped when decided, by a wall clock that moved with the paused time"
    );
    assert!(t - origin >= Duration::from_millis(40));
    assert_eq!(rig.shared.seq(), bound.seq, "folded before the ack");
}

#[tokio::test(start_paused = true)]
async fn a_deposed_leader_acks_nothing_and_steps_down() {
    let rig = lead(BatchLimits::default(), Duration::from_secs(3600)).await;
    write(&rig.writer, node()).await.expect("registered");
    let seq = rig.shared.seq();
    rig.log.set_latency(Duration::from_millis(10));
    let pending = submit(&rig.writer, reserve("p1")).await;
    tokio::time::sleep(Duration::from_millis(1)).await;
    // Another replica takes over while the write flies.
    rig.log.depose();
    let why = unavailable(pending.await.expect("an answer"));
    assert!(why.contains("before the write committed"), "{why}");
    assert!(matches!(rig.leader.await.expect("joins"), StepDown::Fenced));
    assert_eq!(rig.shared.seq(), seq, "nothing folded");
    assert!(
        !rig.writer.leading(),
        "no request reaches a deposed sequencer"
    );
    assert!(
        matches!(rig.writer.submit(node()).await, Err(WriteError::NotLeader)),
        "a deposed sequencer takes no write"
    );
}

#[tokio::test(start_paused = true)]
async fn a_lost_lease_ends_leadership_when_it_expires_and_fails_what_waits() {
    let limits = BatchLimits {
        confirm_linger: Duration::from_secs(60),
        ..BatchLimits::default()
    };
    let rig = lead(limits, Duration::from_secs(3)).await;
    let t = Instant::now();
    write(&rig.writer, node()).await.expect("registered");
    write(&rig.writer, reserve("p1")).await.expect("reserved");
    // Renewed once: leadership outlives the first deadline.
    rig.keeper.renew(t + Duration::from_secs(5));
    let waiting = submit(&rig.writer, confirm("p1")).await;
    let written = rig.log.batches().len();
    let why = unavailable(waiting.await.expect("an answer"));
    assert_eq!(why, "leadership lost; retry");
    assert_eq!(
        Instant::now() - t,
        Duration::from_secs(5),
        "at the deadline"
    );
    assert!(matches!(
        rig.leader.await.expect("joins"),
        StepDown::LeaseLost
    ));
    assert_eq!(rig.log.batches().len(), written, "nothing written after");
}

#[tokio::test(start_paused = true)]
async fn an_etcd_error_steps_down_with_the_outcome_unknown() {
    let rig = lead(BatchLimits::default(), Duration::from_secs(3600)).await;
    write(&rig.writer, node()).await.expect("registered");
    rig.log.set_failing(true);
    let why = unavailable(write(&rig.writer, reserve("p1")).await);
    assert!(why.contains("outcome is unknown"), "{why}");
    assert!(matches!(
        rig.leader.await.expect("joins"),
        StepDown::Etcd(LogError::Timeout(_))
    ));
}

#[tokio::test(start_paused = true)]
async fn shutdown_lets_the_write_in_flight_finish_and_acks_it() {
    let rig = lead(BatchLimits::default(), Duration::from_secs(3600)).await;
    write(&rig.writer, node()).await.expect("registered");
    rig.log.set_latency(Duration::from_millis(50));
    let pending = submit(&rig.writer, reserve("p1")).await;
    tokio::time::sleep(Duration::from_millis(1)).await;
    rig.stop.cancel();
    let acked = pending
        .await
        .expect("an answer")
        .expect("committed during the grace");
    assert_eq!(rig.shared.seq(), acked.seq);
    assert!(matches!(
        rig.leader.await.expect("joins"),
        StepDown::Shutdown
    ));
}
