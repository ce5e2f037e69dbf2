//! Per-caller limits of the allocator's gRPC against hostile callers, on real allocator
//! processes over real TLS: a refusal never brakes a connection that others share (a
//! follower's connection to the leader, which carries every forwarded write); a request whose
//! message never arrives holds no slot in flight and is cut after the body's time bound; and
//! the holders of one identity (two operators' tokens of the viewer ServiceAccount) have a
//! share each.

use std::time::{Duration, Instant};

use gpuledger_auth::CredentialArgs;
use gpuledger_auth::token::AUDIENCE;
use gpuledger_proto::allocator::v1 as api;
use gpuledger_testkit::attacker;
use gpuledger_testkit::kube::{KubeStack, StackOptions};
use gpuledger_testkit::pki::NAMESPACE;
use gpuledger_testkit::workload::inventory;
use gpuledger_testkit::{Allocators, EtcdCluster};
use tokio_util::sync::CancellationToken;
use tonic::Code;

use crate::hostile_tokens::with_token;

/// A `Status` call whose headers are sent and whose message never is, as the caller of
/// `token` (a file in `dir`), to replica 0 of `stack`: its answer.
fn bodiless(
    stack: &KubeStack,
    dir: &std::path::Path,
    name: &str,
    token: &str,
) -> anyhow::Result<tokio::task::JoinHandle<Result<(), tonic::Status>>> {
    let file = dir.join(name);
    std::fs::write(&file, token)?;
    let creds = gpuledger_auth::Credentials::load(&CredentialArgs {
        ca: Some(stack.allocs.ids.pki.ca_file().to_path_buf()),
        token_file: Some(file),
        ..Default::default()
    })?;
    let ch = creds.channel(gpuledger_auth::endpoint(&stack.allocs.addrs[0])?);
    Ok(tokio::spawn(attacker::bodiless(ch, "Status")))
}

/// Regression: a request's slot in flight was taken once its headers were read, and held
/// while its message was awaited, without a time bound; every operator's token is the viewer
/// ServiceAccount's, so one viewer's requests without a body locked every operator out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_without_a_body_hold_no_slot_and_one_viewer_cannot_lock_out_another()
-> anyhow::Result<()> {
    let stack = KubeStack::start(StackOptions {
        etcd_members: 1,
        allocators: 1,
        allocator_flags: vec![
            "--max-in-flight-per-identity=4".into(),
            "--request-body-timeout-ms=1500".into(),
        ],
        extender_flags: None,
    })
    .await?;
    let dir = tempfile::tempdir()?;
    let issue = || {
        stack
            .api
            .store
            .issue_token(NAMESPACE, "gpuledger-viewer", &[AUDIENCE], 3600, None)
            .map_err(|e| anyhow::anyhow!("{}", e.message()))
    };
    let (mallory, operator) = (issue()?, issue()?);
    // Mallory's token is known (reviewed) before the attack.
    with_token(&stack, dir.path(), "m", &mallory)?
        .status(api::StatusRequest {})
        .await?;
    let sent = Instant::now();
    let stalled: Vec<_> = (0..16)
        .map(|i| bodiless(&stack, dir.path(), &format!("b{i}"), &mallory))
        .collect::<anyhow::Result<_>>()?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    // Another operator with a token of the same ServiceAccount, and Mallory's own new calls,
    // are answered while those wait for their bodies.
    for (who, token) in [("operator", &operator), ("mallory", &mallory)] {
        let r = with_token(&stack, dir.path(), who, token)?
            .status(api::StatusRequest {})
            .await;
        assert!(
            r.is_ok(),
            "{who}'s status while 16 requests of Mallory's wait for their bodies: {r:?}"
        );
    }
    // The bodiless requests are cut after the body's time bound, and counted.
    for s in stalled {
        let r = tokio::time::timeout(Duration::from_secs(10), s).await??;
        assert_eq!(
            r.as_ref().map_err(tonic::Status::code).err(),
            Some(Code::DeadlineExceeded),
            "{r:?}"
        );
    }
    let waited = sent.elapsed();
    assert!(
        waited >= Duration::from_millis(1400) && waited < Duration::from_secs(8),
        "cut after {waited:?}"
    );
    let cut = crate::hostile_load::limited(&stack.allocs, 0, "request_body_timeout").await?;
    assert!(cut >= 16.0, "{cut} requests cut for their bodies");
    Ok(())
}

