//! The security model against real allocator processes over real TLS: a caller without a
//! gpuledger identity is refused before anything is read or written, every role may make only
//! its own calls (a node agent only for its own node), a forged forwarding header changes
//! nothing, and a write forwarded by a follower is judged as its sender's. Every refusal is
//! checked to have left the ledger as it was.

use std::time::Duration;

use gpuledger_auth::CredentialArgs;
use gpuledger_auth::identity::{Caller, Role};
use gpuledger_auth::server::{ON_BEHALF_OF, on_behalf_of};
use gpuledger_ledger::Ledger;
use gpuledger_proto::allocator::v1 as api;
use gpuledger_proto::allocator::v1::allocator_client::AllocatorClient;
use gpuledger_proto::ledger::v1 as pb;
use gpuledger_testkit::allocators::{Client, connect};
use gpuledger_testkit::workload::{inventory, pod};
use gpuledger_testkit::{Allocators, EtcdCluster, Identities, Pki};
use tonic::Code;
use tonic::metadata::MetadataValue;

const A: &str = "node-a";
const B: &str = "node-b";

/// Replicas on a real etcd with nodes A and B registered by their own agents.
struct Run {
    allocs: Allocators,
    leader: usize,
    dir: tempfile::TempDir,
    _etcd: EtcdCluster,
}

async fn start(replicas: usize) -> anyhow::Result<Run> {
    let etcd = EtcdCluster::start(1).await?;
    let dir = tempfile::tempdir()?;
    let allocs = Allocators::start(dir.path(), &etcd, replicas, "hostile", &[])?;
    let leader = allocs.wait_leader(Duration::from_secs(20)).await?;
    for n in [A, B] {
        allocs
            .node_agent(leader, n)?
            .register_node(api::RegisterNodeRequest {
                inventory: Some(inventory(n, 2, 16_000, "T4")),
            })
            .await?;
    }
    allocs.wait_caught_up(Duration::from_secs(10)).await?;
    Ok(Run {
        allocs,
        leader,
        dir,
        _etcd: etcd,
    })
}

impl Run {
    /// The leader's seq and state, to compare after refused calls.
    async fn mark(&self) -> anyhow::Result<(u64, Ledger)> {
        let l = self.allocs.ledger(self.leader).await?;
        Ok((l.seq(), l))
    }

    /// Fail unless the ledger is still exactly `before` (`what` was refused).
    async fn unchanged(&self, before: &(u64, Ledger), what: &str) -> anyhow::Result<()> {
        let now = self.allocs.ledger(self.leader).await?;
        assert_eq!(now.seq(), before.0, "{what} wrote to the ledger");
        assert!(now.same_state(&before.1), "{what} changed the ledger");
        Ok(())
    }

    /// Node `n` as the leader's dump has it.
    async fn node(&self, n: &str) -> anyhow::Result<Option<pb::NodeInventory>> {
        let d = self
            .allocs
            .viewer(self.leader)?
            .dump(api::DumpRequest {})
            .await?
            .into_inner();
        Ok(d.snapshot
            .and_then(|s| s.nodes.into_iter().find(|x| x.node == n)))
    }

    /// Reserve `uid` on `node` as the extender; its allocation id.
    async fn reserve(&self, uid: &str, node: &str) -> anyhow::Result<u64> {
        let r = self
            .allocs
            .extender(self.leader)?
            .reserve(api::ReserveRequest {
                request: Some(pod(uid, 2_000, 10)),
                node: node.into(),
                ttl_ms: 0,
            })
            .await?
            .into_inner();
        Ok(r.allocations[0].id)
    }

    /// Reserve `uid` on `node` and confirm it bound, as the extender; its allocation id.
    async fn bound(&self, uid: &str, node: &str) -> anyhow::Result<u64> {
        let id = self.reserve(uid, node).await?;
        self.allocs
            .extender(self.leader)?
            .confirm_bound(api::ConfirmBoundRequest {
                pod_uid: uid.into(),
                node: node.into(),
            })
            .await?;
        Ok(id)
    }
}

