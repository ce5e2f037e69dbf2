//! `/metrics` of real replicas reports every figure of issue 8 — seq, epoch, leader,
//! readiness, events by type, reservations by state, per node and per GPU allocation and
//! capacity, unhealthy GPUs, violations — with the values the ledger holds, on the leader and on
//! a follower, in a well-formed OpenMetrics exposition.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use gpuledger_proto::allocator::v1 as api;
use gpuledger_proto::ledger::v1 as pb;
use gpuledger_testkit::http::get;
use gpuledger_testkit::workload::{inventory, pod};
use gpuledger_testkit::{Allocators, EtcdCluster};

/// Every sample of an exposition by its full series name (`name{labels}`), after checking
/// that each line is a comment or `series value` and that the exposition ends with `# EOF`.
fn samples(text: &str) -> HashMap<String, f64> {
    assert!(text.ends_with("# EOF\n"), "no EOF marker:\n{text}");
    let mut out = HashMap::new();
    for line in text.lines() {
        if line.starts_with('#') {
            continue;
        }
        let (series, value) = line
            .rsplit_once(' ')
            .unwrap_or_else(|| panic!("malformed sample line {line:?}"));
        let v: f64 = value
            .parse()
            .unwrap_or_else(|_| panic!("bad value in {line:?}"));
        assert!(
            out.insert(series.to_string(), v).is_none(),
            "series {series} exported twice"
        );
    }
    out
}

