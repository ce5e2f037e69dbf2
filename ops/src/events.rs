//! Kubernetes Events on pods: what a user sees in `kubectl describe pod` (placed on a GPU,
//! limit exceeded, identity corrected, reservation expired).
//!
//! Events are best effort and never slow the caller: [`Recorder::emit`] queues the event and a
//! background task creates it (core/v1 `events`, verb `create` only). A full queue or an API
//! error drops the event with a log line; the ledger, not the Event, is the record.

use k8s_openapi::api::core::v1::{Event, EventSource, ObjectReference};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use kube::api::{Api, PostParams};
use tokio::sync::mpsc;
use tracing::{debug, warn};

/// Events waiting to be written before new ones are dropped.
const QUEUE: usize = 1024;

/// `Normal` or `Warning`, as Kubernetes defines them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Something went as it should (a pod placed, a budget applied).
    Normal,
    /// Something an operator or the pod's owner should look at (a refusal, an eviction
    /// refused, an expired nomination).
    Warning,
}

impl Kind {
    fn as_str(self) -> &'static str {
        match self {
            Kind::Normal => "Normal",
            Kind::Warning => "Warning",
        }
    }
}

/// One Event about one pod.
#[derive(Debug, Clone)]
pub struct PodEvent {
    /// The namespace of the object the Event is about (and that the Event is written to).
    pub namespace: String,
    /// The object's name.
    pub name: String,
    /// The object's UID, so the Event stays with this object and not a later one of the
    /// same name.
    pub uid: String,
    /// Whether it is news or a warning.
    pub kind: Kind,
    /// A CamelCase reason, e.g. `GpuPlaced`.
    pub reason: &'static str,
    /// What happened, in a sentence `kubectl describe` shows.
    pub message: String,
}

/// Queues pod Events and writes them in the background. Cheap to clone.
#[derive(Clone)]
pub struct Recorder {
    tx: mpsc::Sender<PodEvent>,
}

impl Recorder {
    /// A recorder writing through `client` as `component` (the Event's source), from `host`
    /// (the node name, for per-node components). Must be called inside a tokio runtime.
    pub fn new(client: kube::Client, component: &str, host: Option<String>) -> Self {
        let (tx, mut rx) = mpsc::channel::<PodEvent>(QUEUE);
        let component = component.to_string();
        tokio::spawn(async move {
            while let Some(ev) = rx.recv().await {
                let api: Api<Event> = Api::namespaced(client.clone(), &ev.namespace);
                let obj = to_event(&ev, &component, host.as_deref());
                match api.create(&PostParams::default(), &obj).await {
                    Ok(_) => debug!(pod = %ev.name, reason = ev.reason, "event created"),
                    Err(e) => {
                        warn!(pod = %ev.name, reason = ev.reason, error = %e, "could not create the pod Event")
                    }
                }
            }
        });
        Recorder { tx }
    }

    /// Queue `ev`; never waits. A full queue drops it with a warning.
    pub fn emit(&self, ev: PodEvent) {
        if let Err(e) = self.tx.try_send(ev) {
            warn!(error = %e, "pod Event dropped: queue full or recorder stopped");
        }
    }
}

/// The core/v1 Event object for `ev`.
pub fn to_event(ev: &PodEvent, component: &str, host: Option<&str>) -> Event {
    let now = k8s_openapi::jiff::Timestamp::now();
    // Event names only need to be unique in the namespace; kubelet uses <pod>.<hex time> too.
    let name = format!("{}.{:x}", ev.name, now.as_nanosecond());
    Event {
        metadata: ObjectMeta {
            name: Some(name),
            namespace: Some(ev.namespace.clone()),
            ..Default::default()
        },
        involved_object: ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Pod".into()),
            name: Some(ev.name.clone()),
            namespace: Some(ev.namespace.clone()),
            uid: (!ev.uid.is_empty()).then(|| ev.uid.clone()),
            ..Default::default()
        },
        reason: Some(ev.reason.to_string()),
        message: Some(ev.message.clone()),
        type_: Some(ev.kind.as_str().to_string()),
        source: Some(EventSource {
            component: Some(component.to_string()),
            host: host.map(str::to_string),
        }),
        first_timestamp: Some(Time(now)),
        last_timestamp: Some(Time(now)),
        count: Some(1),
        reporting_component: Some(component.to_string()),
        reporting_instance: Some(host.unwrap_or(component).to_string()),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn event_names_the_pod_and_says_what_happened() {
        let ev = PodEvent {
            namespace: "ml".into(),
            name: "train-0".into(),
            uid: "u-1".into(),
            kind: Kind::Warning,
            reason: "GpuLimitExceeded",
            message: "over".into(),
        };
        let e = to_event(&ev, "gpuledger-node-agent", Some("node-3"));
        assert_eq!(e.involved_object.kind.as_deref(), Some("Pod"));
        assert_eq!(e.involved_object.uid.as_deref(), Some("u-1"));
        assert_eq!(e.metadata.namespace.as_deref(), Some("ml"));
        assert!(e.metadata.name.unwrap().starts_with("train-0."));
        assert_eq!(e.type_.as_deref(), Some("Warning"));
        assert_eq!(e.source.unwrap().host.as_deref(), Some("node-3"));
    }
}
