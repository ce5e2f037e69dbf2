use std::sync::Arc;
use std::sync::mpsc;
use std::time::Duration;

use tokio::sync::Semaphore;

use super::{heavy_thread, on_heavy_thread};

/// A heavy read on a thread of `heavy` that runs until its sender is dropped or sends.
async fn blocked_read(heavy: &Arc<Semaphore>) -> mpsc::Sender<()> {
    let (tx, rx) = mpsc::channel::<()>();
    let permit = heavy_thread(heavy).await.expect("a thread");
    tokio::spawn(on_heavy_thread(permit, move || rx.recv()));
    tx
}

#[tokio::test]
async fn heavy_reads_past_the_threads_wait_for_one_to_end() {
    // --heavy-read-threads=2, both busy.
    let heavy = Arc::new(Semaphore::new(2));
    let first = blocked_read(&heavy).await;
    let _second = blocked_read(&heavy).await;
    let third = tokio::time::timeout(Duration::from_millis(200), heavy_thread(&heavy)).await;
    assert!(third.is_err(), "a third read got a thread of two busy ones");
    // The first read ends: its thread goes to the next.
    first.send(()).expect("the first read runs");
    let third = tokio::time::timeout(Duration::from_secs(5), heavy_thread(&heavy)).await;
    assert!(matches!(third, Ok(Ok(_))), "a thread once one ended");
}