fn expect(s: &HashMap<String, f64>, series: &str, want: f64, text: &str) {
    let full = format!("gpuledger_allocator_{series}");
    assert_eq!(s.get(&full), Some(&want), "{full}\n{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_report_what_the_ledger_holds() -> anyhow::Result<()> {
    let etcd = EtcdCluster::start(1).await?;
    let dir = tempfile::tempdir()?;
    let allocs = Allocators::start(dir.path(), &etcd, 2, "metrics", &["--metrics-namespaces"])?;
    let leader = allocs.wait_leader(Duration::from_secs(20)).await?;
    let follower = 1 - leader;
    let mut n1 = allocs.node_agent(leader, "n1")?;
    n1.register_node(api::RegisterNodeRequest {
        inventory: Some(inventory("n1", 2, 16_000, "T4")),
    })
    .await?;
    allocs
        .node_agent(leader, "n2")?
        .register_node(api::RegisterNodeRequest {
            inventory: Some(inventory("n2", 4, 40_000, "A100")),
        })
        .await?;
    // n1's GPU 1 goes bad first, so both reservations on n1 land on GPU 0.
    n1.set_device_health(api::SetDeviceHealthRequest {
        node: "n1".into(),
        gpu_uuid: "GPU-n1-1".into(),
        healthy: false,
        reason: "Xid 79".into(),
        xid: 79,
    })
    .await?;
    let mut c = allocs.extender(leader)?;
    let a = c
        .reserve(api::ReserveRequest {
            request: Some(pod("p1", 5_000, 25)),
            node: "n1".into(),
            ttl_ms: 0,
        })
        .await?
        .into_inner();
    c.reserve(api::ReserveRequest {
        request: Some(pod("p2", 3_000, 10)),
        node: "n1".into(),
        ttl_ms: 0,
    })
    .await?;
    c.reserve(api::ReserveRequest {
        request: Some(pod("p3", 20_000, 50)),
        node: "n2".into(),
        ttl_ms: 0,
    })
    .await?;
    c.confirm_bound(api::ConfirmBoundRequest {
        pod_uid: "p1".into(),
        node: "n1".into(),
    })
    .await?;
    // A budget the pods have spent at once (1 GPU-MiB-hour against 28,000 MiB held) and a quota.
    let mut admin = allocs.admin(leader)?;
    admin
        .set_budget(api::SetBudgetRequest {
            budget: Some(pb::BudgetSet {
                namespace: "default".into(),
                unit: pb::BudgetUnit::GpuMibHours as i32,
                amount: 1,
                window: pb::BudgetWindow::Day as i32,
                policy: pb::BudgetPolicy::Deny as i32,
                ..Default::default()
            }),
            remove: false,
        })
        .await?;
    admin
        .set_quota(api::SetQuotaRequest {
            quota: Some(pb::QuotaSet {
                namespace: "default".into(),
                mem_mib: 50_000,
                core_milli: 0,
            }),
        })
        .await?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let last = n1
        .report_violation(api::ReportViolationRequest {
            violation: Some(pb::LimitViolated {
                allocation_id: a.allocations[0].id,
                node: "n1".into(),
                gpu_uuid: "GPU-n1-0".into(),
                pid: 4242,
                used_mib: 6_000,
                limit_mib: 5_000,
                action: "report".into(),
            }),
        })
        .await?
        .into_inner();
    allocs.wait_seq(last.seq, Duration::from_secs(10)).await?;
    // A follower is ready once it has seen who leads (as /readyz says).
    for h in &allocs.http {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let (code, body) = get(&format!("http://{h}/readyz")).await?;
            if code == 200 {
                break;
            }
            assert!(Instant::now() < deadline, "{h} never ready: {body}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    for (i, is_leader) in [(leader, 1.0), (follower, 0.0)] {
        let (code, text) = get(&format!("http://{}/metrics", allocs.http[i])).await?;
        assert_eq!(code, 200);
        let s = samples(&text);
        expect(&s, "ready", 1.0, &text);
        expect(&s, "is_leader", is_leader, &text);
        expect(&s, "ledger_seq", last.seq as f64, &text);
        expect(&s, "ledger_epoch", last.epoch as f64, &text);
        expect(&s, r#"allocations{state="reserved"}"#, 2.0, &text);
        expect(&s, r#"allocations{state="bound"}"#, 1.0, &text);
        expect(&s, r#"allocations{state="assigned"}"#, 0.0, &text);
        expect(&s, r#"events_total{type="reserved"}"#, 3.0, &text);
        expect(&s, r#"events_total{type="node_registered"}"#, 2.0, &text);
        expect(
            &s,
            r#"events_total{type="device_health_changed"}"#,
            1.0,
            &text,
        );
        expect(&s, "limit_violations_total", 1.0, &text);
        expect(&s, r#"events_total{type="budget_set"}"#, 1.0, &text);
        let ns = r#"{namespace="default"}"#;
        expect(
            &s,
            &format!("namespace_gpu_memory_held_mib{ns}"),
            28_000.0,
            &text,
        );
        expect(
            &s,
            &format!("namespace_gpu_core_held_permille{ns}"),
            850.0,
            &text,
        );
        expect(
            &s,
            &format!("namespace_gpu_memory_quota_mib{ns}"),
            50_000.0,
            &text,
        );
        let nsu = r#"{namespace="default",unit="gpu_mib"}"#;
        expect(&s, &format!("namespace_budget_hours{nsu}"), 1.0, &text);
        expect(&s, &format!("namespace_budget_exhausted{nsu}"), 1.0, &text);
        expect(
            &s,
            &format!("namespace_budget_remaining_hours{nsu}"),
            0.0,
            &text,
        );
        expect(
            &s,
            &format!("namespace_budget_burn_rate{nsu}"),
            28_000.0,
            &text,
        );
        let used = s[&format!("gpuledger_allocator_namespace_budget_used_hours{nsu}")];
        assert!(
            used > 1.0,
            "300 ms of 28,000 MiB is over 2 MiB-hours: {used}"
        );
        assert!(
            s.contains_key(&format!(
                "gpuledger_allocator_namespace_budget_recovery_timestamp_seconds{nsu}"
            )),
            "a spent day budget recovers at midnight\n{text}"
        );
        expect(&s, "nodes", 2.0, &text);
        expect(&s, "gpus", 6.0, &text);
        expect(&s, "gpus_unhealthy", 1.0, &text);
        expect(&s, r#"gpu_unhealthy{node="n1",gpu="1"}"#, 1.0, &text);
        assert!(
            !s.contains_key(r#"gpuledger_allocator_gpu_unhealthy{node="n1",gpu="0"}"#),
            "a healthy GPU has an unhealthy series\n{text}"
        );
        expect(
            &s,
            r#"gpu_memory_allocated_mib{node="n1",gpu="0"}"#,
            8_000.0,
            &text,
        );
        expect(
            &s,
            r#"gpu_memory_allocated_mib{node="n1",gpu="1"}"#,
            0.0,
            &text,
        );
        let n2: f64 = (0..4)
            .map(|g| {
                s[&format!(
                    r#"gpuledger_allocator_gpu_memory_allocated_mib{{node="n2",gpu="{g}"}}"#
                )]
            })
            .sum();
        assert_eq!(n2, 20_000.0, "{text}");
        // Cluster totals, and the free memory stranded on partly allocated GPUs, from the
        // per-GPU series (n1: 2 x 16,000 MiB, n2: 4 x 40,000 MiB).
        let per_gpu = |node: &str, g: u32| {
            s[&format!(
                r#"gpuledger_allocator_gpu_memory_allocated_mib{{node="{node}",gpu="{g}"}}"#
            )]
        };
        let stranded: f64 = (0..2)
            .map(|g| (16_000.0, per_gpu("n1", g)))
            .chain((0..4).map(|g| (40_000.0, per_gpu("n2", g))))
            .filter(|(_, used)| *used > 0.0)
            .map(|(cap, used)| cap - used)
            .sum();
        expect(&s, "cluster_gpu_memory_capacity_mib", 192_000.0, &text);
        expect(&s, "cluster_gpu_memory_allocated_mib", 28_000.0, &text);
        expect(&s, "cluster_gpu_memory_stranded_mib", stranded, &text);
        assert!(stranded >= 8_000.0, "n1's GPU 0 is half used: {stranded}");
        expect(
            &s,
            r#"node_gpu_memory_capacity_mib{node="n1"}"#,
            32_000.0,
            &text,
        );
        expect(
            &s,
            r#"node_gpu_memory_capacity_mib{node="n2"}"#,
            160_000.0,
            &text,
        );
        expect(
            &s,
            r#"node_gpu_core_allocated_permille{node="n1"}"#,
            350.0,
            &text,
        );
        expect(
            &s,
            r#"node_gpu_core_allocated_permille{node="n2"}"#,
            500.0,
            &text,
        );
        expect(
            &s,
            r#"node_gpu_core_capacity_permille{node="n2"}"#,
            4_000.0,
            &text,
        );
    }

    // Only the leader commits: its histograms and leadership counter moved.
    let (_, text) = get(&format!("http://{}/metrics", allocs.http[leader])).await?;
    let s = samples(&text);
    expect(&s, "leaderships_total", 1.0, &text);
    let commits = s["gpuledger_allocator_commit_latency_seconds_count"];
    assert!(commits >= 1.0, "{text}");
    assert_eq!(
        s["gpuledger_allocator_batch_events_count"], commits,
        "one batch size per commit\n{text}"
    );
    Ok(())
}
