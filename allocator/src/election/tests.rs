//! The lease as the leader sees it, on paused time: when it counts as lost, and how renewals
//! and the keeper's end move that; and what the keep-alive makes of each round. Campaigns and
//! the keep-alive against a real etcd are in `allocator/tests/` (leader_fencing,
//! graceful_handover).

use super::*;

const TTL: Duration = Duration::from_secs(3);

/// How long after `from` the lease's `lost()` resolves.
async fn lost_after(lease: &Lease, from: Instant) -> Duration {
    lease.lost().await;
    Instant::now() - from
}

#[tokio::test(start_paused = true)]
async fn an_unrenewed_lease_is_lost_at_its_deadline_and_not_before() {
    let t = Instant::now();
    let (_keeper, lease) = lease(t + TTL);
    tokio::time::sleep(TTL - Duration::from_millis(1)).await;
    assert!(lease.alive(), "valid until the deadline");
    assert_eq!(lease.remaining(), Duration::from_millis(1));
    assert_eq!(lost_after(&lease, t).await, TTL, "lost at the deadline");
    assert!(!lease.alive());
    assert_eq!(lease.remaining(), Duration::ZERO);
}

#[tokio::test(start_paused = true)]
async fn a_renewal_moves_the_loss_to_the_new_deadline() {
    let t = Instant::now();
    let (keeper, lease) = lease(t + TTL);
    let waiter = {
        let lease = lease.clone();
        tokio::spawn(async move { lost_after(&lease, t).await })
    };
    tokio::time::sleep(Duration::from_secs(2)).await;
    keeper.renew(Instant::now() + TTL);
    tokio::time::sleep(TTL - Duration::from_millis(1)).await;
    assert!(
        lease.alive(),
        "past the first deadline, valid until the renewed one"
    );
    assert_eq!(
        waiter.await.expect("the waiter ends"),
        Duration::from_secs(2) + TTL,
        "lost at the renewed deadline"
    );
}

#[tokio::test(start_paused = true)]
async fn a_shorter_renewal_brings_the_loss_forward() {
    // etcd may answer a keep-alive with less time left than the process assumed.
    let t = Instant::now();
    let (keeper, lease) = lease(t + Duration::from_secs(60));
    let waiter = {
        let lease = lease.clone();
        tokio::spawn(async move { lost_after(&lease, t).await })
    };
    tokio::time::sleep(Duration::from_secs(1)).await;
    keeper.renew(Instant::now() + TTL);
    assert_eq!(
        waiter.await.expect("the waiter ends"),
        Duration::from_secs(1) + TTL
    );
    assert!(!lease.alive());
}

#[tokio::test(start_paused = true)]
async fn a_lease_whose_keeper_ends_is_lost_at_once() {
    let t = Instant::now();
    let (keeper, lease) = lease(t + Duration::from_secs(3600));
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(1)).await;
        drop(keeper);
    });
    assert_eq!(
        lost_after(&lease, t).await,
        Duration::from_secs(1),
        "the keep-alive gave up: the lease is lost although its deadline is an hour away"
    );
    assert!(!lease.alive());
    let again = Instant::now();
    lease.lost().await;
    assert_eq!(Instant::now(), again, "and stays lost");
}

#[tokio::test(start_paused = true)]
async fn every_clone_of_a_lease_sees_each_renewal() {
    let t = Instant::now();
    let (keeper, lease) = lease(t + TTL);
    let other = lease.clone();
    keeper.renew(t + Duration::from_secs(10));
    assert_eq!(keeper.deadline(), t + Duration::from_secs(10));
    assert_eq!(lease.remaining(), Duration::from_secs(10));
    assert_eq!(other.remaining(), Duration::from_secs(10));
    tokio::time::sleep(TTL).await;
    assert!(other.alive(), "alive past the first deadline");
}

#[test]
fn a_keep_alive_renews_from_when_it_was_sent_not_answered() {
    let sent = Instant::now();
    let deadline = sent + TTL;
    let answered = sent + Duration::from_millis(900);
    assert_eq!(
        after_round(sent, Some(3), deadline, answered),
        Round::Renewed(sent + TTL),
        "etcd's 3 s count from the send: the answer's delay is not added"
    );
}

#[test]
fn a_keep_alive_answered_with_no_time_left_ends_the_lease() {
    let sent = Instant::now();
    assert_eq!(after_round(sent, Some(0), sent + TTL, sent), Round::Expired);
    assert_eq!(
        after_round(sent, Some(-1), sent + TTL, sent),
        Round::Expired
    );
}

#[test]
fn an_unanswered_keep_alive_retries_until_the_deadline_and_then_gives_up() {
    let sent = Instant::now();
    let deadline = sent + TTL;
    assert_eq!(
        after_round(sent, None, deadline, deadline - Duration::from_millis(1)),
        Round::Reopen
    );
    assert_eq!(after_round(sent, None, deadline, deadline), Round::Lost);
}
