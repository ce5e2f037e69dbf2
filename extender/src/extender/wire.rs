//! The request and answer bodies of the extender verbs, as k8s.io/kube-scheduler/extender/v1
//! spells them (Go field names, no JSON tags).

use std::borrow::Cow;
use std::collections::BTreeMap;

use crate::scheduler_text;

use k8s_openapi::api::core::v1::Pod;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// `ExtenderArgs`: the body of filter, prioritize (and the pod of preempt).
#[derive(Debug, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct ExtenderArgs<'a> {
    /// The pod being scheduled.
    pub pod: Option<Pod>,
    /// Full nodes (extender not nodeCacheCapable).
    pub nodes: Option<NodeList>,
    /// Node names (nodeCacheCapable), borrowed from the request body.
    #[serde(borrow)]
    pub node_names: Option<Vec<Name<'a>>>,
}

/// A node name as the request spells it: borrowed from the body (thousands per request),
/// copied only when JSON escapes make that necessary.
#[derive(Debug, Clone)]
pub struct Name<'a>(pub Cow<'a, str>);

impl<'de: 'a, 'a> Deserialize<'de> for Name<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Str;
        impl<'de> serde::de::Visitor<'de> for Str {
            type Value = Cow<'de, str>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a node name")
            }
            fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(Cow::Borrowed(v))
            }
            fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
                Ok(Cow::Owned(v.to_owned()))
            }
            fn visit_string<E>(self, v: String) -> Result<Self::Value, E> {
                Ok(Cow::Owned(v))
            }
        }
        d.deserialize_str(Str).map(Name)
    }
}

/// A `v1.NodeList` kept as raw JSON so that filter hands back exactly what it got.
#[derive(Debug, Default, Deserialize, Serialize)]
pub struct NodeList {
    /// List metadata, passed through.
    #[serde(default)]
    pub metadata: Value,
    /// The nodes.
    #[serde(default)]
    pub items: Vec<Value>,
}

/// `ExtenderFilterResult`.
#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct FilterResult {
    /// Feasible nodes, when the request carried full nodes.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nodes: Option<NodeList>,
    /// Feasible node names, when the request carried names.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub node_names: Option<Vec<String>>,
    /// Node → why the pod does not fit, for every node it does not fit on: kube-scheduler 1.20
    /// reads only this map.
    #[serde(serialize_with = "scheduler_text::reasons")]
    pub failed_nodes: BTreeMap<String, String>,
    /// Node → why the pod can never fit (preemption will not help). Newer schedulers read it
    /// too, and let it win for a node that is in both maps.
    #[serde(serialize_with = "scheduler_text::reasons")]
    pub failed_and_unresolvable_nodes: BTreeMap<String, String>,
    /// Set when the extender could not decide.
    #[serde(serialize_with = "scheduler_text::text")]
    pub error: String,
}

/// One entry of `HostPriorityList`.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct HostPriority<'a> {
    /// Node name.
    pub host: Cow<'a, str>,
    /// 0..10.
    pub score: i64,
}

/// `ExtenderBindingArgs`.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct BindingArgs {
    /// Pod name.
    pub pod_name: String,
    /// Pod namespace.
    pub pod_namespace: String,
    /// Pod UID.
    #[serde(rename = "PodUID")]
    pub pod_uid: String,
    /// The node chosen by the scheduler.
    pub node: String,
}

/// `ExtenderBindingResult`.
#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct BindingResult {
    /// Empty on success.
    #[serde(serialize_with = "scheduler_text::text")]
    pub error: String,
}

/// `ExtenderPreemptionArgs`.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct PreemptionArgs {
    /// The pod that wants to preempt.
    pub pod: Option<Pod>,
    /// Node → victims as full pods.
    #[serde(default)]
    pub node_name_to_victims: Option<BTreeMap<String, Value>>,
    /// Node → victims as UIDs.
    #[serde(default)]
    pub node_name_to_meta_victims: Option<BTreeMap<String, Value>>,
}

/// `ExtenderPreemptionResult`.
#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct PreemptionResult {
    /// Node → victims as UIDs, for the nodes where preemption can help.
    pub node_name_to_meta_victims: BTreeMap<String, Value>,
}

/// The node names of the request, taken out of it (names, or the names of full nodes).
pub fn take_node_names<'a>(args: &mut ExtenderArgs<'a>) -> Vec<Cow<'a, str>> {
    if let Some(n) = args.node_names.take() {
        return n.into_iter().map(|n| n.0).collect();
    }
    args.nodes
        .as_ref()
        .map(|l| {
            l.items
                .iter()
                .filter_map(node_name)
                .map(Cow::Owned)
                .collect()
        })
        .unwrap_or_default()
}

/// The name of a node as the scheduler sent it (its `metadata.name`).
pub fn node_name(v: &Value) -> Option<String> {
    v.pointer("/metadata/name")?.as_str().map(String::from)
}
