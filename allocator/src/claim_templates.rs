//! The ResourceClaimTemplates of pods the webhook converted to the DRA path (docs/dra.md).
//!
//! The webhook writes nothing: it names the template (`gpuledger-<hash of its spec>`) and
//! records the claim requests on the pod. The leader makes the template once the pod exists,
//! from those requests ([`dra::template_of_pod`]: a template's name is the hash of what it
//! asks, so no pod can have a template made under another's name), and collects the managed
//! templates that no pod has claimed for `--claim-template-collect-after`. A review that did
//! not come from the API server therefore creates nothing, and collection cannot race
//! admission: a template deleted while a pod was being admitted on it is made again when the
//! pod appears (kube-controller-manager retries the pod's claim meanwhile).
//!
//! What to make and what to collect is decided in [`plan`]; this shell reads and writes.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use gpuledger_ops::events::{Kind, PodEvent, Recorder};
use gpuledger_request::dra::{self, MANAGED_LABEL};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaimTemplate;
use kube::api::{Api, DeleteParams, ListParams, PostParams, Preconditions};
use kube::runtime::reflector::Store;
use tracing::{debug, info, warn};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;

pub mod plan;

/// How long a template this replica made or found is taken to exist without asking again.
const KNOWN_FOR: Duration = Duration::from_secs(30);
/// Templates remembered at most (then the memory starts over: one more GET each).
const MAX_KNOWN: usize = 65_536;
/// Pods told at most once why their template cannot be made.
const MAX_TOLD: usize = 65_536;

/// The templates' maker and collector (leader only: the caller checks).
pub struct Templates {
    client: kube::Client,
    outcomes: Family<Vec<(&'static str, &'static str)>, Counter>,
    events: Recorder,
    collect_after: Duration,
    /// The unit the templates state `cores` in (`--dra-cores`).
    cores: gpuledger_request::dra::CoresUnit,
    /// Templates made or found, and when.
    known: Mutex<HashMap<(String, String), Instant>>,
    /// Pods already told (an Event) why their template is refused.
    told: Mutex<HashSet<String>>,
}

impl Templates {
    /// A maker writing through `client`, collecting templates unclaimed for `collect_after`,
    /// counting what it does in `outcomes` (by outcome).
    pub fn new(
        client: kube::Client,
        outcomes: Family<Vec<(&'static str, &'static str)>, Counter>,
        events: Recorder,
        collect_after: Duration,
        cores: gpuledger_request::dra::CoresUnit,
    ) -> Self {
        Templates {
            client,
            outcomes,
            events,
            collect_after,
            cores,
            known: Mutex::default(),
            told: Mutex::default(),
        }
    }

    fn count(&self, outcome: &'static str) {
        self.outcomes
            .get_or_create(&vec![("outcome", outcome)])
            .inc();
    }

    fn is_known(&self, key: &(String, String)) -> bool {
        let known = self.known.lock().unwrap_or_else(|p| p.into_inner());
        known.get(key).is_some_and(|t| t.elapsed() < KNOWN_FOR)
    }

    fn remember(&self, key: (String, String)) {
        let mut known = self.known.lock().unwrap_or_else(|p| p.into_inner());
        if known.len() >= MAX_KNOWN {
            known.clear();
        }
        known.insert(key, Instant::now());
    }