/// Fail unless `r` is PERMISSION_DENIED naming `rule`.
fn denied<T: std::fmt::Debug>(r: Result<T, tonic::Status>, rule: &str, what: &str) {
    match r {
        Err(s) => {
            assert_eq!(s.code(), Code::PermissionDenied, "{what}: {s:?}");
            assert!(
                s.message().contains(&format!("rule {rule}")),
                "{what}: the denial does not name rule {rule}: {}",
                s.message()
            );
        }
        Ok(v) => panic!("{what} was allowed: {v:?}"),
    }
}

/// Every RPC once, with a plausible request touching node A; each one's outcome.
async fn every_rpc(c: &mut Client) -> Vec<(&'static str, Result<(), tonic::Status>)> {
    let mut out = Vec::new();
    macro_rules! call {
        ($name:literal, $fut:expr) => {
            out.push(($name, $fut.await.map(|_| ())))
        };
    }
    call!(
        "RegisterNode",
        c.register_node(api::RegisterNodeRequest {
            inventory: Some(inventory(A, 2, 16_000, "T4")),
        })
    );
    call!(
        "RemoveNode",
        c.remove_node(api::RemoveNodeRequest {
            node: A.into(),
            reason: "hostile".into(),
        })
    );
    call!(
        "SetDeviceHealth",
        c.set_device_health(api::SetDeviceHealthRequest {
            node: A.into(),
            gpu_uuid: "GPU-node-a-0".into(),
            healthy: false,
            reason: "hostile".into(),
            xid: 79,
        })
    );
    call!(
        "Filter",
        c.filter(api::FilterRequest {
            request: Some(pod("evil", 1_000, 0)),
            nodes: vec![],
        })
    );
    call!(
        "Score",
        c.score(api::ScoreRequest {
            request: Some(pod("evil", 1_000, 0)),
            nodes: vec![A.into()],
        })
    );
    call!(
        "Reserve",
        c.reserve(api::ReserveRequest {
            request: Some(pod("evil", 1_000, 0)),
            node: A.into(),
            ttl_ms: 0,
        })
    );
    call!(
        "ConfirmBound",
        c.confirm_bound(api::ConfirmBoundRequest {
            pod_uid: "victim".into(),
            node: A.into(),
        })
    );
    call!(
        "Assign",
        c.assign(api::AssignRequest {
            node: A.into(),
            allocation_id: 1,
            device_ids: vec!["GPU-node-a-0::0".into()],
        })
    );
    call!(
        "CorrectIdentity",
        c.correct_identity(api::CorrectIdentityRequest {
            node: A.into(),
            from_allocation_id: 1,
            to_allocation_id: 2,
            device_ids: vec!["GPU-node-a-0::0".into()],
        })
    );
    call!(
        "Release",
        c.release(api::ReleaseRequest {
            pod_uid: "victim".into(),
            ..Default::default()
        })
    );
    call!(
        "ReportViolation",
        c.report_violation(api::ReportViolationRequest {
            violation: Some(pb::LimitViolated {
                allocation_id: 1,
                node: A.into(),
                gpu_uuid: "GPU-node-a-0".into(),
                pid: 1,
                used_mib: 2,
                limit_mib: 1,
                action: "kill".into(),
            }),
        })
    );
    call!(
        "Subscribe",
        c.subscribe(api::SubscribeRequest {
            node: A.into(),
            from_seq: 0,
        })
    );
    call!("Status", c.status(api::StatusRequest {}));
    call!("Dump", c.dump(api::DumpRequest {}));
    call!(
        "ReadLog",
        c.read_log(api::ReadLogRequest {
            from_seq: 1,
            to_seq: 0,
        })
    );
    call!(
        "ReadSnapshots",
        c.read_snapshots(api::ReadSnapshotsRequest {})
    );
    call!("Replicate", c.replicate(api::ReplicateRequest::default()));
    out
}

