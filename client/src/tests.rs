use std::sync::Mutex;

use gpuledger_auth::CredentialArgs;

use super::*;

/// Connections (never opened: the calls below answer without them) to `n` replicas.
fn allocators(n: usize) -> (tempfile::TempDir, Allocators) {
    let dir = tempfile::tempdir().expect("a temp dir");
    let ca = dir.path().join("ca.pem");
    gpuledger_auth::pki::Ca::new("test")
        .expect("a CA")
        .write(&ca)
        .expect("written");
    let token = dir.path().join("token");
    std::fs::write(&token, "t").expect("written");
    let creds = Credentials::load(&CredentialArgs {
        ca: Some(ca),
        token_file: Some(token),
        ..Default::default()
    })
    .expect("credentials");
    let addrs: Vec<String> = (0..n).map(|i| format!("127.0.0.1:{}", 1 + i)).collect();
    let a = Allocators::new(&addrs, &creds, &Options::default()).expect("addresses");
    (dir, a)
}

/// Answer attempt k with `script(k)`, recording how many attempts were made.
async fn call_with(
    a: &Allocators,
    budget: Duration,
    script: impl Fn(usize) -> Result<u32, Status>,
) -> (Result<u32, Status>, usize) {
    let attempts = Mutex::new(0usize);
    let r = a
        .call("Test", budget, |_client| {
            let k = {
                let mut n = attempts.lock().expect("not poisoned");
                *n += 1;
                *n - 1
            };
            let answer = script(k).map(tonic::Response::new);
            async move { answer }
        })
        .await;
    let n = *attempts.lock().expect("not poisoned");
    (r, n)
}

#[test]
fn only_a_replica_that_cannot_answer_now_is_worth_another_try() {
    for code in [
        Code::Unavailable,
        Code::DeadlineExceeded,
        Code::Cancelled,
        Code::Unknown,
        Code::Aborted,
    ] {
        assert!(is_retryable(&Status::new(code, "")), "{code:?}");
    }
    for code in [
        Code::InvalidArgument,
        Code::NotFound,
        Code::AlreadyExists,
        Code::PermissionDenied,
        Code::Unauthenticated,
        Code::ResourceExhausted,
        Code::FailedPrecondition,
        Code::Internal,
    ] {
        assert!(!is_retryable(&Status::new(code, "")), "{code:?}");
    }
}

#[tokio::test]
async fn a_call_moves_on_to_the_next_replica_and_starts_there_next_time() {
    let (_dir, a) = allocators(3);
    let (r, n) = call_with(&a, Duration::ZERO, |k| match k {
        0 => Err(Status::unavailable("down")),
        _ => Ok(7),
    })
    .await;
    assert_eq!((r.expect("answered"), n), (7, 2));
    // The replica that answered is asked first: it answers at once.
    let (r, n) = call_with(&a, Duration::ZERO, |k| match k {
        0 => Ok(8),
        _ => Err(Status::internal("asked the wrong replica")),
    })
    .await;
    assert_eq!((r.expect("answered"), n), (8, 1));
    // Another handle starts where it is told to.
    let (_, n) = call_with(&a.starting_at(0), Duration::ZERO, |k| match k {
        0 => Err(Status::unavailable("down")),
        _ => Ok(9),
    })
    .await;
    assert_eq!(n, 2);
}

#[tokio::test]
async fn the_allocators_answer_is_returned_as_it_is() {
    let (_dir, a) = allocators(3);
    let (r, n) = call_with(&a, Duration::from_secs(5), |_| {
        Err(Status::failed_precondition("no such node"))
    })
    .await;
    let s = r.expect_err("refused");
    assert_eq!(
        (s.code(), s.message(), n),
        (Code::FailedPrecondition, "no such node", 1)
    );
}

#[tokio::test]
async fn without_a_budget_one_round_then_ledger_unavailable_naming_each_replica() {
    let (_dir, a) = allocators(2);
    let (r, n) = call_with(&a, Duration::ZERO, |k| {
        Err(Status::unavailable(format!("refused {k}")))
    })
    .await;
    let s = r.expect_err("nobody answered");
    assert_eq!((s.code(), n), (Code::Unavailable, 2));
    assert_eq!(
        s.message(),
        "gpuledger ledger unavailable: no allocator replica answered \
         (127.0.0.1:1: refused 0; 127.0.0.1:2: refused 1)"
    );
    // A replica that says the ledger is unavailable is quoted, not wrapped again.
    let (r, _) = call_with(&a, Duration::ZERO, |_| {
        Err(Status::unavailable("ledger unavailable: etcd is down"))
    })
    .await;
    let s = r.expect_err("nobody answered");
    assert!(
        s.message().starts_with("gpuledger 127.0.0.1:")
            && s.message().matches("ledger unavailable").count() == 2,
        "{}",
        s.message()
    );
}

#[tokio::test(start_paused = true)]
async fn rounds_repeat_with_growing_pauses_until_the_budget_is_spent() {
    let (_dir, a) = allocators(2);
    let t0 = Instant::now();
    // Down for the first three rounds.
    let (r, n) = call_with(&a, Duration::from_secs(10), |k| {
        if k < 6 {
            Err(Status::unavailable("down"))
        } else {
            Ok(1)
        }
    })
    .await;
    assert_eq!((r.expect("answered"), n), (1, 7));
    assert_eq!(
        t0.elapsed(),
        Duration::from_millis(20 + 40 + 80),
        "20 ms, doubling"
    );
    // Never up: the budget ends it, not a pause past it.
    let t0 = Instant::now();
    let (r, n) = call_with(&a, Duration::from_millis(1000), |_| {
        Err(Status::unavailable("down"))
    })
    .await;
    assert!(r.is_err());
    assert_eq!(t0.elapsed(), Duration::from_millis(1000));
    // 20 + 40 + 80 + 160 + 320 = 620 ms, then 380 ms of the budget left: seven rounds.
    assert_eq!(n, 14);
}
