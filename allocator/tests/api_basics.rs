//! The allocator API against a real etcd: grants, idempotency, forwarding, bad input.

use std::time::{Duration, Instant};

use gpuledger_proto::allocator::v1 as api;
use gpuledger_testkit::workload::{inventory, pod, reserve_retry};
use gpuledger_testkit::{Allocators, EtcdCluster};
use tonic::Code;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grants_are_idempotent_forwarded_and_bad_input_writes_nothing() -> anyhow::Result<()> {
    let etcd = EtcdCluster::start(1).await?;
    let dir = tempfile::tempdir()?;
    let allocs = Allocators::start(dir.path(), &etcd.endpoints_flag(), 2, "t", &[])?;
    let leader = allocs.wait_leader(Duration::from_secs(20)).await?;
    let follower = 1 - leader;
    // Writes sent to the follower are forwarded to the leader.
    let mut f = allocs.client(follower)?;
    f.register_node(api::RegisterNodeRequest {
        inventory: Some(inventory("n1", 2, 16_000, "NVIDIA A100")),
    })
    .await?;
    let req = api::ReserveRequest {
        request: Some(pod("uid-1", 6_000, 30)),
        node: "n1".into(),
        ttl_ms: 0,
    };
    let first = f.reserve(req.clone()).await?.into_inner();
    assert!(first.created);
    assert_eq!(first.allocations.len(), 1);
    assert_eq!(first.allocations[0].shares[0].mem_mib, 6_000);
    // The same request again, through the leader this time: the same grant, nothing new.
    let again = allocs
        .client(leader)?
        .reserve(req.clone())
        .await?
        .into_inner();
    assert!(!again.created);
    assert_eq!(again.allocations, first.allocations);

    let seq = allocs.status(leader).await.expect("leader answers").seq;
    let bad = |pod_req: Option<api::PodRequest>, node: &str| api::ReserveRequest {
        request: pod_req,
        node: node.into(),
        ttl_ms: 0,
    };
    let unknown = f
        .reserve(bad(Some(pod("uid-2", 1_000, 0)), "nope"))
        .await
        .expect_err("unknown node");
    assert_eq!(unknown.code(), Code::NotFound, "{unknown:?}");
    assert!(unknown.message().contains("nope"), "{}", unknown.message());
    let huge = f
        .reserve(bad(Some(pod("uid-2", 999_999, 0)), "n1"))
        .await
        .expect_err("too big");
    assert_eq!(huge.code(), Code::FailedPrecondition, "{huge:?}");
    assert!(huge.message().contains("largest GPU"), "{}", huge.message());
    let malformed = f.reserve(bad(None, "n1")).await.expect_err("malformed");
    assert_eq!(malformed.code(), Code::InvalidArgument);
    let mut zero = pod("uid-3", 1_000, 0);
    zero.containers[0].slices = 0;
    let zero = f
        .reserve(bad(Some(zero), "n1"))
        .await
        .expect_err("zero slices");
    assert_eq!(zero.code(), Code::InvalidArgument);
    let mut core = pod("uid-4", 1_000, 0);
    core.containers[0].core_milli = 1500;
    assert_eq!(
        f.reserve(bad(Some(core), "n1"))
            .await
            .expect_err("core")
            .code(),
        Code::InvalidArgument
    );
    assert_eq!(
        allocs.status(leader).await.expect("leader").seq,
        seq,
        "refused requests wrote nothing"
    );

    // Filter explains; a full GPU set says wait, an oversized request says never.
    let filt = f
        .filter(api::FilterRequest {
            request: Some(pod("uid-5", 12_000, 0)),
            nodes: vec!["n1".into(), "ghost".into()],
        })
        .await?
        .into_inner();
    assert_eq!(filt.nodes, vec!["n1".to_string()], "{filt:?}");
    assert!(filt.unresolvable.contains_key("ghost"));
    let filt = f
        .filter(api::FilterRequest {
            request: Some(pod("uid-5", 20_000, 0)),
            nodes: vec!["n1".into()],
        })
        .await?
        .into_inner();
    assert!(filt.unresolvable["n1"].contains("largest GPU"), "{filt:?}");

    // Release and reserve again: a new allocation id.
    f.release(api::ReleaseRequest {
        pod_uid: "uid-1".into(),
        ..Default::default()
    })
    .await?;
    let (third, _) = reserve_retry(
        &allocs.addrs,
        0,
        req,
        Instant::now() + Duration::from_secs(5),
    )
    .await?;
    assert!(third.created);
    assert_ne!(third.allocations[0].id, first.allocations[0].id);
    let st = allocs.status(follower).await.expect("follower");
    assert_eq!(st.role, "follower");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fails_closed_without_etcd() -> anyhow::Result<()> {
    let mut etcd = EtcdCluster::start(1).await?;
    let dir = tempfile::tempdir()?;
    let allocs = Allocators::start(dir.path(), &etcd.endpoints_flag(), 1, "t", &[])?;
    allocs.wait_leader(Duration::from_secs(20)).await?;
    let mut c = allocs.client(0)?;
    c.register_node(api::RegisterNodeRequest {
        inventory: Some(inventory("n1", 1, 16_000, "T4")),
    })
    .await?;
    etcd.kill(0);
    let deadline = Instant::now() + Duration::from_secs(10);
    // Within a few seconds the replica stops granting and says why.
    let err = loop {
        let r = c
            .reserve(api::ReserveRequest {
                request: Some(pod("uid-x", 1_000, 0)),
                node: "n1".into(),
                ttl_ms: 0,
            })
            .await;
        match r {
            Err(s) if s.code() == Code::Unavailable => break s,
            _ if Instant::now() > deadline => panic!("still granting 10 s after etcd died: {r:?}"),
            _ => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    };
    assert!(!err.message().is_empty());
    let filt = loop {
        let f = c
            .filter(api::FilterRequest {
                request: Some(pod("uid-y", 1_000, 0)),
                nodes: vec![],
            })
            .await;
        match f {
            Err(s) => break s,
            Ok(_) if Instant::now() > deadline => {
                panic!("filter still answers 10 s after etcd died")
            }
            Ok(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    };
    assert!(
        filt.message().contains("ledger unavailable"),
        "{}",
        filt.message()
    );
    // etcd back: grants resume by themselves.
    etcd.restart(0)?;
    let (r, _) = reserve_retry(
        &allocs.addrs,
        0,
        api::ReserveRequest {
            request: Some(pod("uid-z", 1_000, 0)),
            node: "n1".into(),
            ttl_ms: 0,
        },
        Instant::now() + Duration::from_secs(30),
    )
    .await?;
    assert!(r.created);
    Ok(())
}
