//! The fuzzing tier over the parsers of outside input that the extender runs or shares:
//! kube-scheduler's extender JSON (filter, prioritize, bind, preempt), admission reviews and the
//! webhook's mutation, Kubernetes quantities, a pod's GPU request and placement annotations, and
//! the readers of the openb CSV traces and of the ledger archive's segments. Random inputs and
//! mutations of real ones (the captured kube 1.20 requests, the traces, a written segment),
//! [`fuzz::CASES`] each: none may panic. Each test prints how many inputs it tried.

use std::path::Path;

use gpuledger_extender::extender::wire::{
    BindingArgs, ExtenderArgs, PreemptionArgs, node_name, take_node_names,
};
use gpuledger_testkit::fuzz::{self, bytes_like};
use proptest::prelude::*;

/// The captured requests of one kind (`extender` or `webhook`), as bytes.
fn captured(kind: &str) -> Vec<Vec<u8>> {
    let dir = crate::kit::fixtures().join(kind);
    let mut out: Vec<Vec<u8>> = std::fs::read_dir(&dir)
        .expect("the fixtures are in testdata")
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| !p.to_string_lossy().ends_with(".resp.json"))
        .filter_map(|p| std::fs::read(p).ok())
        .collect();
    out.sort();
    assert!(
        !out.is_empty(),
        "no captured {kind} requests in {}",
        dir.display()
    );
    out
}

#[test]
fn fuzz_extender_json() {
    fuzz::run("extender JSON", bytes_like(captured("extender")), |b| {
        if let Ok(mut args) = serde_json::from_slice::<ExtenderArgs<'_>>(&b) {
            if let Some(list) = &args.nodes {
                for n in &list.items {
                    let _ = node_name(n);
                }
            }
            if let Some(pod) = args.pod.take() {
                let _ = gpuledger_request::pod_request(&pod);
            }
            let _ = take_node_names(&mut args);
        }
        let _ = serde_json::from_slice::<BindingArgs>(&b);
        let _ = serde_json::from_slice::<PreemptionArgs>(&b);
    });
}

#[test]
fn fuzz_admission_reviews() {
    fuzz::run("admission reviews", bytes_like(captured("webhook")), |b| {
        if let Ok((_, Some(pod))) = gpuledger_extender::webhook::parse(&b) {
            let _ = gpuledger_extender::webhook::mutation(&pod, Some("gpuledger-scheduler"));
            let _ = gpuledger_request::containers(&pod);
        }
    });
}