/// The median of `v` (sorted in place).
fn median(v: &mut [Duration]) -> Duration {
    v.sort_unstable();
    v[v.len() / 2]
}

/// Regression: a caller over its in-flight limit on the leader, writing through a follower,
/// had every refusal of its forwarded writes brake the follower's one connection to the
/// leader, and every other caller's writes through that follower waited out the brake.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forwarded_refusal_does_not_brake_the_followers_connection() -> anyhow::Result<()> {
    let etcd = EtcdCluster::start(1).await?;
    let dir = tempfile::tempdir()?;
    let allocs = Allocators::start(
        dir.path(),
        &etcd,
        2,
        "fwdbrake",
        &[
            "--max-in-flight-per-identity=2",
            "--heavy-reads-per-identity-per-s=1",
            "--heavy-read-burst=1",
            "--over-limit-pause-ms=1000",
        ],
    )?;
    let leader = allocs.wait_leader(Duration::from_secs(20)).await?;
    let follower = 1 - leader;
    for n in ["n1", "n2"] {
        allocs
            .node_agent(leader, n)?
            .register_node(api::RegisterNodeRequest {
                inventory: Some(inventory(n, 2, 16_000, "T4")),
            })
            .await?;
    }
    let stop = CancellationToken::new();
    let mut attack = tokio::task::JoinSet::new();
    // The admin holds its two in-flight slots on the leader with dumps that wait their turn
    // (one a second), from four connections of its own...
    for _ in 0..4 {
        let c = allocs.admin(leader)?;
        for _ in 0..4 {
            let (mut c, stop) = (c.clone(), stop.clone());
            attack.spawn(async move {
                while !stop.is_cancelled() {
                    let _ = c.dump(api::DumpRequest {}).await;
                }
            });
        }
    }
    // ...and writes through the follower, which forwards them: the leader refuses them for
    // the admin's calls in flight.
    let through = allocs.admin(follower)?;
    let mut forwarded = Vec::new();
    for _ in 0..4 {
        let (mut c, stop) = (through.clone(), stop.clone());
        forwarded.push(tokio::spawn(async move {
            let mut refused = 0u64;
            while !stop.is_cancelled() {
                let r = c
                    .set_device_health(api::SetDeviceHealthRequest {
                        node: "n1".into(),
                        gpu_uuid: "GPU-n1-0".into(),
                        healthy: true,
                        reason: "flood".into(),
                        xid: 0,
                    })
                    .await;
                if matches!(&r, Err(s) if s.code() == Code::ResourceExhausted) {
                    refused += 1;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            refused
        }));
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    // Another node's agent writes through the same follower meanwhile.
    let mut agent = allocs.node_agent(follower, "n2")?;
    let mut took = Vec::new();
    for i in 0..20u32 {
        let t = Instant::now();
        agent
            .set_device_health(api::SetDeviceHealthRequest {
                node: "n2".into(),
                gpu_uuid: "GPU-n2-0".into(),
                healthy: i % 2 == 0,
                reason: "honest".into(),
                xid: 0,
            })
            .await?;
        took.push(t.elapsed());
    }
    stop.cancel();
    let mut refused = 0;
    for f in forwarded {
        refused += f.await?;
    }
    attack.shutdown().await;
    assert!(
        refused > 0,
        "the admin's forwarded writes were never refused on the leader: the attack did not bite"
    );
    assert!(
        crate::hostile_load::limited(&allocs, leader, "in_flight_per_identity").await? >= 1.0,
        "the refusals were not counted as the admin's calls in flight"
    );
    let p50 = median(&mut took);
    assert!(
        p50 < Duration::from_millis(250),
        "an honest write through the follower took {p50:?} (p50) while another caller's \
         forwarded writes were refused ({refused} refusals): {took:?}"
    );
    Ok(())
}

/// Whether `bytes` do not decode as a `M`.
fn undecodable<M: prost::Message + Default>(bytes: &[u8]) -> bool {
    M::decode(bytes).is_err()
}

/// Regression: tonic answers a message that does not decode with INTERNAL (prost's decode
/// error), as if the server had failed; it is the caller's malformed message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn undecodable_messages_are_invalid_arguments() -> anyhow::Result<()> {
    let etcd = EtcdCluster::start(1).await?;
    let dir = tempfile::tempdir()?;
    let allocs = Allocators::start(dir.path(), &etcd, 1, "undecodable", &[])?;
    allocs.wait_leader(Duration::from_secs(20)).await?;
    let creds = gpuledger_auth::Credentials::load(
        &allocs
            .ids
            .credentials(&gpuledger_auth::identity::Role::Admin)?,
    )?;
    let ch = creds.channel(gpuledger_auth::endpoint(&allocs.addrs[0])?);
    type Check = fn(&[u8]) -> bool;
    let calls: [(&str, Check); 5] = [
        ("Status", undecodable::<api::StatusRequest>),
        ("RegisterNode", undecodable::<api::RegisterNodeRequest>),
        ("Release", undecodable::<api::ReleaseRequest>),
        (
            "SetDeviceHealth",
            undecodable::<api::SetDeviceHealthRequest>,
        ),
        ("Filter", undecodable::<api::FilterRequest>),
    ];
    // Malformed on purpose (a truncated varint, a truncated field, tag 0, wire type 7, a
    // string that is no UTF-8), then pseudo-random bytes.
    let mut bodies: Vec<Vec<u8>> = vec![
        vec![0x08],
        vec![0x0a, 0x05, 0x01],
        vec![0x00, 0x01],
        vec![0x0f],
        vec![0x0a, 0x02, 0xc3, 0x28],
        vec![0x12, 0x02, 0xc3, 0x28],
    ];
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for n in 0..60 {
        bodies.push(
            (0..(n % 23 + 1))
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x as u8
                })
                .collect(),
        );
    }
    let (mut checked, mut wrong) = (0, Vec::new());
    for (name, check) in calls {
        for b in bodies.iter().filter(|b| check(b)) {
            let r = attacker::raw_unary(ch.clone(), name, b.clone()).await;
            checked += 1;
            match r {
                Err(s) if s.code() == Code::InvalidArgument => {}
                other => wrong.push(format!("{name} {b:02x?}: {:?}", other.map(drop))),
            }
        }
    }
    assert!(checked >= 100, "only {checked} undecodable messages sent");
    assert!(
        wrong.is_empty(),
        "{} of {checked} undecodable messages were not INVALID_ARGUMENT:\n{}",
        wrong.len(),
        wrong.join("\n")
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heavy_reads_past_the_pace_wait_a_second_then_are_refused() -> anyhow::Result<()> {
    let etcd = EtcdCluster::start(1).await?;
    let dir = tempfile::tempdir()?;
    let allocs = Allocators::start(
        dir.path(),
        &etcd,
        1,
        "heavy",
        &[
            "--heavy-reads-per-identity-per-s=2",
            "--heavy-read-burst=2",
            "--over-limit-pause-ms=0",
        ],
    )?;
    allocs.wait_leader(Duration::from_secs(20)).await?;
    // Eight dumps at once by one viewer: the burst's two at once, one more each half second,
    // and the rest refused once a turn is more than a second of waiting away.
    let viewer = allocs.viewer(0)?;
    let t = Instant::now();
    let dumps = (0..8).map(|_| {
        let mut v = viewer.clone();
        async move { (v.dump(api::DumpRequest {}).await.map(drop), t.elapsed()) }
    });
    let answers = futures::future::join_all(dumps).await;
    let refused: Vec<_> = answers
        .iter()
        .filter(|(r, _)| matches!(r, Err(s) if s.code() == Code::ResourceExhausted))
        .collect();
    assert!(
        (3..=5).contains(&refused.len()),
        "{} of 8 dumps refused at 2/s after a burst of 2: {answers:?}",
        refused.len()
    );
    assert!(
        refused
            .iter()
            .all(|(_, at)| *at >= Duration::from_millis(400)),
        "refused without waiting for a turn: {answers:?}"
    );
    let n = crate::hostile_load::limited(&allocs, 0, "heavy_reads_per_identity").await?;
    assert_eq!(n, refused.len() as f64);
    Ok(())
}
