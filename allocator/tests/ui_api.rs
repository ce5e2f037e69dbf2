//! The JSON behind `/ui` on a real allocator: `/api/v1/state` holds the ledger's nodes, GPUs,
//! health and pods; `/api/v1/events` the latest events, newest first; bad query strings get a
//! 400 that says what is wrong.

use std::time::Duration;

use gpuledger_proto::allocator::v1 as api;
use gpuledger_testkit::http::get;
use gpuledger_testkit::workload::{inventory, pod};
use gpuledger_testkit::{Allocators, EtcdCluster};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn state_and_events_json() -> anyhow::Result<()> {
    let etcd = EtcdCluster::start(1).await?;
    let dir = tempfile::tempdir()?;
    let allocs = Allocators::start(dir.path(), &etcd.endpoints_flag(), 1, "uiapi", &[])?;
    allocs.wait_leader(Duration::from_secs(20)).await?;
    let http = &allocs.http[0];
    let mut c = allocs.client(0)?;
    c.register_node(api::RegisterNodeRequest {
        inventory: Some(inventory("n1", 2, 16_000, "T4")),
    })
    .await?;
    c.set_device_health(api::SetDeviceHealthRequest {
        node: "n1".into(),
        gpu_uuid: "GPU-n1-1".into(),
        healthy: false,
        reason: "uncorrectable ECC".into(),
        xid: 48,
    })
    .await?;
    let r = c
        .reserve(api::ReserveRequest {
            request: Some(pod("p1", 5_000, 25)),
            node: "n1".into(),
            ttl_ms: 0,
        })
        .await?
        .into_inner();
    let id = r.allocations[0].id;

    let (code, state) = get(&format!("http://{http}/api/v1/state")).await?;
    assert_eq!(code, 200, "{state}");
    assert!(
        state.starts_with(r#"{"replica":"alloc0","role":"leader","#),
        "{state}"
    );
    assert!(
        state.contains(&format!(r#""epoch":{},"seq":{}"#, r.epoch, r.seq)),
        "{state}"
    );
    // GPU 1 is unhealthy (healthy = 0), so the pod is on GPU 0, the only holder: allocs[0].
    assert!(
        state.contains(
            r#""nodes":[["n1",[[0,"GPU-n1-0",0,16000,5000,250,1,[0]],[1,"GPU-n1-1",0,16000,0,0,0,[]]]]]"#
        ),
        "{state}"
    );
    assert!(state.contains(r#""models":["T4"]"#), "{state}");
    assert!(
        state.contains(&format!(
            r#""allocs":[[{id},"default/pod-p1","main","r",5000,250]]"#
        )),
        "{state}"
    );

    let (code, ev) = get(&format!("http://{http}/api/v1/events?limit=2")).await?;
    assert_eq!(code, 200, "{ev}");
    let head = format!(r#"{{"seq":{},"events":[[{},"#, r.seq, r.seq);
    assert!(ev.starts_with(&head), "newest event first: {ev}");
    assert_eq!(ev.matches("],[").count(), 1, "two events: {ev}");
    assert!(ev.contains(r#""reserved","n1","#), "{ev}");
    assert!(
        ev.contains(
            r#""device_health_changed","n1","GPU-n1-1 UNHEALTHY: uncorrectable ECC (Xid 48)"]"#
        ),
        "{ev}"
    );
    let (_, all) = get(&format!("http://{http}/api/v1/events")).await?;
    assert_eq!(
        all.matches("],[").count() + 1,
        r.seq as usize,
        "every event when fewer than the default 50: {all}"
    );

    for (q, why) in [
        (
            "/api/v1/events?limit=0",
            "limit must be from 1 to 1000, got 0",
        ),
        (
            "/api/v1/events?limit=5000",
            "limit must be from 1 to 1000, got 5000",
        ),
        ("/api/v1/events?limit=ten", "limit must be a whole number"),
        ("/api/v1/events?limt=3", "unknown query parameter \"limt\""),
        ("/api/v1/state?node=n1", "takes no query parameters"),
    ] {
        let (code, body) = get(&format!("http://{http}{q}")).await?;
        assert_eq!(code, 400, "{q}: {body}");
        assert!(body.contains(why), "{q}: {body}");
    }

    let (code, page) = get(&format!("http://{http}/ui")).await?;
    assert_eq!(code, 200);
    assert!(page.contains("<title>gpuledger"), "{page}");
    assert!(
        page.contains("/api/v1/state"),
        "the page reads the state API"
    );
    Ok(())
}