/// Any JSON value, shallow and small.
fn json_value() -> impl Strategy<Value = serde_json::Value> {
    use serde_json::Value;
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<f64>().prop_map(Value::from),
        ".{0,12}".prop_map(Value::String),
        "[0-9]{1,4}(\\.[0-9]+)?(m|k|M|G|Gi|Mi|Ki|e[0-9]{1,3}|E)?".prop_map(Value::String),
    ];
    leaf.prop_recursive(3, 32, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::btree_map(
                prop_oneof![
                    Just("gpuledger.io/gpu".to_string()),
                    Just("gpuledger.io/gpu-mem".to_string()),
                    Just("gpuledger.io/gpu-mem-percent".to_string()),
                    Just("gpuledger.io/gpu-core".to_string()),
                    Just("tencent.com/vcuda-core".to_string()),
                    Just("tencent.com/vcuda-memory".to_string()),
                    Just("nvidia.com/gpumem".to_string()),
                    Just("aliyun.com/gpu-mem".to_string()),
                    Just("cpu".to_string()),
                    "[a-z]{1,8}",
                ],
                inner,
                0..4
            )
            .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// A pod whose resources and annotations are random.
fn pod_json() -> impl Strategy<Value = serde_json::Value> {
    use serde_json::json;
    let quantity = prop_oneof![
        "[-+]?[0-9]{0,25}(\\.[0-9]{0,5})?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei|e[-+]?[0-9]{1,4}|x)?",
        ".{0,10}",
    ];
    let names = proptest::sample::select(vec![
        "gpuledger.io/gpu",
        "gpuledger.io/gpu-mem",
        "gpuledger.io/gpu-mem-percent",
        "gpuledger.io/gpu-core",
        "aliyun.com/gpu-mem",
        "nvidia.com/gpu",
        "nvidia.com/gpumem",
        "nvidia.com/gpumem-percentage",
        "nvidia.com/gpucores",
        "tencent.com/vcuda-core",
        "tencent.com/vcuda-memory",
        "cpu",
        "memory",
    ]);
    let resources = prop::collection::btree_map(names, quantity, 0..6);
    let container = (resources.clone(), resources, "[a-z]{0,4}")
        .prop_map(|(l, r, n)| json!({"name": n, "resources": {"limits": l, "requests": r}}));
    let annotations = prop::collection::btree_map(
        proptest::sample::select(vec![
            "gpuledger.io/gpu-type",
            "gpuledger.io/gpu-type-exclude",
            "gpuledger.io/gpu-uuid",
            "gpuledger.io/gpu-uuid-exclude",
            "gpuledger.io/policy",
        ]),
        ".{0,20}",
        0..4,
    );
    // Few containers mostly, sometimes past the 64 a pod may have.
    let containers = prop_oneof![
        4 => prop::collection::vec(container.clone(), 0..4),
        1 => prop::collection::vec(container, 62..67),
    ];
    (containers, annotations).prop_map(|(cs, ann)| {
        json!({"metadata": {"name": "p", "namespace": "ns", "uid": "u", "annotations": ann},
               "spec": {"containers": cs}})
    })
}

#[test]
fn fuzz_quantities() {
    let strategy = prop_oneof![
        ".{0,24}",
        "[-+]?[0-9.]{0,30}(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei|e[-+]?[0-9]{0,6}|E[0-9]{0,4})?",
    ];
    fuzz::run("quantities", strategy, |s: String| {
        if let Ok(v) = gpuledger_ops::quantity::parse(&s) {
            assert!(v.is_finite(), "{s:?} parsed to {v}");
        }
    });
}

#[test]
fn fuzz_pod_requests_and_annotations() {
    let strategy = prop_oneof![pod_json(), json_value()];
    fuzz::run("pod requests", strategy, |v| {
        if let Ok(pod) = serde_json::from_value::<k8s_openapi::api::core::v1::Pod>(v) {
            if let Ok(Some(r)) = gpuledger_request::pod_request(&pod) {
                // Whatever it accepts, the allocator can decode without overflow.
                assert!(r.containers.len() <= 64);
                let _ = gpuledger_ledger::PodRequest::from_pb(r, Default::default());
            }
            let _ = gpuledger_request::placement(&pod);
        }
    });
}

#[test]
fn fuzz_trace_reader() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata/traces/openb");
    let head = |f: &str| -> Vec<u8> {
        let text = std::fs::read_to_string(dir.join(f)).expect("the openb traces are in testdata");
        text.lines()
            .take(12)
            .collect::<Vec<_>>()
            .join("\n")
            .into_bytes()
    };
    let samples = vec![
        head("openb_node_list_gpu_node.csv"),
        head("openb_pod_list_default.csv"),
    ];
    fuzz::run("CSV trace reader", bytes_like(samples), |b| {
        let text = String::from_utf8_lossy(&b);
        let _ = gpuledger_trace::parse_nodes(Path::new("fuzz.csv"), &text);
        let _ = gpuledger_trace::parse_pods(Path::new("fuzz.csv"), &text);
    });
}

#[test]
fn fuzz_archive_reader() {
    use gpuledger_ledger::pb;
    use prost::Message;
    let dir = tempfile::tempdir().expect("a temp dir");
    let archive = gpuledger_archive::Archive::open(dir.path()).expect("an archive");
    // A real segment of two batches to mutate.
    let batch = |first: u64, n: u64| pb::EventBatch {
        version: 1,
        first_seq: first,
        epoch: 1,
        events: (first..first + n)
            .map(|seq| pb::Event {
                seq,
                epoch: 1,
                time_ms: 1,
                actor: None,
                body: Some(pb::event::Body::QuotaSet(pb::QuotaSet {
                    namespace: "a".into(),
                    mem_mib: seq,
                    core_milli: 0,
                })),
            })
            .collect(),
        ..Default::default()
    };
    let mut segment = Vec::new();
    for b in [batch(1, 2), batch(3, 1)] {
        b.encode_length_delimited(&mut segment).expect("encodes");
    }
    archive
        .append(&[
            (batch(1, 2), batch(1, 2).encode_to_vec()),
            (batch(3, 1), batch(3, 1).encode_to_vec()),
        ])
        .expect("appends");
    let file = archive
        .segments()
        .expect("lists")
        .first()
        .expect("one segment")
        .path
        .clone();
    fuzz::run("archive reader", bytes_like(vec![segment]), |b| {
        std::fs::write(&file, &b).expect("writes the segment");
        let _ = archive.read(0, 0, |_| true);
        let _ = archive.read(2, 3, |_| true);
        let _ = archive.last_seq();
    });
}
