//! A critical Xid takes its GPU out of service: Unhealthy in ListAndWatch, unhealthy in the
//! ledger, and no new reservation lands on it. Application Xids (13) change nothing.

use crate::support;

use std::time::Duration;

use support::Cluster;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn xid_79_makes_the_gpu_unhealthy_and_placement_avoids_it() -> anyhow::Result<()> {
    let mut c = Cluster::start(2, &[]).await?;
    let (g0, g1) = (c.gpu(0), c.gpu(1));
    // An application error first: nothing changes.
    c.nvml.add_xid(&g0, 13)?;
    c.nvml.add_xid(&g0, 79)?;
    let devs = c
        .kubelet
        .wait_devices(Duration::from_secs(10), |d| {
            d.iter().any(|x| x.health == "Unhealthy")
        })
        .await?;
    for d in &devs {
        let want = if d.id.starts_with(&format!("{g0}::")) {
            "Unhealthy"
        } else {
            "Healthy"
        };
        assert_eq!(d.health, want, "{}", d.id);
    }
    let s = c
        .wait_ledger(Duration::from_secs(10), |s| {
            s.nodes
                .iter()
                .flat_map(|n| n.gpus.iter())
                .any(|g| g.uuid == g0 && !g.healthy)
        })
        .await?;
    let healthy1 = s
        .nodes
        .iter()
        .flat_map(|n| n.gpus.iter())
        .find(|g| g.uuid == g1)
        .map(|g| g.healthy);
    assert_eq!(healthy1, Some(true));
    // Binpack would fill GPU 0 first; it must not be used at all now.
    for i in 0..4 {
        let a = c.reserve(&format!("uid-{i}"), 4_000, None).await?;
        assert_eq!(
            a.shares[0].gpu_uuid, g1,
            "reservation {i} landed on the unhealthy GPU"
        );
    }
    // The kubelet is not offered its devices either.
    let got = c.kubelet.admit("default", "pod-uid-0", "main", 1).await?;
    assert!(got.device_ids[0].starts_with(&format!("{g1}::")));
    Ok(())
}