/// Fail unless every RPC through `c` is refused with `code`.
async fn all_refused(c: &mut Client, code: Code, who: &str) {
    let outcomes = every_rpc(c).await;
    assert_eq!(outcomes.len(), 17, "every RPC of the API");
    for (rpc, r) in outcomes {
        match r {
            Err(s) => assert_eq!(s.code(), code, "{who}: {rpc}: {s:?}"),
            Ok(()) => panic!("{who}: {rpc} was answered"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn callers_without_a_gpuledger_identity_are_unauthenticated_for_every_rpc()
-> anyhow::Result<()> {
    let run = start(1).await?;
    let before = run.mark().await?;
    let ca = Some(run.allocs.ids.pki.ca_file().to_path_buf());

    // A certificate of the cluster's own CA that names no gpuledger identity (no SPIFFE SAN).
    let (cert, key) = run.allocs.ids.pki.peer("stranger")?;
    let stranger = CredentialArgs {
        ca: ca.clone(),
        client_cert: Some(cert),
        client_key: Some(key),
        ..Default::default()
    };
    let mut c = connect(&run.allocs.addrs[run.leader], &stranger)?;
    all_refused(
        &mut c,
        Code::Unauthenticated,
        "a certificate without identity",
    )
    .await;

    // A bearer token this allocator cannot review (it has no Kubernetes API).
    let token = run.dir.path().join("forged-token");
    std::fs::write(&token, "eyJhbGciOiJub25lIn0.eyJzdWIiOiJhZG1pbiJ9.")?;
    let forged = CredentialArgs {
        ca,
        token_file: Some(token),
        ..Default::default()
    };
    let mut c = connect(&run.allocs.addrs[run.leader], &forged)?;
    all_refused(&mut c, Code::Unauthenticated, "an unverifiable token").await;

    run.unchanged(&before, "an unauthenticated caller").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plaintext_client_gets_no_answer() -> anyhow::Result<()> {
    let run = start(1).await?;
    let before = run.mark().await?;
    let channel = tonic::transport::Endpoint::from_shared(format!(
        "http://{}",
        run.allocs.addrs[run.leader]
    ))?
    .connect_timeout(Duration::from_secs(2))
    .timeout(Duration::from_secs(5))
    .connect_lazy();
    let mut c = AllocatorClient::new(channel);
    let st = c.status(api::StatusRequest {}).await;
    assert!(st.is_err(), "a plaintext client got a status: {st:?}");
    let w = c
        .register_node(api::RegisterNodeRequest {
            inventory: Some(inventory("plain", 1, 16_000, "T4")),
        })
        .await;
    assert!(w.is_err(), "a plaintext client registered a node: {w:?}");
    run.unchanged(&before, "a plaintext client").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_from_another_ca_is_refused() -> anyhow::Result<()> {
    let run = start(1).await?;
    let before = run.mark().await?;
    let addr = &run.allocs.addrs[run.leader];
    // An admin certificate, well formed, but signed by a CA the allocator does not trust.
    let other = Pki::new(&run.dir.path().join("other"))?;
    let (cert, key) = other.client_cert(&Role::Admin, "mallory")?;
    let mallory = CredentialArgs {
        ca: Some(run.allocs.ids.pki.ca_file().to_path_buf()),
        client_cert: Some(cert),
        client_key: Some(key),
        ..Default::default()
    };
    let mut c = connect(addr, &mallory)?;
    for (rpc, r) in every_rpc(&mut c).await {
        assert!(r.is_err(), "{rpc} answered a certificate of another CA");
    }
    // A client that trusts only the other CA does not accept the allocator either.
    let mut c = connect(addr, &Identities::certs(other).credentials(&Role::Admin)?)?;
    let st = c.status(api::StatusRequest {}).await;
    assert!(
        st.is_err(),
        "the allocator passed for another CA's server: {st:?}"
    );
    run.unchanged(&before, "a certificate of another CA").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_agent_may_touch_only_its_own_node() -> anyhow::Result<()> {
    let run = start(1).await?;
    let on_a = run.bound("pod-on-a", A).await?;
    let on_b = run.bound("pod-on-b", B).await?;
    let before = run.mark().await?;
    let b_before = run.node(B).await?;
    let mut agent = run.allocs.node_agent(run.leader, A)?;

    denied(
        agent
            .register_node(api::RegisterNodeRequest {
                inventory: Some(inventory(B, 8, 80_000, "A100")),
            })
            .await,
        "node-agent-register-own-node",
        "A registering B",
    );
    denied(
        agent
            .set_device_health(api::SetDeviceHealthRequest {
                node: B.into(),
                gpu_uuid: "GPU-node-b-0".into(),
                healthy: false,
                reason: "hostile".into(),
                xid: 79,
            })
            .await,
        "node-agent-health-own-node",
        "A marking B's GPU unhealthy",
    );
    denied(
        agent
            .subscribe(api::SubscribeRequest {
                node: B.into(),
                from_seq: 0,
            })
            .await,
        "node-agent-subscribe-own-node",
        "A subscribing to B",
    );
    denied(
        agent
            .assign(api::AssignRequest {
                node: B.into(),
                allocation_id: on_b,
                device_ids: vec!["GPU-node-b-0::0".into()],
            })
            .await,
        "node-agent-assign-own-node",
        "A assigning B's allocation",
    );
    // Naming its own node does not help: the allocation's node is the ledger's.
    denied(
        agent
            .assign(api::AssignRequest {
                node: A.into(),
                allocation_id: on_b,
                device_ids: vec!["GPU-node-a-0::0".into()],
            })
            .await,
        "node-agent-assign-own-node",
        "A assigning B's allocation as if on A",
    );
    denied(
        agent
            .report_violation(api::ReportViolationRequest {
                violation: Some(pb::LimitViolated {
                    allocation_id: on_b,
                    node: B.into(),
                    gpu_uuid: "GPU-node-b-0".into(),
                    pid: 4242,
                    used_mib: 9_000,
                    limit_mib: 2_000,
                    action: "kill".into(),
                }),
            })
            .await,
        "node-agent-report-own-node",
        "A reporting a violation on B",
    );
    denied(
        agent
            .correct_identity(api::CorrectIdentityRequest {
                node: A.into(),
                from_allocation_id: on_a,
                to_allocation_id: on_b,
                device_ids: vec!["GPU-node-a-0::0".into()],
            })
            .await,
        "node-agent-correct-own-node",
        "A moving devices to B's allocation",
    );
    denied(
        agent
            .release(api::ReleaseRequest {
                pod_uid: "pod-on-b".into(),
                ..Default::default()
            })
            .await,
        "no-rule",
        "a node agent releasing",
    );
    run.unchanged(&before, "node agent A's calls for node B")
        .await?;

    // Its own node: every call works.
    let mut updates = agent
        .subscribe(api::SubscribeRequest {
            node: A.into(),
            from_seq: 0,
        })
        .await?
        .into_inner();
    let first = tokio::time::timeout(Duration::from_secs(10), updates.message()).await??;
    assert!(first.is_some(), "A's subscription sends A's view");
    agent
        .register_node(api::RegisterNodeRequest {
            inventory: Some(inventory(A, 2, 16_000, "T4")),
        })
        .await?;
    let assigned = agent
        .assign(api::AssignRequest {
            node: A.into(),
            allocation_id: on_a,
            device_ids: vec!["GPU-node-a-0::0".into()],
        })
        .await?
        .into_inner();
    assert_eq!(
        assigned.allocation.map(|a| a.state),
        Some(pb::AllocationState::Assigned as i32)
    );
    agent
        .report_violation(api::ReportViolationRequest {
            violation: Some(pb::LimitViolated {
                allocation_id: on_a,
                node: A.into(),
                gpu_uuid: "GPU-node-a-0".into(),
                pid: 4242,
                used_mib: 9_000,
                limit_mib: 2_000,
                action: "report".into(),
            }),
        })
        .await?;
    agent
        .set_device_health(api::SetDeviceHealthRequest {
            node: A.into(),
            gpu_uuid: "GPU-node-a-1".into(),
            healthy: false,
            reason: "Xid 79".into(),
            xid: 79,
        })
        .await?;
    let l = run.allocs.ledger(run.leader).await?;
    assert!(l.seq() > before.0, "A's own calls were written");
    assert_eq!(run.node(B).await?, b_before, "node B is as it was");
    let a = run.node(A).await?.expect("node A");
    assert!(!a.gpus[1].healthy, "A marked its own GPU 1 unhealthy");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_extender_may_not_register_remove_or_mark_nodes() -> anyhow::Result<()> {
    let run = start(1).await?;
    let before = run.mark().await?;
    let mut ext = run.allocs.extender(run.leader)?;
    denied(
        ext.register_node(api::RegisterNodeRequest {
            inventory: Some(inventory("fake-node", 8, 80_000, "A100")),
        })
        .await,
        "no-rule",
        "the extender registering a node",
    );
    denied(
        ext.remove_node(api::RemoveNodeRequest {
            node: A.into(),
            reason: "hostile".into(),
        })
        .await,
        "no-rule",
        "the extender removing a node",
    );
    denied(
        ext.set_device_health(api::SetDeviceHealthRequest {
            node: A.into(),
            gpu_uuid: "GPU-node-a-0".into(),
            healthy: false,
            reason: "hostile".into(),
            xid: 79,
        })
        .await,
        "no-rule",
        "the extender marking a GPU unhealthy",
    );
    denied(
        ext.subscribe(api::SubscribeRequest {
            node: A.into(),
            from_seq: 0,
        })
        .await,
        "no-rule",
        "the extender subscribing as a node",
    );
    run.unchanged(&before, "the extender's node writes").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_extender_releases_reservations_but_not_bound_allocations() -> anyhow::Result<()> {
    let run = start(1).await?;
    run.reserve("only-reserved", A).await?;
    let bound = run.bound("running", A).await?;
    let mut ext = run.allocs.extender(run.leader)?;
    ext.release(api::ReleaseRequest {
        pod_uid: "only-reserved".into(),
        reason: "bind failed".into(),
        ..Default::default()
    })
    .await?;
    let l = run.allocs.ledger(run.leader).await?;
    assert!(
        l.allocs_of_pod("only-reserved").is_empty(),
        "the reservation is gone"
    );

    let before = run.mark().await?;
    denied(
        ext.release(api::ReleaseRequest {
            pod_uid: "running".into(),
            ..Default::default()
        })
        .await,
        "extender-release-own-reservations",
        "the extender releasing a bound pod",
    );
    denied(
        ext.release(api::ReleaseRequest {
            allocation_id: bound,
            ..Default::default()
        })
        .await,
        "extender-release-own-reservations",
        "the extender releasing a bound allocation by id",
    );
    run.unchanged(&before, "the extender's release of a bound pod")
        .await?;
    // An operator with the admin role may.
    run.allocs
        .admin(run.leader)?
        .release(api::ReleaseRequest {
            pod_uid: "running".into(),
            reason: "operator".into(),
            ..Default::default()
        })
        .await?;
    let l = run.allocs.ledger(run.leader).await?;
    assert!(l.alloc(bound).is_none(), "the admin released it");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_viewer_reads_but_may_not_write() -> anyhow::Result<()> {
    let run = start(1).await?;
    run.reserve("someone", A).await?;
    let before = run.mark().await?;
    let mut viewer = run.allocs.viewer(run.leader)?;
    let dump = viewer.dump(api::DumpRequest {}).await?.into_inner();
    assert_eq!(
        dump.snapshot.map(|s| s.allocations.len()),
        Some(1),
        "a viewer sees the ledger"
    );
    let mut log = viewer
        .read_log(api::ReadLogRequest {
            from_seq: 1,
            to_seq: 0,
        })
        .await?
        .into_inner();
    assert!(log.message().await?.is_some(), "a viewer reads the log");
    denied(
        viewer
            .reserve(api::ReserveRequest {
                request: Some(pod("mine", 1_000, 0)),
                node: A.into(),
                ttl_ms: 0,
            })
            .await,
        "no-rule",
        "a viewer reserving",
    );
    denied(
        viewer
            .release(api::ReleaseRequest {
                pod_uid: "someone".into(),
                ..Default::default()
            })
            .await,
        "no-rule",
        "a viewer releasing",
    );
    denied(
        viewer
            .remove_node(api::RemoveNodeRequest {
                node: A.into(),
                reason: "hostile".into(),
            })
            .await,
        "no-rule",
        "a viewer removing a node",
    );
    denied(
        viewer
            .register_node(api::RegisterNodeRequest {
                inventory: Some(inventory("fake-node", 8, 80_000, "A100")),
            })
            .await,
        "no-rule",
        "a viewer registering a node",
    );
    run.unchanged(&before, "a viewer's writes").await
}

/// `req` carrying a forged forwarding header that claims `claimed` sent it.
fn forged<T>(req: T, claimed: Role) -> anyhow::Result<tonic::Request<T>> {
    let caller = Caller {
        role: claimed,
        subject: "spiffe://gpuledger/admin/root".into(),
    };
    let mut r = tonic::Request::new(req);
    let v = on_behalf_of(&caller);
    r.metadata_mut()
        .insert(ON_BEHALF_OF, MetadataValue::try_from(v.to_str()?)?);
    Ok(r)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_forwarding_header_is_ignored() -> anyhow::Result<()> {
    let run = start(2).await?;
    let follower = 1 - run.leader;
    let before = run.mark().await?;
    for (i, which) in [(run.leader, "leader"), (follower, "follower")] {
        // Node agent A claiming to forward for an admin is still node agent A.
        let mut agent = run.allocs.node_agent(i, A)?;
        let req = api::RemoveNodeRequest {
            node: B.into(),
            reason: "hostile".into(),
        };
        denied(
            agent.remove_node(forged(req, Role::Admin)?).await,
            "no-rule",
            &format!("node agent A removing B as a forged admin, via the {which}"),
        );
        let req = api::SetDeviceHealthRequest {
            node: B.into(),
            gpu_uuid: "GPU-node-b-0".into(),
            healthy: false,
            reason: "hostile".into(),
            xid: 79,
        };
        denied(
            agent
                .set_device_health(forged(req, Role::NodeAgent { node: B.into() })?)
                .await,
            "node-agent-health-own-node",
            &format!("node agent A posing as B's agent, via the {which}"),
        );
        // A viewer claiming to forward for the extender is still a viewer.
        let mut viewer = run.allocs.viewer(i)?;
        let req = api::ReserveRequest {
            request: Some(pod("forged", 1_000, 0)),
            node: A.into(),
            ttl_ms: 0,
        };
        let r = viewer.reserve(forged(req, Role::Extender)?).await;
        denied(
            r,
            "no-rule",
            &format!("a viewer reserving as a forged extender, via the {which}"),
        );
    }
    run.unchanged(&before, "forged forwarding headers").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_through_a_follower_are_judged_as_their_sender() -> anyhow::Result<()> {
    let run = start(2).await?;
    let follower = 1 - run.leader;
    let mut agent = run.allocs.node_agent(follower, A)?;

    let before = run.mark().await?;
    denied(
        agent
            .set_device_health(api::SetDeviceHealthRequest {
                node: B.into(),
                gpu_uuid: "GPU-node-b-0".into(),
                healthy: false,
                reason: "hostile".into(),
                xid: 79,
            })
            .await,
        "node-agent-health-own-node",
        "node agent A marking B's GPU through the follower",
    );
    denied(
        run.allocs
            .viewer(follower)?
            .reserve(api::ReserveRequest {
                request: Some(pod("via-follower", 1_000, 0)),
                node: A.into(),
                ttl_ms: 0,
            })
            .await,
        "no-rule",
        "a viewer reserving through the follower",
    );
    run.unchanged(&before, "refused writes through the follower")
        .await?;

    // Its own node's write is forwarded and committed.
    agent
        .set_device_health(api::SetDeviceHealthRequest {
            node: A.into(),
            gpu_uuid: "GPU-node-a-1".into(),
            healthy: false,
            reason: "Xid 79".into(),
            xid: 79,
        })
        .await?;
    let granted = run
        .allocs
        .extender(follower)?
        .reserve(api::ReserveRequest {
            request: Some(pod("through-follower", 1_000, 0)),
            node: A.into(),
            ttl_ms: 0,
        })
        .await?
        .into_inner();
    assert!(granted.created);
    let l = run.allocs.ledger(run.leader).await?;
    assert!(l.seq() >= before.0 + 2, "both forwarded writes committed");
    let a = run.node(A).await?.expect("node A");
    assert!(
        !a.gpus[1].healthy,
        "A's GPU 1 is unhealthy in the leader's ledger"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_and_absurd_requests_are_refused_and_the_leader_stays() -> anyhow::Result<()> {
    let run = start(1).await?;
    let before = run.mark().await?;
    let st = |s: tonic::Status| (s.code(), s.message().to_string());

    // Past the gRPC limit (4 MiB): refused while decoding, before the service runs.
    let mut agent = run.allocs.node_agent(run.leader, A)?;
    let mut huge = inventory(A, 2, 16_000, "T4");
    huge.gpus[0].model = "x".repeat(5 << 20);
    let r = agent
        .register_node(api::RegisterNodeRequest {
            inventory: Some(huge),
        })
        .await
        .map_err(st);
    assert!(
        matches!(&r, Err((Code::OutOfRange, _))),
        "a 5 MiB registration: {r:?}"
    );
    let counted = crate::hostile_load::limited(&run.allocs, run.leader, "request_body_bytes");
    assert_eq!(counted.await?, 1.0, "the 5 MiB request counted");
    // Under it but larger than one write may be: INVALID_ARGUMENT, never a batch.
    let mut big = inventory(A, 2, 16_000, "T4");
    big.gpus[0].model = "x".repeat(300 << 10);
    let r = agent
        .register_node(api::RegisterNodeRequest {
            inventory: Some(big),
        })
        .await
        .map_err(st);
    assert!(
        matches!(&r, Err((Code::InvalidArgument, m)) if m.contains("writes are limited")),
        "a 300 KiB registration: {r:?}"
    );

    let mut ext = run.allocs.extender(run.leader)?;
    let mut many = pod("many", 100, 0);
    many.containers = (0..10_000)
        .map(|i| api::ContainerRequest {
            name: format!("c{i}"),
            slices: 1,
            mem_mib: 1,
            mem_percent: 0,
            core_milli: 0,
        })
        .collect();
    let r = ext
        .reserve(api::ReserveRequest {
            request: Some(many),
            node: A.into(),
            ttl_ms: 0,
        })
        .await
        .map_err(st);
    assert!(
        matches!(&r, Err((Code::InvalidArgument, _))),
        "a 10,000-container pod: {r:?}"
    );
    let r = ext
        .reserve(api::ReserveRequest {
            request: Some(pod("forever", 100, 0)),
            node: A.into(),
            ttl_ms: u64::MAX,
        })
        .await
        .map_err(st);
    assert!(
        matches!(&r, Err((Code::InvalidArgument, m)) if m.contains("ttl_ms")),
        "a reservation that never expires: {r:?}"
    );

    run.unchanged(&before, "oversized and absurd requests")
        .await?;
    let still = run.allocs.wait_leader(Duration::from_secs(5)).await?;
    assert_eq!(still, run.leader, "the leader stepped down");
    // And it still writes.
    ext.reserve(api::ReserveRequest {
        request: Some(pod("fine", 100, 0)),
        node: A.into(),
        ttl_ms: 0,
    })
    .await?;
    Ok(())
}

/// A node agent's inventory is bounded where it enters, and its writes have a rate: a GPU of
/// absurd memory (which used to overflow a later percent-of-memory request and panic the
/// leader's sequencer), too many GPUs, a violation of an unknown action and a flood of
/// violations are refused; the leader stays, another node's writes go on, and the metric counts
/// what bit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_agent_cannot_register_absurd_gpus_or_flood_the_ledger() -> anyhow::Result<()> {
    let etcd = EtcdCluster::start(1).await?;
    let dir = tempfile::tempdir()?;
    let allocs = Allocators::start(
        dir.path(),
        &etcd,
        1,
        "flood",
        &["--node-writes-per-s=5", "--node-write-burst=20"],
    )?;
    let leader = allocs.wait_leader(Duration::from_secs(20)).await?;
    let epoch = allocs.status(leader).await.map(|s| s.epoch);
    let mut a = allocs.node_agent(leader, A)?;
    let mut b = allocs.node_agent(leader, B)?;
    b.register_node(api::RegisterNodeRequest {
        inventory: Some(inventory(B, 2, 16_000, "T4")),
    })
    .await?;
    let seq = allocs.status(leader).await.map(|s| s.seq);

    let mut absurd = inventory(A, 1, 16_000, "T4");
    absurd.gpus[0].memory_mib = u64::MAX / 2;
    let r = a
        .register_node(api::RegisterNodeRequest {
            inventory: Some(absurd),
        })
        .await;
    assert!(
        matches!(&r, Err(s) if s.code() == Code::InvalidArgument
            && s.message().contains("--max-gpu-memory-mib")),
        "a GPU of 2^63 MiB: {r:?}"
    );
    let r = a
        .register_node(api::RegisterNodeRequest {
            inventory: Some(inventory(A, 65, 16_000, "T4")),
        })
        .await;
    assert!(
        matches!(&r, Err(s) if s.code() == Code::InvalidArgument
            && s.message().contains("--max-gpus-per-node")),
        "65 GPUs: {r:?}"
    );
    let violation = |node: &str, action: &str| api::ReportViolationRequest {
        violation: Some(pb::LimitViolated {
            allocation_id: 0,
            node: node.into(),
            gpu_uuid: format!("GPU-{node}-0"),
            pid: 42,
            used_mib: 1,
            limit_mib: 0,
            action: action.into(),
        }),
    };
    let r = a.report_violation(violation(A, &"x".repeat(1000))).await;
    assert!(
        matches!(&r, Err(s) if s.code() == Code::InvalidArgument && s.message().contains("action")),
        "a violation of an unknown action: {r:?}"
    );
    assert_eq!(
        allocs.status(leader).await.map(|s| s.seq),
        seq,
        "refused writes changed the ledger"
    );

    // A flood: two seconds of reports as fast as one client sends them (each refusal pauses
    // its connection).
    let t0 = std::time::Instant::now();
    let (mut written, mut throttled) = (0u32, 0u32);
    while t0.elapsed() < Duration::from_secs(2) {
        match a.report_violation(violation(A, "rogue")).await {
            Ok(_) => written += 1,
            Err(s) if s.code() == Code::ResourceExhausted => {
                assert!(s.message().contains("--node-writes-per-s"), "{s:?}");
                throttled += 1;
            }
            Err(s) => panic!("a report failed otherwise: {s:?}"),
        }
    }
    let allowed = 20.0 + 5.0 * t0.elapsed().as_secs_f64() + 1.0;
    assert!(
        f64::from(written) <= allowed && throttled > 0,
        "{written} reports written, {throttled} refused in {:?}",
        t0.elapsed()
    );
    // Another node's budget is its own; the leader stayed.
    b.report_violation(violation(B, "rogue")).await?;
    let st = allocs.status(leader).await.expect("status");
    assert_eq!((st.role.as_str(), Some(st.epoch)), ("leader", epoch));
    let (_, metrics) =
        gpuledger_testkit::http::get(&format!("http://{}/metrics", allocs.http[leader])).await?;
    for (limit, at_least) in [
        ("node_write_rate", f64::from(throttled)),
        ("gpu_memory", 1.0),
        ("gpus_per_node", 1.0),
    ] {
        let series = format!("gpuledger_allocator_writes_refused_total{{limit=\"{limit}\"}}");
        let v = gpuledger_testkit::promtext::value(&metrics, &series).unwrap_or(0.0);
        assert!(
            v >= at_least,
            "{series} = {v}, expected at least {at_least}"
        );
    }
    Ok(())
}
