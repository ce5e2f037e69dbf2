//! etcd out of space is an operating state: against a real etcd with a small quota filled until
//! it raises its NOSPACE alarm, the leader keeps its lease and serves reads, a write is refused
//! saying etcd is out of space and changes nothing, `/readyz`, the metric and `gpuledger
//! status` say so (status with the way out), and once an operator compacts, defragments and
//! disarms, writes resume by themselves.

use std::time::Duration;

use etcd_client::{AlarmAction, AlarmOptions, AlarmType, CompactionOptions, DeleteOptions};
use gpuledger_auth::identity::Role;
use gpuledger_proto::allocator::v1 as api;
use gpuledger_testkit::pki::credential_flags;
use gpuledger_testkit::workload::{inventory, pod};
use gpuledger_testkit::{Allocators, EtcdCluster, bin_path};
use tonic::Code;

use crate::support::wait_until;

/// etcd's quota in the test: small enough to fill in a second.
const QUOTA: &str = "--quota-backend-bytes=16777216";

fn reserve(uid: &str) -> api::ReserveRequest {
    api::ReserveRequest {
        request: Some(pod(uid, 1_000, 10)),
        node: "n1".into(),
        ttl_ms: 0,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_etcd_is_an_operating_state_and_writes_resume_after_recovery() -> anyhow::Result<()>
{
    let etcd = EtcdCluster::start_with_flags(1, &[QUOTA]).await?;
    let dir = tempfile::tempdir()?;
    let allocs = Allocators::start(dir.path(), &etcd, 1, "nospace", &[])?;
    let leader = allocs.wait_leader(Duration::from_secs(20)).await?;
    allocs
        .node_agent(leader, "n1")?
        .register_node(api::RegisterNodeRequest {
            inventory: Some(inventory("n1", 2, 16_000, "T4")),
        })
        .await?;
    let mut ext = allocs.extender(leader)?;
    ext.reserve(reserve("before")).await?;
    let epoch = allocs.status(leader).await.map(|s| s.epoch);

    // Something else fills etcd (as one node's flood of events used to) until it refuses.
    let mut kv = etcd.client().await?;
    let blob = vec![b'x'; 1 << 20];
    let mut filled = false;
    for i in 0..64 {
        match kv.put(format!("/junk/{i:03}"), blob.clone(), None).await {
            Ok(_) => {}
            Err(e) if e.to_string().contains("database space exceeded") => {
                filled = true;
                break;
            }
            Err(e) => return Err(e.into()),
        }
    }
    assert!(filled, "etcd never ran out of space with {QUOTA}");

    // A write is refused, saying why, and changes nothing; reads go on.
    let seq = allocs.status(leader).await.map(|s| s.seq);
    let refused = ext.reserve(reserve("during")).await;
    match &refused {
        Err(s) => {
            assert_eq!(s.code(), Code::Unavailable, "{s:?}");
            assert!(s.message().contains("etcd is out of space"), "{s:?}");
        }
        Ok(r) => panic!("a reservation was granted while etcd refuses writes: {r:?}"),
    }
    assert_eq!(allocs.status(leader).await.map(|s| s.seq), seq);
    allocs.viewer(leader)?.dump(api::DumpRequest {}).await?;

    // Readiness, the metric and the Status RPC say NOSPACE.
    let http = allocs.http[leader].clone();
    wait_until(
        "/readyz says etcd is out of space",
        Duration::from_secs(10),
        || {
            let url = format!("http://{http}/readyz");
            async move {
                let (code, body) = gpuledger_testkit::http::get(&url).await?;
                Ok(code == 503 && body.contains("NOSPACE"))
            }
        },
    )
    .await?;
    let (_, metrics) = gpuledger_testkit::http::get(&format!("http://{http}/metrics")).await?;
    assert_eq!(
        gpuledger_testkit::promtext::value(&metrics, "gpuledger_allocator_etcd_nospace"),
        Some(1.0),
        "{metrics}"
    );
    assert!(
        gpuledger_testkit::promtext::total(
            &metrics,
            "gpuledger_allocator_etcd_nospace_refusals_total"
        ) >= 1.0
    );
    let st = allocs.status(leader).await.expect("status answers");
    assert_eq!(st.etcd_alarm, "NOSPACE");
    assert!(
        !st.ready && st.not_ready_reason.contains("out of space"),
        "{st:?}"
    );
    // The leader held on: no lost lease, no election storm.
    assert_eq!((st.role.as_str(), Some(st.epoch)), ("leader", epoch));

    // `gpuledger status` says how to recover.
    let who = credential_flags(&allocs.ids.credentials(&Role::Viewer)?);
    let out = std::process::Command::new(bin_path("gpuledger")?)
        .arg("status")
        .arg(format!("--allocator={}", allocs.addrs[leader]))
        .args(&who)
        .output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    for step in ["OUT OF SPACE", "compaction", "defrag", "alarm disarm"] {
        assert!(text.contains(step), "status does not say {step:?}:\n{text}");
    }

    // The operator's recovery, as status says it: free, compact, defragment, disarm.
    kv.delete("/junk/", Some(DeleteOptions::new().with_prefix()))
        .await?;
    let rev = kv
        .get("/junk/", None)
        .await?
        .header()
        .map_or(0, |h| h.revision());
    kv.compact(rev, Some(CompactionOptions::new().with_physical()))
        .await?;
    kv.defragment().await?;
    let alarms = kv.alarm(AlarmAction::Get, AlarmType::None, None).await?;
    for m in alarms.alarms() {
        let mut one = AlarmOptions::new();
        one.with_member(m.member_id());
        kv.alarm(AlarmAction::Deactivate, AlarmType::Nospace, Some(one))
            .await?;
    }

    // Writes resume by themselves; readiness and the metric follow.
    let mut ext2 = allocs.extender(leader)?;
    let took = wait_until(
        "a reservation after the recovery",
        Duration::from_secs(10),
        || {
            let mut c = ext2.clone();
            async move { Ok(c.reserve(reserve("after")).await.is_ok()) }
        },
    )
    .await?;
    println!("writes resumed {took:?} after the alarm was disarmed");
    ext2.reserve(reserve("after")).await?;
    wait_until("/readyz ready again", Duration::from_secs(5), || {
        let url = format!("http://{http}/readyz");
        async move { Ok(gpuledger_testkit::http::get(&url).await?.0 == 200) }
    })
    .await?;
    let (_, metrics) = gpuledger_testkit::http::get(&format!("http://{http}/metrics")).await?;
    assert_eq!(
        gpuledger_testkit::promtext::value(&metrics, "gpuledger_allocator_etcd_nospace"),
        Some(0.0)
    );
    let st = allocs.status(leader).await.expect("status answers");
    assert_eq!(
        Some(st.epoch),
        epoch,
        "the leadership outlived the NOSPACE alarm"
    );
    Ok(())
}
