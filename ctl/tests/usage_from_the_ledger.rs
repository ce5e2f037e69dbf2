//! `gpuledger usage` against a live allocator on real etcd: the figures equal what the event
//! timestamps (read back from etcd) give by hand, for a window that clips an allocation at each
//! end, one released inside it, ones still held at --until, and ones wholly outside it.

use std::collections::BTreeMap;
use std::process::Command;
use std::time::Duration;

use gpuledger_allocator::log::EtcdLog;
use gpuledger_auth::identity::Role;
use gpuledger_proto::allocator::v1 as api;
use gpuledger_proto::ledger::v1 as pb;
use gpuledger_testkit::pki::credential_flags;
use gpuledger_testkit::workload::inventory;
use gpuledger_testkit::{Allocators, EtcdCluster};
use jiff::Timestamp;
use serde_json::Value;

const MS_PER_HOUR: f64 = 3_600_000.0;

/// Run `gpuledger args…` as the operator whose credential flags are `who`.
fn ctl(who: &[String], args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_gpuledger"))
        .args(args)
        .args(who)
        .env_remove("GPULEDGER_ALLOCATOR")
        .output()
        .expect("gpuledger runs");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!stderr.contains("panicked"), "{stderr}");
    (out.status.success(), stdout, stderr)
}

fn rfc3339(ms: i64) -> String {
    Timestamp::from_millisecond(ms)
        .expect("a valid time")
        .to_string()
}

fn request(ns: &str, name: &str, slices: u32, mem_mib: u64, core_milli: u32) -> api::PodRequest {
    api::PodRequest {
        pod: Some(pb::PodRef {
            uid: format!("uid-{name}"),
            namespace: ns.into(),
            name: name.into(),
        }),
        containers: vec![api::ContainerRequest {
            name: "main".into(),
            slices,
            mem_mib,
            mem_percent: 0,
            core_milli,
        }],
        placement: None,
        cpu_milli: 0,
        memory_mib: 0,
        priority: 0,
        dra: false,
    }
}

