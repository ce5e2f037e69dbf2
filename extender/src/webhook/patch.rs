//! The JSON Patch operations the webhook answers with, shared by its mutations (the
//! device-plugin translation, the DRA conversion, a budget's demotion).

use json_patch::jsonptr::PointerBuf;
use json_patch::{AddOperation, PatchOperation};
use k8s_openapi::api::core::v1::Pod;
use serde_json::Value;

/// An `add` operation at the JSON pointer made of `tokens`.
pub fn add(tokens: &[&str], value: Value) -> PatchOperation {
    PatchOperation::Add(AddOperation {
        path: PointerBuf::from_tokens(tokens.iter().copied()),
        value,
    })
}

/// The operation that sets annotation `key` of `pod` to `value`, after the `earlier`
/// operations of the same patch (the map is added with it when neither the pod nor an earlier
/// operation has one: adding the map again would drop what an earlier operation set).
pub fn annotate(pod: &Pod, earlier: &[PatchOperation], key: &str, value: String) -> PatchOperation {
    let map = PointerBuf::from_tokens(["metadata", "annotations"]);
    let has_map = pod.metadata.annotations.is_some()
        || earlier
            .iter()
            .any(|op| matches!(op, PatchOperation::Add(a) if a.path == map));
    if has_map {
        add(&["metadata", "annotations", key], Value::String(value))
    } else {
        add(
            &["metadata", "annotations"],
            serde_json::json!({ key: value }),
        )
    }
}
