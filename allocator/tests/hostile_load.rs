//! Availability against hostile callers, on real allocator processes over real TLS: sockets
//! that never send a ClientHello do not lock new clients out, a viewer cannot open streams
//! without bound (and the leader keeps its lease while it tries), junk tokens cost no
//! TokenReview, callers over a limit are slowed to its pace (their connection is not read for
//! a while) instead of answered at line rate, and an allocator's token cannot forward a write under an identity it did not
//! verify. Each limit that bites is counted in `gpuledger_allocator_limited_total{limit}`.

use std::time::{Duration, Instant};

use gpuledger_auth::identity::{Caller, Role};
use gpuledger_auth::server::{FORWARDED_AUTHORIZATION, ON_BEHALF_OF, on_behalf_of};
use gpuledger_ledger::pb;
use gpuledger_proto::allocator::v1 as api;
use gpuledger_testkit::attacker::tcp_from;
use gpuledger_testkit::kube::{KubeStack, StackOptions};
use gpuledger_testkit::workload::{inventory, pod};
use gpuledger_testkit::{Allocators, EtcdCluster};
use tonic::Code;
use tonic::metadata::MetadataValue;

use crate::hostile_tokens::with_token;

/// The value of `gpuledger_allocator_limited_total{limit="<limit>"}` on replica `i`.
pub(crate) async fn limited(allocs: &Allocators, i: usize, limit: &str) -> anyhow::Result<f64> {
    metric(allocs, i, &format!("limited_total{{limit=\"{limit}\"}}")).await
}

