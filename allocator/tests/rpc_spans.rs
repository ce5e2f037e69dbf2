//! Every RPC runs in a span that carries its ids: what a request names (pod uid, node,
//! allocation) and what its answer says (seq, epoch) are on every log line of the call.

use crate::support;

use std::time::{Duration, Instant};

use gpuledger_auth::identity::Role;
use gpuledger_proto::allocator::v1 as api;
use gpuledger_testkit::allocators::connect;
use gpuledger_testkit::workload::{inventory, pod};
use gpuledger_testkit::{EtcdCluster, Identities, Pki};
use support::spawn_allocator;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_rpcs_log_lines_carry_its_ids() -> anyhow::Result<()> {
    let etcd = EtcdCluster::start(1).await?;
    let dir = tempfile::tempdir()?;
    let ids = Identities::certs(Pki::new(dir.path())?);
    let mut etcd_flags = vec![format!("--etcd-endpoints={}", etcd.endpoints_flag())];
    etcd_flags.extend(etcd.tls_flags());
    // The span layer's own line per call (at debug) shows the span with its fields.
    let (proc, addr) = spawn_allocator(
        dir.path(),
        &ids,
        "spans",
        etcd_flags,
        "info,tower_http=debug",
    )?;
    let mut c = connect(&addr, &ids.credentials(&Role::Extender)?)?;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Ok(s) = c.status(api::StatusRequest {}).await
            && s.get_ref().role == "leader"
            && s.get_ref().ready
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no leader:\n{}",
            proc.log_tail(20)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    connect(
        &addr,
        &ids.credentials(&Role::NodeAgent { node: "n1".into() })?,
    )?
    .register_node(api::RegisterNodeRequest {
        inventory: Some(inventory("n1", 1, 16_000, "T4")),
    })
    .await?;
    let r = c
        .reserve(api::ReserveRequest {
            request: Some(pod("span-1", 1_000, 0)),
            node: "n1".into(),
            ttl_ms: 0,
        })
        .await?
        .into_inner();
    let refused = c
        .reserve(api::ReserveRequest {
            request: Some(pod("span-2", 1_000, 0)),
            node: "nowhere".into(),
            ttl_ms: 0,
        })
        .await
        .expect_err("an unknown node");
    assert_eq!(refused.code(), tonic::Code::NotFound);

    let want = [
        "method=Reserve".to_string(),
        "pod_uid=span-1".into(),
        "node=n1".into(),
        format!("allocation={}", r.allocations[0].id),
        format!("seq={}", r.seq),
        format!("epoch={}", r.epoch),
    ];
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let log = plain(&std::fs::read_to_string(proc.log_path())?);
        if log
            .lines()
            .any(|l| want.iter().all(|w| l.contains(w.as_str())))
        {
            assert!(
                log.lines()
                    .any(|l| l.contains("pod_uid=span-2") && l.contains("node=nowhere")),
                "the refused call has its span too:\n{log}"
            );
            assert!(
                !log.lines().any(|l| l.contains("ERROR")),
                "a refused request is an answer, not a server error:\n{log}"
            );
            return Ok(());
        }
        assert!(
            Instant::now() < deadline,
            "no log line with {want:?}:\n{log}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The log without its terminal colours.
fn plain(log: &str) -> String {
    let mut out = String::with_capacity(log.len());
    let mut chars = log.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            // An SGR sequence: ESC [ ... m
            for c in chars.by_ref() {
                if c == 'm' {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}
