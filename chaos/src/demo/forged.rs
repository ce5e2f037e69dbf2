//! The demo's forged calls: what a tenant holding one component's credentials would try, each
//! refused by the allocator with the rule that refused it.

use std::time::Duration;

use anyhow::Result;
use gpuledger_testkit::cluster::LocalCluster;

/// Calls a tenant who stole one component's credentials would try, each against the leader:
/// every one must be refused, and the refusal says which rule refused it.
pub(super) async fn forged_calls(c: &LocalCluster) -> Result<Vec<String>> {
    use gpuledger_proto::allocator::v1 as api;
    let leader = c.allocs.wait_leader(Duration::from_secs(30)).await?;
    let nodes: Vec<String> = c.nodes.iter().map(|n| n.name.clone()).collect();
    let (own, other) = match nodes.as_slice() {
        [a, b, ..] => (a.clone(), b.clone()),
        _ => return Ok(vec!["(fewer than two nodes: skipped)".into()]),
    };
    let mut out = Vec::new();
    let mut say = |what: &str, r: Result<(), tonic::Status>| {
        out.push(match r {
            Ok(()) => format!("ACCEPTED: {what}"),
            Err(s) => format!("refused ({:?}): {what}: {}", s.code(), s.message()),
        });
    };
    let mut agent = c.allocs.node_agent(leader, &own)?;
    let r = agent
        .set_device_health(api::SetDeviceHealthRequest {
            node: other.clone(),
            gpu_uuid: "GPU-forged".into(),
            healthy: false,
            reason: "forged".into(),
            xid: 79,
        })
        .await
        .map(|_| ());
    say(
        &format!("the node agent of {own} marks a GPU of {other} unhealthy"),
        r,
    );
    let r = agent
        .subscribe(api::SubscribeRequest {
            node: other.clone(),
            from_seq: 0,
        })
        .await
        .map(|_| ());
    say(
        &format!("the node agent of {own} follows {other}'s allocations"),
        r,
    );
    let mut viewer = c.allocs.viewer(leader)?;
    let r = viewer
        .release(api::ReleaseRequest {
            pod_uid: "any".into(),
            ..Default::default()
        })
        .await
        .map(|_| ());
    say("a viewer releases a pod's GPUs", r);
    let mut ext = c.allocs.extender(leader)?;
    let r = ext
        .remove_node(api::RemoveNodeRequest {
            node: other.clone(),
            reason: "forged".into(),
        })
        .await
        .map(|_| ());
    say(&format!("the extender removes node {other}"), r);
    Ok(out)
}