/// The value of the series `gpuledger_allocator_<series>` on replica `i`.
pub(crate) async fn metric(allocs: &Allocators, i: usize, series: &str) -> anyhow::Result<f64> {
    let (_, text) =
        gpuledger_testkit::http::get(&format!("http://{}/metrics", allocs.http[i])).await?;
    let prefix = format!("gpuledger_allocator_{series} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .and_then(|v| v.trim().parse().ok())
        .ok_or_else(|| anyhow::anyhow!("no series {prefix}in /metrics"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_sockets_from_one_address_do_not_lock_new_clients_out() -> anyhow::Result<()> {
    let etcd = EtcdCluster::start(1).await?;
    let dir = tempfile::tempdir()?;
    let allocs = Allocators::start(dir.path(), &etcd, 1, "silent", &[])?;
    allocs.wait_leader(Duration::from_secs(20)).await?;
    // More idle sockets than there are handshake slots (1,024), from one address, none of
    // which ever sends a ClientHello.
    let mut silent = Vec::new();
    let opening = Instant::now();
    for _ in 0..1_100 {
        if let Ok(s) = tcp_from("127.0.0.2", allocs.addrs[0].parse()?).await {
            silent.push(s);
        }
    }
    assert!(
        silent.len() >= 1_024,
        "only {} sockets opened",
        silent.len()
    );
    // A new client (the CLI, a node agent after a restart) gets in while they sit there.
    let t0 = Instant::now();
    let mut fresh = allocs.viewer(0)?;
    let status =
        tokio::time::timeout(Duration::from_secs(3), fresh.status(api::StatusRequest {})).await;
    assert!(
        matches!(status, Ok(Ok(_))),
        "a new client while 1,100 sockets stall: {status:?} after {:?}",
        t0.elapsed()
    );
    // Past 64 handshakes in progress from one address, the rest are closed at accept: at most
    // 64 more get a slot each time the ClientHello timeout (1 s) frees the slots, so of the
    // sockets opened, all but 64 per started second of opening are closed (counted within a
    // few seconds: the allocator may still be accepting the last of them).
    let windows = opening.elapsed().as_secs() + 2;
    let expected = silent.len().saturating_sub(64 * windows as usize) as f64;
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut closed = limited(&allocs, 0, "tls_handshakes_per_peer").await?;
    while closed < expected && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
        closed = limited(&allocs, 0, "tls_handshakes_per_peer").await?;
    }
    assert!(
        closed >= expected && closed >= 800.0,
        "{closed} of {} closed at accept (expected {expected}, opening took {:?})",
        silent.len(),
        opening.elapsed()
    );
    // The silent ones are cut once the ClientHello is overdue.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    assert!(limited(&allocs, 0, "tls_hello_timeout").await? >= 1.0);
    drop(silent);
    Ok(())
}

/// Idle TLS connections (handshake done, nothing sent after) fill the listener, its reserved
/// last tenth included: a new client from another address still gets in, by the slot of an
/// idle connection of the address holding the most, and a connection busy with a stream is
/// never the one closed, however many newcomers come.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_tls_connections_cannot_fill_the_listener_nor_evict_a_busy_one() -> anyhow::Result<()>
{
    use gpuledger_testkit::attacker::{allocator_from, count_closed, tls_from, tls_trusting};
    let etcd = EtcdCluster::start(1).await?;
    let dir = tempfile::tempdir()?;
    let allocs = Allocators::start(
        dir.path(),
        &etcd,
        1,
        "idle-fill",
        &["--max-connections=40", "--max-connections-per-peer=32"],
    )?;
    allocs.wait_leader(Duration::from_secs(20)).await?;
    let to = allocs.addrs[0].parse()?;
    // A node agent's stream, on its own connection from 127.0.0.1.
    let mut agent = allocs.node_agent(0, "n1")?;
    agent
        .register_node(api::RegisterNodeRequest {
            inventory: Some(inventory("n1", 1, 16_000, "NVIDIA A100")),
        })
        .await?;
    let mut stream = agent
        .subscribe(api::SubscribeRequest {
            node: "n1".into(),
            from_seq: 0,
        })
        .await?
        .into_inner();
    while let Ok(m) = tokio::time::timeout(Duration::from_millis(500), stream.message()).await {
        anyhow::ensure!(m?.is_some(), "the stream ended");
    }
    // 127.0.0.1 at its per-peer limit with idle connections beside the stream, then one
    // connection from each of eight more addresses: the listener is full.
    let tls = tls_trusting(allocs.ids.pki.ca_file())?;
    let open = |source: String| {
        let tls = tls.clone();
        async move { tls_from(&tls, &source, to).await.ok() }
    };
    let mut heavy = Vec::new();
    for _ in 0..31 {
        heavy.extend(open("127.0.0.1".into()).await);
    }
    let mut others = Vec::new();
    for i in 2..10 {
        others.extend(open(format!("127.0.0.{i}")).await);
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    // A new client from another address gets in and is answered.
    let viewer = allocs.ids.credentials(&Role::Viewer)?;
    let mut fresh = allocator_from("127.0.0.10", &allocs.addrs[0], &viewer)?;
    let status =
        tokio::time::timeout(Duration::from_secs(5), fresh.status(api::StatusRequest {})).await;
    assert!(
        matches!(status, Ok(Ok(_))),
        "a new client while {} idle TLS connections fill the listener: {status:?}",
        heavy.len() + others.len()
    );
    assert!(limited(&allocs, 0, "connections_evicted").await? >= 1.0);
    // Forty more newcomers take every idle slot 127.0.0.1 holds; its stream is busy and stays.
    for i in 11..51 {
        others.extend(open(format!("127.0.0.{i}")).await);
    }
    let mut tcp: Vec<_> = heavy.into_iter().map(|s| s.into_inner().0).collect();
    let closed = count_closed(&mut tcp, Duration::from_millis(200)).await;
    assert_eq!(
        closed,
        tcp.len(),
        "every idle connection of 127.0.0.1 was taken"
    );
    drop(others);
    drop(fresh);
    tokio::time::sleep(Duration::from_millis(200)).await;
    // The stream still delivers: a reservation on its node reaches it.
    allocs
        .extender(0)?
        .reserve(api::ReserveRequest {
            request: Some(pod("uid-1", 1_000, 10)),
            node: "n1".into(),
            ttl_ms: 0,
        })
        .await?;
    let got = tokio::time::timeout(Duration::from_secs(5), stream.message()).await;
    assert!(
        matches!(got, Ok(Ok(Some(_)))),
        "the busy stream was cut: {got:?}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_viewer_cannot_hold_streams_without_bound_and_the_leader_keeps_its_lease()
-> anyhow::Result<()> {
    let etcd = EtcdCluster::start(1).await?;
    let dir = tempfile::tempdir()?;
    let allocs = Allocators::start(dir.path(), &etcd, 1, "streams", &[])?;
    allocs.wait_leader(Duration::from_secs(20)).await?;
    allocs
        .node_agent(0, "n1")?
        .register_node(api::RegisterNodeRequest {
            inventory: Some(inventory("n1", 2, 16_000, "T4")),
        })
        .await?;
    let epoch = allocs.status(0).await.map(|s| s.epoch);
    // 300 Subscribe streams on one connection, by one viewer.
    let viewer = allocs.viewer(0)?;
    let mut opened = Vec::new();
    for _ in 0..300 {
        let mut v = viewer.clone();
        opened.push(tokio::spawn(async move {
            v.subscribe(api::SubscribeRequest {
                node: "n1".into(),
                from_seq: 0,
            })
            .await
        }));
    }
    let (mut held, mut refused) = (Vec::new(), 0);
    for o in opened {
        match tokio::time::timeout(Duration::from_secs(20), o).await?? {
            Ok(s) => held.push(s.into_inner()),
            Err(s) if s.code() == Code::ResourceExhausted => refused += 1,
            Err(s) => anyhow::bail!("a stream refused otherwise: {s:?}"),
        }
    }
    assert_eq!(
        held.len(),
        64,
        "streams per identity (--max-streams-per-identity)"
    );
    assert_eq!(refused, 236);
    assert_eq!(limited(&allocs, 0, "streams_per_identity").await?, 236.0);
    // Meanwhile the node agent follows its node and writes go through.
    let mut agent = allocs.node_agent(0, "n1")?;
    let mut own = agent
        .subscribe(api::SubscribeRequest {
            node: "n1".into(),
            from_seq: 0,
        })
        .await?
        .into_inner();
    tokio::time::timeout(Duration::from_secs(5), own.message())
        .await??
        .expect("the node's view");
    agent
        .set_device_health(api::SetDeviceHealthRequest {
            node: "n1".into(),
            gpu_uuid: "GPU-n1-0".into(),
            healthy: false,
            reason: "Xid 79".into(),
            xid: 79,
        })
        .await?;
    let s = allocs.status(0).await.expect("status");
    assert_eq!(
        (s.role.as_str(), Some(s.epoch)),
        ("leader", epoch),
        "the leader kept its lease"
    );
    // Closed streams give their slots back.
    drop(held);
    let mut v = viewer.clone();
    let mut again = None;
    for _ in 0..50 {
        match v
            .subscribe(api::SubscribeRequest {
                node: "n1".into(),
                from_seq: 0,
            })
            .await
        {
            Ok(s) => {
                again = Some(s);
                break;
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
    assert!(again.is_some(), "a stream after the others closed");
    Ok(())
}

/// Runs `call` from `tasks` tasks in a loop for `secs`, counting answers and refusals
/// (RESOURCE_EXHAUSTED; any other error fails the test).
async fn flood<F, Fut>(tasks: usize, secs: f64, call: F) -> anyhow::Result<(u64, u64)>
where
    F: Fn() -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = Result<(), tonic::Status>> + Send,
{
    let until = Instant::now() + Duration::from_secs_f64(secs);
    let mut all = tokio::task::JoinSet::new();
    for _ in 0..tasks {
        let call = call.clone();
        all.spawn(async move {
            let (mut ok, mut refused) = (0u64, 0u64);
            while Instant::now() < until {
                match call().await {
                    Ok(()) => ok += 1,
                    Err(s) if s.code() == Code::ResourceExhausted => refused += 1,
                    Err(s) => return Err(anyhow::anyhow!("refused otherwise: {s:?}")),
                }
            }
            Ok((ok, refused))
        });
    }
    let (mut ok, mut refused) = (0, 0);
    while let Some(r) = all.join_next().await {
        let (o, f) = r??;
        ok += o;
        refused += f;
    }
    Ok((ok, refused))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn callers_over_a_limit_are_slowed_to_its_pace_not_answered_at_line_rate()
-> anyhow::Result<()> {
    let etcd = EtcdCluster::start(1).await?;
    let dir = tempfile::tempdir()?;
    let allocs = Allocators::start(
        dir.path(),
        &etcd,
        1,
        "pace",
        &[
            "--max-streams-per-identity=4",
            "--node-writes-per-s=5",
            "--node-write-burst=10",
            "--heavy-reads-per-identity-per-s=10",
            "--heavy-read-burst=10",
            "--over-limit-pause-ms=500",
        ],
    )?;
    allocs.wait_leader(Duration::from_secs(20)).await?;
    allocs
        .node_agent(0, "n1")?
        .register_node(api::RegisterNodeRequest {
            inventory: Some(inventory("n1", 2, 16_000, "T4")),
        })
        .await?;
    let epoch = allocs.status(0).await.map(|s| s.epoch);
    let secs = 3.0;

    // A viewer holds its four streams and retries refused ones from 16 tasks on one connection.
    let streams = allocs.viewer(0)?;
    let mut held = Vec::new();
    for _ in 0..4 {
        let mut v = streams.clone();
        held.push(async move {
            v.subscribe(api::SubscribeRequest {
                node: "n1".into(),
                from_seq: 0,
            })
            .await
        });
    }
    let held = futures::future::try_join_all(held).await?;
    let s = streams.clone();
    let subscribes = flood(16, secs, move || {
        let mut v = s.clone();
        async move {
            v.subscribe(api::SubscribeRequest {
                node: "n1".into(),
                from_seq: 0,
            })
            .await
            .map(drop)
        }
    });
    // A node agent floods violation reports past its write budget from four tasks.
    let agent = allocs.node_agent(0, "n1")?;
    let reports = flood(4, secs, move || {
        let mut a = agent.clone();
        async move {
            a.report_violation(api::ReportViolationRequest {
                violation: Some(pb::LimitViolated {
                    allocation_id: 0,
                    node: "n1".into(),
                    gpu_uuid: "GPU-n1-0".into(),
                    pid: 42,
                    used_mib: 1,
                    limit_mib: 0,
                    action: "rogue".into(),
                }),
            })
            .await
            .map(drop)
        }
    });
    let filter = |c: gpuledger_client::Client| {
        move || {
            let mut c = c.clone();
            async move {
                let request = Some(pod("heavy", 1000, 0));
                c.filter(api::FilterRequest {
                    request,
                    nodes: vec![],
                })
                .await
                .map(drop)
            }
        }
    };
    // Another viewer connection filters in a loop from four tasks; the extender, meanwhile,
    // filters as scheduling does: not held to the viewer's pace.
    let filters = flood(4, secs, filter(allocs.viewer(0)?));
    let scheduling = flood(1, secs, filter(allocs.extender(0)?));
    let (subscribes, reports, filters, scheduling) =
        tokio::try_join!(subscribes, reports, filters, scheduling)?;
    drop(held);

    // Unpaced, each flood gets thousands of answers in three seconds; paused 500 ms per
    // refusal, a connection is read six times, each read bringing at most its tasks' calls.
    assert_eq!(subscribes.0, 0, "no stream past the four");
    assert!(
        subscribes.1 <= 16 * 8,
        "{} refused Subscribe calls answered in {secs} s",
        subscribes.1
    );
    assert!(reports.1 > 0, "the write budget bit");
    assert!(
        reports.0 + reports.1 <= 10 + 4 * 8 + 5 * 4,
        "{reports:?} (written, refused) violation reports in {secs} s"
    );
    assert!(
        filters.0 <= 10 + 10 * 3 + 4,
        "{} heavy reads answered in {secs} s at 10/s after a burst of 10",
        filters.0
    );
    assert!(
        scheduling.0 > filters.0 && scheduling.1 == 0,
        "the extender's filters: {scheduling:?}, the viewer's: {filters:?}"
    );
    assert!(limited(&allocs, 0, "connection_paused").await? >= 2.0);
    let st = allocs.status(0).await.expect("status");
    assert_eq!((st.role.as_str(), Some(st.epoch)), ("leader", epoch));
    Ok(())
}

/// One allocator that reviews tokens with the fake API server.
async fn token_stack(allocators: usize) -> anyhow::Result<KubeStack> {
    KubeStack::start(StackOptions {
        etcd_members: 1,
        allocators,
        allocator_flags: vec![],
        extender_flags: None,
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn junk_and_forged_tokens_cost_few_token_reviews() -> anyhow::Result<()> {
    let stack = token_stack(1).await?;
    let dir = tempfile::tempdir()?;
    let reviews = || stack.api.store.token_reviews();
    let mut honest = stack.allocs.viewer(0)?;
    honest.status(api::StatusRequest {}).await?;
    let before = reviews();
    // 300 distinct tokens that are not even JWTs: refused, no review.
    for i in 0..300 {
        let mut c = with_token(&stack, dir.path(), "junk", &format!("junk-{i}"))?;
        let r = c.status(api::StatusRequest {}).await;
        assert_eq!(r.map_err(|s| s.code()).err(), Some(Code::Unauthenticated));
    }
    assert_eq!(reviews(), before, "junk tokens were reviewed");
    // JWT-shaped forgeries for gpuledger: the first few are reviewed, then that address is
    // throttled.
    let b64 = |s: &str| {
        use base64::Engine;
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(s)
    };
    let mut throttled = 0;
    for i in 0..100 {
        let forged = format!(
            "{}.{}.sig",
            b64("{}"),
            b64(&format!(
                r#"{{"aud":["gpuledger"],"exp":4000000000,"n":{i}}}"#
            ))
        );
        let mut c = with_token(&stack, dir.path(), "forged", &forged)?;
        match c.status(api::StatusRequest {}).await {
            Err(s) if s.code() == Code::ResourceExhausted => throttled += 1,
            Err(s) => assert_eq!(s.code(), Code::Unauthenticated, "{s:?}"),
            Ok(_) => anyhow::bail!("a forged token was accepted"),
        }
    }
    assert!(
        reviews() - before <= 30,
        "{} reviews for 100 forgeries from one address",
        reviews() - before
    );
    assert_eq!(throttled, 70);
    assert!(limited(&stack.allocs, 0, "token_reviews_failed_per_peer").await? >= 70.0);
    // The honest caller, whose token is known, is served throughout.
    honest.status(api::StatusRequest {}).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_allocator_token_cannot_forward_an_identity_it_did_not_verify() -> anyhow::Result<()> {
    let stack = token_stack(2).await?;
    let allocs = &stack.allocs;
    let leader = allocs.wait_leader(Duration::from_secs(20)).await?;
    let follower = 1 - leader;
    stack.api.add_node("n1", 64)?;
    allocs
        .admin(leader)?
        .register_node(api::RegisterNodeRequest {
            inventory: Some(inventory("n1", 1, 16_000, "T4")),
        })
        .await?;
    // The allocator's own token, with a claim that an admin sent the write.
    let mut allocator = allocs.client_as(leader, &Role::Allocator)?;
    let invented = Caller {
        role: Role::Admin,
        subject: "system:serviceaccount:gpuledger-system:nobody-at-all".into(),
    };
    let mut r = tonic::Request::new(api::RemoveNodeRequest {
        node: "n1".into(),
        reason: "forged".into(),
    });
    r.metadata_mut().insert(
        ON_BEHALF_OF,
        MetadataValue::try_from(on_behalf_of(&invented).to_str()?)?,
    );
    let res = allocator.remove_node(r).await;
    assert_eq!(
        res.as_ref().map_err(tonic::Status::code).err(),
        Some(Code::Unauthenticated),
        "{res:?}"
    );
    // A forwarded token it made up: reviewed, and refused.
    let mut r = tonic::Request::new(api::RemoveNodeRequest {
        node: "n1".into(),
        reason: "forged".into(),
    });
    r.metadata_mut().insert(
        FORWARDED_AUTHORIZATION,
        MetadataValue::from_static("Bearer made-up"),
    );
    let res = allocator.remove_node(r).await;
    assert_eq!(
        res.as_ref().map_err(tonic::Status::code).err(),
        Some(Code::Unauthenticated),
        "{res:?}"
    );
    // Nothing was removed (the allocator's own node sync may have written meanwhile).
    let removed = allocs.events(leader).await?.into_iter().any(|e| {
        matches!(
            e.body,
            Some(gpuledger_ledger::pb::event::Body::NodeRemoved(_))
        )
    });
    assert!(!removed, "a forged forward removed a node");
    // A real admin's write through the follower commits, recorded as the admin's, forwarded
    // by the follower.
    allocs
        .admin(follower)?
        .set_device_health(api::SetDeviceHealthRequest {
            node: "n1".into(),
            gpu_uuid: "GPU-n1-0".into(),
            healthy: false,
            reason: "Xid 79".into(),
            xid: 79,
        })
        .await?;
    let events = allocs.events(leader).await?;
    let actor = events
        .iter()
        .rev()
        .find(|e| {
            matches!(
                &e.body,
                Some(gpuledger_ledger::pb::event::Body::DeviceHealthChanged(h)) if h.node == "n1"
            )
        })
        .and_then(|e| e.actor.clone())
        .expect("the write's actor");
    assert_eq!(actor.role, "admin");
    assert_eq!(
        actor.name,
        "system:serviceaccount:gpuledger-system:gpuledger-admin"
    );
    assert_eq!(
        actor.via, "system:serviceaccount:gpuledger-system:gpuledger-allocator",
        "the forwarding replica is recorded"
    );
    Ok(())
}

/// A node agent's credential cannot write claim prepares and unprepares at line rate: they
/// count against the node's write budget like its reports (a claim prepared and unprepared in
/// a loop commits an event each time).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_prepares_and_unprepares_count_against_the_nodes_write_budget() -> anyhow::Result<()>
{
    let etcd = EtcdCluster::start(1).await?;
    let dir = tempfile::tempdir()?;
    let allocs = Allocators::start(
        dir.path(),
        &etcd,
        1,
        "claims",
        &[
            "--node-writes-per-s=1",
            "--node-write-burst=5",
            "--over-limit-pause-ms=0",
        ],
    )?;
    allocs.wait_leader(Duration::from_secs(20)).await?;
    let mut agent = allocs.node_agent(0, "n1")?;
    let (mut answered, mut refused) = (0, 0);
    for i in 0..20u64 {
        let r = if i % 2 == 0 {
            agent
                .prepare_claim(api::PrepareClaimRequest {
                    node: "n1".into(),
                    allocation_ids: vec![],
                    cdi_device_ids: vec![],
                })
                .await
                .map(drop)
        } else {
            agent
                .unprepare_claim(api::UnprepareClaimRequest {
                    node: "n1".into(),
                    allocation_ids: vec![],
                })
                .await
                .map(drop)
        };
        match r {
            Err(e) if e.code() == Code::ResourceExhausted => refused += 1,
            _ => answered += 1,
        }
    }
    assert!(
        refused >= 10,
        "{refused} of 20 prepares and unprepares refused past a burst of 5 at 1/s ({answered} answered)"
    );
    Ok(())
}