    /// Make the template `pod` claims, if it needs one that is not known to exist.
    pub async fn on_pod(&self, pod: &Pod) {
        let Some((ns, wanted)) = plan::wanted(pod, self.cores) else {
            return;
        };
        let t = match wanted {
            Ok(t) => t,
            Err(why) => return self.refuse(pod, &why),
        };
        let name = t.metadata.name.clone().unwrap_or_default();
        let key = (ns.clone(), name.clone());
        if self.is_known(&key) {
            return;
        }
        let api: Api<ResourceClaimTemplate> = Api::namespaced(self.client.clone(), &ns);
        let stored = match api.create(&PostParams::default(), &t).await {
            Ok(s) => {
                info!(namespace = %ns, template = %name, "ResourceClaimTemplate made for a converted pod");
                self.count("created");
                s
            }
            Err(kube::Error::Api(s)) if s.code == 409 => match api.get(&name).await {
                Ok(s) => s,
                Err(e) => {
                    self.count("failed");
                    return warn!(namespace = %ns, template = %name, error = %e, "reading an existing ResourceClaimTemplate failed; retried at the pod's next change or the next pass");
                }
            },
            Err(e) => {
                self.count("failed");
                return warn!(namespace = %ns, template = %name, error = %e, "making a ResourceClaimTemplate failed (the allocator needs create and get on resourceclaimtemplates.resource.k8s.io); retried at the pod's next change or the next pass");
            }
        };
        match dra::same_template(&t, &stored) {
            Ok(()) => self.remember(key),
            Err(why) => self.refuse(pod, &why),
        }
    }

    /// Tell the pod, once, why its template cannot be made.
    fn refuse(&self, pod: &Pod, why: &str) {
        let uid = pod.metadata.uid.clone().unwrap_or_default();
        {
            let mut told = self.told.lock().unwrap_or_else(|p| p.into_inner());
            if told.len() >= MAX_TOLD {
                told.clear();
            }
            if !told.insert(uid.clone()) {
                return;
            }
        }
        self.count("refused");
        let ns = pod.metadata.namespace.clone().unwrap_or_default();
        let name = pod.metadata.name.clone().unwrap_or_default();
        warn!(namespace = %ns, pod = %name, reason = %why, "no ResourceClaimTemplate for a converted pod");
        self.events.emit(PodEvent {
            namespace: ns,
            name,
            uid,
            kind: Kind::Warning,
            reason: "GpuClaimTemplateRefused",
            message: format!(
                "gpuledger makes no ResourceClaimTemplate for this pod, so its GPU claim cannot \
                 be created: {why}"
            ),
        });
    }

    /// One pass over the cluster: every pod's template made, every template that no pod has
    /// claimed for `collect_after` deleted (only that very object: a template of the same
    /// name made since is left alone).
    pub async fn pass(&self, pods: &Store<Pod>) {
        let pods = pods.state();
        for p in &pods {
            self.on_pod(p).await;
        }
        let all: Api<ResourceClaimTemplate> = Api::all(self.client.clone());
        let listed = match all
            .list(&ListParams::default().labels(&format!("{MANAGED_LABEL}=true")))
            .await
        {
            Ok(l) => l.items,
            Err(e) => {
                self.count("failed");
                return warn!(error = %e, "listing gpuledger's ResourceClaimTemplates failed (the allocator needs list on resourceclaimtemplates.resource.k8s.io); retried at the next pass");
            }
        };
        let claimed = plan::claimed(pods.iter().map(|p| p.as_ref()));
        let now = k8s_openapi::jiff::Timestamp::now();
        for t in plan::collectable(&listed, &claimed, now, self.collect_after) {
            let api: Api<ResourceClaimTemplate> =
                Api::namespaced(self.client.clone(), &t.namespace);
            let dp = DeleteParams {
                preconditions: Some(Preconditions {
                    uid: Some(t.uid.clone()),
                    resource_version: None,
                }),
                ..DeleteParams::default()
            };
            match api.delete(&t.name, &dp).await {
                Ok(_) => {
                    info!(namespace = %t.namespace, template = %t.name, "unclaimed ResourceClaimTemplate collected");
                    self.count("collected");
                    self.known
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .remove(&(t.namespace.clone(), t.name.clone()));
                }
                Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => {
                    debug!(namespace = %t.namespace, template = %t.name, "template gone or replaced meanwhile");
                }
                Err(e) => {
                    self.count("failed");
                    warn!(namespace = %t.namespace, template = %t.name, error = %e, "collecting a ResourceClaimTemplate failed; retried at the next pass");
                }
            }
        }
    }

    /// Forget every template this replica knew of (on a new leadership: another replica may
    /// have collected some meanwhile).
    pub fn forget(&self) {
        self.known.lock().unwrap_or_else(|p| p.into_inner()).clear();
    }
}