/// A number in the table/csv output, as hours, compared with an exact integral in units·ms.
fn assert_hours(shown: &str, exact_unit_ms: u128, per_hour: f64, what: &str) {
    let v: f64 = shown
        .parse()
        .unwrap_or_else(|_| panic!("{what}: {shown:?}"));
    let want = exact_unit_ms as f64 / per_hour;
    assert!(
        (v - want).abs() <= 0.5e-6 + 1e-12,
        "{what}: shown {v}, expected {want}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_matches_the_event_timestamps() -> anyhow::Result<()> {
    let etcd = EtcdCluster::start(1).await?;
    let dir = tempfile::tempdir()?;
    let allocs = Allocators::start(dir.path(), &etcd, 1, "usage", &[])?;
    let leader = allocs.wait_leader(Duration::from_secs(20)).await?;
    for (node, gpus) in [("node-a", 2), ("node-b", 1)] {
        allocs
            .node_agent(leader, node)?
            .register_node(api::RegisterNodeRequest {
                inventory: Some(inventory(node, gpus, 16_000, "NVIDIA A100")),
            })
            .await?;
    }
    let mut c = allocs.extender(leader)?;
    let pause = || tokio::time::sleep(Duration::from_millis(250));
    let reserve = |node: &str, req: api::PodRequest| api::ReserveRequest {
        request: Some(req),
        node: node.into(),
        ttl_ms: 0,
    };
    let release = |name: &str| api::ReleaseRequest {
        pod_uid: format!("uid-{name}"),
        reason: "pod deleted".into(),
        ..Default::default()
    };
    // p0: reserved and released before the window. p1: reserved before it, released inside.
    // p2 (two slices) and p3: reserved inside, still held at --until (p3 released after it,
    // p2 never). p4: reserved after the window.
    c.reserve(reserve("node-a", request("team-c", "p0", 1, 2_000, 100)))
        .await?;
    pause().await;
    c.release(release("p0")).await?;
    pause().await;
    c.reserve(reserve("node-a", request("team-a", "p1", 1, 4_000, 250)))
        .await?;
    pause().await;
    pause().await;
    c.reserve(reserve("node-a", request("team-a", "p2", 2, 3_000, 500)))
        .await?;
    pause().await;
    c.reserve(reserve("node-b", request("team-b", "p3", 1, 8_000, 1_000)))
        .await?;
    pause().await;
    c.release(release("p1")).await?;
    pause().await;
    pause().await;
    c.release(release("p3")).await?;
    pause().await;
    c.reserve(reserve("node-b", request("team-a", "p4", 1, 1_000, 0)))
        .await?;

    // The timestamps the leader gave, straight from etcd.
    let client = etcd.client().await?;
    let log = EtcdLog::new(&client, "usage", Duration::from_secs(5));
    let (batches, _) = log.read(1, 0).await?;
    let mut reserved: BTreeMap<String, i64> = BTreeMap::new();
    let mut released: BTreeMap<u64, i64> = BTreeMap::new();
    let mut ids: BTreeMap<String, u64> = BTreeMap::new();
    for e in batches.iter().flat_map(|b| &b.events) {
        match &e.body {
            Some(pb::event::Body::Reserved(r)) => {
                let name = r.pod.as_ref().expect("pod").name.clone();
                reserved.insert(name.clone(), e.time_ms);
                ids.insert(name, r.allocation_id);
            }
            Some(pb::event::Body::Released(r)) => {
                released.insert(r.allocation_id, e.time_ms);
            }
            _ => {}
        }
    }
    let r = |n: &str| reserved[n];
    let rel = |n: &str| released[&ids[n]];
    let since = (r("p1") + r("p2")) / 2;
    let until = (rel("p1") + rel("p3")) / 2;
    assert!(r("p1") < since && since < r("p2"), "timestamps too close");
    assert!(
        rel("p1") < until && until < rel("p3"),
        "timestamps too close"
    );
    assert!(until < r("p4"));

    // Hand-computed integrals, MiB·ms and core_milli·ms.
    let span = |a: i64, b: i64| (b - a) as u128;
    let p1 = span(since, rel("p1"));
    let p2 = span(r("p2"), until);
    let p3 = span(r("p3"), until);
    let p0_all = span(r("p0"), rel("p0"));
    let want_mib: BTreeMap<&str, u128> = [
        ("p1", 4_000 * p1),
        ("p2", 2 * 3_000 * p2),
        ("p3", 8_000 * p3),
    ]
    .into();
    let want_core: BTreeMap<&str, u128> =
        [("p1", 250 * p1), ("p2", 2 * 500 * p2), ("p3", 1_000 * p3)].into();
    let target = format!("--allocator={}", allocs.addrs[leader]);
    let who = credential_flags(&allocs.ids.credentials(&Role::Viewer)?);
    let (s, u) = (rfc3339(since), rfc3339(until));
    let window = ["--since", s.as_str(), "--until", u.as_str()];

    // json, by namespace: exact integers.
    let (ok, out, err) = ctl(
        &who,
        &[&["usage", &target, "--format", "json"], &window[..]].concat(),
    );
    assert!(ok, "{out}{err}");
    let j: Value = serde_json::from_str(&out)?;
    assert_eq!(j["since_ms"], since, "{out}");
    assert_eq!(j["until_ms"], until, "{out}");
    assert_eq!(j["by"], "namespace");
    let rows = j["rows"].as_array().expect("rows");
    let names: Vec<&str> = rows
        .iter()
        .map(|r| r["namespace"].as_str().expect("namespace"))
        .collect();
    assert_eq!(
        names,
        ["team-a", "team-b"],
        "team-c ended before the window:\n{out}"
    );
    let field = |row: &Value, k: &str| row[k].as_u64().expect(k) as u128;
    assert_eq!(
        field(&rows[0], "gpu_mib_ms"),
        want_mib["p1"] + want_mib["p2"],
        "{out}"
    );
    assert_eq!(
        field(&rows[0], "gpu_core_milli_ms"),
        want_core["p1"] + want_core["p2"]
    );
    assert_eq!(
        field(&rows[0], "allocations"),
        2,
        "p1 and p2, not p4:\n{out}"
    );
    assert_eq!(field(&rows[1], "gpu_mib_ms"), want_mib["p3"]);
    assert_eq!(field(&rows[1], "gpu_core_milli_ms"), want_core["p3"]);
    let total_mib: u128 = want_mib.values().sum();
    assert_eq!(field(&j["total"], "gpu_mib_ms"), total_mib);
    let hours = j["rows"][1]["gpu_core_hours"].as_f64().expect("hours");
    assert!(
        (hours - p3 as f64 / MS_PER_HOUR).abs() < 1e-9,
        "a whole GPU: {hours}"
    );

    // csv, by pod.
    let (ok, out, err) = ctl(
        &who,
        &[
            &["usage", &target, "--by", "pod", "--format", "csv"],
            &window[..],
        ]
        .concat(),
    );
    assert!(ok, "{out}{err}");
    let mut lines = out.lines();
    assert_eq!(
        lines.next(),
        Some("namespace,pod,allocations,gpu_mib_hours,gpu_core_hours,gpu_mib_ms,gpu_core_milli_ms")
    );
    let rows: Vec<Vec<&str>> = lines.map(|l| l.split(',').collect()).collect();
    assert_eq!(rows.len(), 3, "{out}");
    for (row, (ns, pod)) in rows
        .iter()
        .zip([("team-a", "p1"), ("team-a", "p2"), ("team-b", "p3")])
    {
        assert_eq!((row[0], row[1], row[2]), (ns, pod, "1"), "{out}");
        assert_hours(row[3], want_mib[pod], MS_PER_HOUR, pod);
        assert_hours(row[4], want_core[pod], MS_PER_HOUR * 1000.0, pod);
        assert_eq!(row[5], want_mib[pod].to_string(), "{pod}: {out}");
        assert_eq!(row[6], want_core[pod].to_string(), "{pod}: {out}");
    }

    // table, by node.
    let (ok, out, err) = ctl(
        &who,
        &[&["usage", &target, "--by", "node"], &window[..]].concat(),
    );
    assert!(ok, "{out}{err}");
    println!("{out}");
    let table: Vec<Vec<&str>> = out
        .lines()
        .take_while(|l| !l.is_empty())
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(
        table[0],
        ["NODE", "ALLOCATIONS", "GPU-MiB-HOURS", "GPU-CORE-HOURS"],
        "{out}"
    );
    assert_eq!(table.len(), 4, "node-a, node-b, TOTAL:\n{out}");
    let node_a_mib = want_mib["p1"] + want_mib["p2"];
    let node_a_core = want_core["p1"] + want_core["p2"];
    for (row, (name, allocs, mib, core)) in table[1..].iter().zip([
        ("node-a", "2", node_a_mib, node_a_core),
        ("node-b", "1", want_mib["p3"], want_core["p3"]),
        ("TOTAL", "3", total_mib, want_core.values().sum()),
    ]) {
        assert_eq!((row[0], row[1]), (name, allocs), "{out}");
        assert_hours(row[2], mib, MS_PER_HOUR, name);
        assert_hours(row[3], core, MS_PER_HOUR * 1000.0, name);
    }
    let shown = |ms: i64| {
        format!(
            "{:.3}",
            Timestamp::from_millisecond(ms).expect("a valid time")
        )
    };
    assert!(
        out.contains(&format!("window [{}, {})", shown(since), shown(until))),
        "{out}"
    );

    // Without --since the window starts at the ledger's beginning: p0 counts, whole.
    let (ok, out, err) = ctl(&who, &["usage", &target, "--until", &u, "--format", "json"]);
    assert!(ok, "{out}{err}");
    let j: Value = serde_json::from_str(&out)?;
    let team_c = j["rows"]
        .as_array()
        .expect("rows")
        .iter()
        .find(|r| r["namespace"] == "team-c")
        .unwrap_or_else(|| panic!("team-c:\n{out}"));
    assert_eq!(field(team_c, "gpu_mib_ms"), 2_000 * p0_all);
    assert_eq!(field(team_c, "gpu_core_milli_ms"), 100 * p0_all);
    assert!(j["since_ms"].as_i64().expect("since") < r("p0"));

    // Until now (the default): p2 is still held, so it has grown past the window's figure.
    let before = Timestamp::now().as_millisecond();
    let (ok, out, err) = ctl(
        &who,
        &[
            "usage", &target, "--since", &s, "--by", "pod", "--format", "json",
        ],
    );
    assert!(ok, "{out}{err}");
    let j: Value = serde_json::from_str(&out)?;
    let p2_now = j["rows"]
        .as_array()
        .expect("rows")
        .iter()
        .find(|r| r["pod"] == "p2")
        .map(|r| field(r, "gpu_mib_ms"))
        .unwrap_or_default();
    assert!(p2_now >= 6_000 * span(r("p2"), before), "{out}");
    assert!(
        j["rows"]
            .as_array()
            .expect("rows")
            .iter()
            .any(|r| r["pod"] == "p4"),
        "p4 is inside a window up to now:\n{out}"
    );
    Ok(())
}

#[test]
fn bad_usage_input_is_refused_with_a_clear_error() {
    // None of these needs an allocator: they are refused before connecting.
    let target = "--allocator=127.0.0.1:1";
    let who: &[String] = &[];
    let cases: &[(&[&str], &str)] = &[
        (&["--since", "yesterday"], "RFC 3339"),
        (&["--until", "-3 hours"], "--until"),
        (&["--since", "-1x"], "unknown unit"),
        (
            &[
                "--since",
                "2026-01-02T00:00:00Z",
                "--until",
                "2026-01-01T00:00:00Z",
            ],
            "not before --until",
        ),
        (&["--since", "-1h", "--until", "-1h"], "window is empty"),
        (&["--until", "2999-01-01T00:00:00Z"], "in the future"),
        (&["--by", "team"], "invalid value 'team'"),
        (&["--format", "xml"], "invalid value 'xml'"),
    ];
    for (args, want) in cases {
        let (ok, out, err) = ctl(who, &[&["usage", target][..], args].concat());
        assert!(!ok, "{args:?} was accepted:\n{out}");
        assert!(err.contains(want), "{args:?}: expected {want:?} in:\n{err}");
    }
    let (ok, out, _) = ctl(who, &["usage", "--help"]);
    assert!(ok);
    for flag in [
        "--since",
        "--until",
        "--by",
        "--format",
        "--allocator",
        "reserve time",
        "release time",
        "GPU-CORE-HOURS",
    ] {
        assert!(out.contains(flag), "--help does not explain {flag}:\n{out}");
    }
}

/// The fold's per-namespace consumption equals `gpuledger usage` over the same window, with the
/// leader's own timestamps; `gpuledger budget` sets, shows and refuses; `replay --at` shows the
/// budget in force then; the quota refuses a grant over it and writes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn budgets_fold_what_usage_counts() -> anyhow::Result<()> {
    use gpuledger_ledger::Ledger;
    let etcd = EtcdCluster::start(1).await?;
    let dir = tempfile::tempdir()?;
    let allocs = Allocators::start(dir.path(), &etcd, 1, "budget", &[])?;
    let leader = allocs.wait_leader(Duration::from_secs(20)).await?;
    allocs
        .node_agent(leader, "node-a")?
        .register_node(api::RegisterNodeRequest {
            inventory: Some(inventory("node-a", 2, 16_000, "NVIDIA A100")),
        })
        .await?;
    let target = format!("--allocator={}", allocs.addrs[leader]);
    let admin = credential_flags(&allocs.ids.credentials(&Role::Admin)?);
    let viewer = credential_flags(&allocs.ids.credentials(&Role::Viewer)?);
    // `gpuledger budget set NS --amount A --window W --policy P [more]`.
    let set =
        |who: &[String], ns: &str, amount: &str, window: &str, policy: &str, more: &[&str]| {
            let args = [
                "budget", "set", ns, "--amount", amount, "--window", window, "--policy", policy,
            ];
            ctl(who, &[&args[..], more, &[target.as_str()]].concat())
        };
    let mut admin_api = allocs.admin(leader)?;
    let head = async |c: &mut gpuledger_testkit::allocators::Client| -> anyhow::Result<u64> {
        Ok(c.status(api::StatusRequest {}).await?.into_inner().seq)
    };
    let (ok, out, err) = set(&admin, "team-a", "100000", "day", "deny", &[]);
    assert!(ok, "{out}{err}");
    let (ok, out, err) = set(&admin, "*", "1", "1h", "warn", &[]);
    assert!(ok, "{out}{err}");
    let seq_first = head(&mut admin_api).await?;
    let demote = ["--priority-class", "gpu-low"];
    let (ok, out, err) = set(&admin, "team-a", "200000", "day", "demote", &demote);
    assert!(ok && out.contains("written"), "{out}{err}");
    let (ok, out, err) = set(&admin, "team-a", "200000", "day", "demote", &demote);
    assert!(
        ok && out.contains("unchanged"),
        "the same budget again: {out}{err}"
    );
    let seq_second = head(&mut admin_api).await?;

    // Bad input is refused with the reason, and nothing is written.
    for (ns, amount, window, policy, why) in [
        ("team-a", "0", "day", "deny", "out of range"),
        ("team-a", "-5", "day", "deny", "not a whole number"),
        ("team-a", "99999999999999", "day", "deny", "out of range"),
        ("team-a", "5", "fortnight", "deny", "--window"),
        ("team-a", "5", "10s", "deny", "rolling window"),
        ("team-a", "5", "day", "demote", "priority class"),
        ("team-a", "5", "day", "evict", "invalid value"),
        ("Team_A", "5", "day", "deny", "DNS label"),
    ] {
        let (ok, out, err) = set(&admin, ns, amount, window, policy, &[]);
        assert!(!ok, "{amount} {window} {policy} was accepted: {out}");
        assert!(err.contains(why), "{err:?} lacks {why:?}");
    }
    let (ok, _, err) = set(&viewer, "team-a", "5", "day", "deny", &[]);
    assert!(!ok && err.contains("may not call SetBudget"), "{err}");
    assert_eq!(
        head(&mut admin_api).await?,
        seq_second,
        "refused budgets wrote nothing"
    );

    // Consumption with real timestamps, then the fold against `gpuledger usage`.
    let mut c = allocs.extender(leader)?;
    let pause = || tokio::time::sleep(Duration::from_millis(250));
    let reserve = |req: api::PodRequest| api::ReserveRequest {
        request: Some(req),
        node: "node-a".into(),
        ttl_ms: 0,
    };
    let release = |name: &str| api::ReleaseRequest {
        pod_uid: format!("uid-{name}"),
        reason: "pod deleted".into(),
        ..Default::default()
    };
    c.reserve(reserve(request("team-a", "p1", 1, 4_000, 250)))
        .await?;
    pause().await;
    c.reserve(reserve(request("team-b", "p2", 2, 3_000, 0)))
        .await?;
    pause().await;
    c.release(release("p1")).await?;
    pause().await;
    c.reserve(reserve(request("team-a", "p3", 1, 1_000, 1_000)))
        .await?;
    pause().await;
    c.release(release("p2")).await?;
    pause().await;

    let (ok, out, err) = ctl(
        &admin,
        &["budget", "quota", "team-a", "--mem-mib", "5000", &target],
    );
    assert!(ok, "{out}{err}");
    let before_quota = head(&mut admin_api).await?;
    let refused = c
        .reserve(reserve(request("team-a", "p4", 1, 4_001, 0)))
        .await
        .expect_err("over the quota");
    assert!(refused.message().contains("memory quota"), "{refused:?}");
    assert_eq!(
        head(&mut admin_api).await?,
        before_quota,
        "a grant over the quota wrote nothing"
    );
    c.reserve(reserve(request("team-a", "p4", 1, 4_000, 0)))
        .await?;

    let client = etcd.client().await?;
    let log = EtcdLog::new(&client, "budget", Duration::from_secs(5));
    let (batches, _) = log.read(1, 0).await?;
    let mut l = Ledger::new();
    for e in batches.iter().flat_map(|b| &b.events) {
        l.apply(e)?;
    }
    // A window that ends after the last event with allocations still held.
    pause().await;
    let until = l.time_ms() + 200;
    // `gpuledger usage --format json` over [since (default: the first event), until).
    let usage = |since: Option<i64>| -> anyhow::Result<(Value, String)> {
        let (s, u) = (since.map(rfc3339), rfc3339(until));
        let mut args = vec!["usage", &target, "--until", &u, "--format", "json"];
        if let Some(s) = &s {
            args.extend(["--since", s.as_str()]);
        }
        let (ok, out, err) = ctl(&viewer, &args);
        assert!(ok, "{out}{err}");
        Ok((serde_json::from_str(&out)?, out))
    };
    let (j, out) = usage(None)?;
    let rows = j["rows"].as_array().expect("rows");
    assert_eq!(rows.len(), 2, "{out}");
    for row in rows {
        let ns = row["namespace"].as_str().expect("namespace");
        let (mib, core) = l.budgets().consumed(ns, until);
        assert_eq!(
            row["gpu_mib_ms"].as_u64().map(u128::from),
            Some(mib),
            "{ns}: {out}"
        );
        assert_eq!(
            row["gpu_core_milli_ms"].as_u64().map(u128::from),
            Some(core),
            "{ns}"
        );
        assert!(mib > 0);
    }
    // The day window counts from the later of midnight UTC and when counting began.
    let s = l
        .budgets()
        .status("team-a", until)
        .expect("team-a has a budget");
    let (j, out) = usage(Some(s.window_start_ms))?;
    let team_a = j["rows"]
        .as_array()
        .expect("rows")
        .iter()
        .find(|r| r["namespace"] == "team-a")
        .map(|r| r["gpu_mib_ms"].as_u64().map(u128::from))
        .unwrap_or_default();
    assert_eq!(team_a, Some(s.used), "{out}");

    // `gpuledger budget`: team-b spent the 1 MiB-hour default (6000 MiB for ~0.75 s is
    // 1.25 MiB-hours); team-a is within its own.
    let (ok, out, err) = ctl(&viewer, &["budget", &target, "--format", "json"]);
    assert!(ok, "{out}{err}");
    let j: Value = serde_json::from_str(&out)?;
    let row = |ns: &str| {
        j["namespaces"]
            .as_array()
            .expect("namespaces")
            .iter()
            .find(|r| r["namespace"] == ns)
            .cloned()
            .unwrap_or_else(|| panic!("{ns}: {out}"))
    };
    assert_eq!(row("team-b")["exhausted"], true, "{out}");
    assert_eq!(row("team-b")["inherited"], true, "{out}");
    assert!(row("team-b")["recovers_at_ms"].as_i64().is_some(), "{out}");
    assert_eq!(row("team-a")["exhausted"], false, "{out}");
    assert_eq!(row("team-a")["held_mib"], 5_000, "{out}");
    assert_eq!(row("team-a")["quota"]["mem_mib"], 5_000, "{out}");
    let (ok, out, err) = ctl(&viewer, &["budget", &target]);
    assert!(ok, "{out}{err}");
    assert!(out.contains("SPENT") && out.contains("team-a"), "{out}");

    // `replay --at` shows the budget in force at that seq.
    for (seq, amount, policy) in [
        (seq_first, "100000 GPU-MiB-hours", "deny"),
        (seq_second, "200000 GPU-MiB-hours", "demote to gpu-low"),
    ] {
        let (ok, out, err) = ctl(&viewer, &["replay", &target, "--at", &seq.to_string()]);
        assert!(ok, "{out}{err}");
        let line = out
            .lines()
            .find(|l| l.starts_with("team-a"))
            .unwrap_or_else(|| panic!("no team-a budget at seq {seq}:\n{out}"));
        assert!(
            line.contains(amount) && line.contains(policy),
            "seq {seq}: {line}"
        );
    }
    Ok(())
}
