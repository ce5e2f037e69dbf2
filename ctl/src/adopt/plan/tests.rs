use super::*;
use gpuledger_ledger::Command;
use gpuledger_testkit::workload::inventory;
use serde_json::json;

fn ledger() -> Ledger {
    let mut l = Ledger::new();
    for node in ["n1", "n2"] {
        l.execute(
            Command::RegisterNode(inventory(node, 2, 16384, "A100")),
            1,
            0,
        )
        .expect("register");
    }
    l
}

fn hami(name: &str, node: &str, devices: &str) -> Pod {
    pod(
        name,
        node,
        json!({
            "hami.io/vgpu-node": node,
            "hami.io/bind-phase": "success",
            "hami.io/vgpu-devices-allocated": devices,
        }),
        json!({}),
    )
}

fn pod(name: &str, node: &str, ann: serde_json::Value, limits: serde_json::Value) -> Pod {
    serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": "team", "uid": format!("uid-{name}"),
                     "annotations": ann},
        "spec": {"nodeName": node, "containers": [
            {"name": "main", "image": "x", "resources": {"limits": limits}}]},
        "status": {"phase": "Running"}
    }))
    .expect("pod")
}

fn outcome<'a>(plan: &'a [Entry], name: &str) -> &'a PlanOutcome {
    &plan
        .iter()
        .find(|e| e.pod.name == name)
        .unwrap_or_else(|| panic!("{name} in {plan:?}"))
        .outcome
}

#[test]
fn the_three_peers_pods_resolve_to_registered_gpus() {
    let mut l = ledger();
    let pods = vec![
        hami("h", "n1", "GPU-n1-0,NVIDIA,4000,30:;"),
        pod(
            "s",
            "n1",
            json!({"ALIYUN_COM_GPU_MEM_IDX": "1", "ALIYUN_COM_GPU_MEM_POD": "4",
                   "ALIYUN_COM_GPU_MEM_DEV": "16", "ALIYUN_COM_GPU_MEM_ASSIGNED": "true"}),
            json!({"aliyun.com/gpu-mem": "4"}),
        ),
        pod(
            "m",
            "n2",
            json!({"tencent.com/predicate-node": "n2", "tencent.com/gpu-assigned": "true",
                   "tencent.com/predicate-gpu-idx-0": "0,1"}),
            json!({"tencent.com/vcuda-core": "200"}),
        ),
        pod("plain", "n1", json!({}), json!({})),
    ];
    let plan = plan(&mut l, &pods);
    assert_eq!(plan.len(), 3, "the pod of no peer is not listed: {plan:?}");
    for e in &plan {
        assert_eq!(e.outcome, PlanOutcome::Adopt, "{e:?}");
    }
    let shares = |name: &str| -> Vec<(String, u64, u32)> {
        plan.iter()
            .find(|e| e.pod.name == name)
            .expect("entry")
            .containers
            .iter()
            .flat_map(|c| &c.shares)
            .map(|s| (s.gpu_uuid.clone(), s.mem_mib, s.core_milli))
            .collect()
    };
    assert_eq!(shares("h"), vec![("GPU-n1-0".into(), 4000, 300)]);
    assert_eq!(
        shares("s"),
        vec![("GPU-n1-1".into(), 4096, 0)],
        "4 of 16 units"
    );
    assert_eq!(
        shares("m"),
        vec![
            ("GPU-n2-0".into(), 16384, 1000),
            ("GPU-n2-1".into(), 16384, 1000)
        ]
    );
    // The plan advanced the copy: planning again holds them all.
    let again = super::plan(&mut l, &pods);
    assert!(
        again
            .iter()
            .all(|e| matches!(e.outcome, PlanOutcome::Held(_))),
        "{again:?}"
    );
}

#[test]
fn over_commit_unknown_gpus_and_finished_pods_are_shown() {
    let mut l = ledger();
    let mut done = hami("done", "n1", "GPU-n1-0,NVIDIA,1000,0:;");
    done.status.as_mut().expect("status").phase = Some("Succeeded".into());
    let pods = vec![
        hami("first", "n1", "GPU-n1-0,NVIDIA,12000,50:;"),
        hami("second", "n1", "GPU-n1-0,NVIDIA,8000,20:;"),
        hami("ghost", "n1", "GPU-elsewhere,NVIDIA,1000,0:;"),
        hami("moved", "n1", "GPU-n2-0,NVIDIA,1000,0:;"),
        hami("unregistered", "n9", "GPU-n9-0,NVIDIA,1000,0:;"),
        done,
    ];
    let plan = plan(&mut l, &pods);
    assert_eq!(outcome(&plan, "first"), &PlanOutcome::Adopt);
    let PlanOutcome::Refused(why) = outcome(&plan, "second") else {
        panic!("{plan:?}")
    };
    assert!(why.contains("GPU-n1-0 holds team/first"), "{why}");
    let PlanOutcome::Refused(why) = outcome(&plan, "ghost") else {
        panic!()
    };
    assert!(why.contains("no node registers GPU GPU-elsewhere"), "{why}");
    let PlanOutcome::Refused(why) = outcome(&plan, "moved") else {
        panic!()
    };
    assert!(why.contains("registered on node n2, not n1"), "{why}");
    let PlanOutcome::Refused(why) = outcome(&plan, "unregistered") else {
        panic!()
    };
    assert!(why.contains("node n9 is not registered"), "{why}");
    assert!(
        plan.iter().all(|e| e.pod.name != "done"),
        "finished pods hold nothing"
    );
}
