//! GPUBudget objects into the ledger. Every replica watches them (the SetBudget and SetQuota
//! RPCs refuse namespaces an object governs, from the same cache); only the leader writes, as
//! `BudgetSet`/`BudgetRemoved`/`QuotaSet` through the same sequencer path as the RPCs, and
//! only where the ledger differs, so restarts and failovers write nothing twice. The leader
//! also writes each object's status and, when that changes, an Event on it.
//!
//! Rules: one GPUBudget governs a namespace (the first by name; the others are refused); the
//! object named `default` in `--budget-default-namespace` is the cluster default. A budget a
//! GPUBudget wrote carries `source = "GPUBudget ns/name"`: when no object governs its
//! namespace any more, the budget is removed (and the namespace's quota cleared). What a pass
//! decides is in [`plan`]; this shell gathers its inputs and applies its fixes.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use futures::StreamExt;
use gpuledger_crd::{ANN_DEMOTED, GPUBudget, GPUBudgetStatus, STATE_APPLIED, STATE_REFUSED};
use gpuledger_ledger::state::budget_summary;
use gpuledger_ledger::{Command, CommandError, pb};
use gpuledger_ops::events::{Kind, PodEvent, to_event};
use k8s_openapi::api::core::v1::{Event, ObjectReference, Pod};
use k8s_openapi::api::scheduling::v1::PriorityClass;
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use tokio::sync::{Mutex, Notify};
use tokio::task::JoinSet;
use tracing::{debug, warn};

use self::plan::{Fix, governing, no_class};
use crate::runtime::{Runtime, Unwritten};
use crate::shared::Shared;
use crate::writer::Writer;

pub mod plan;

/// The default of `--budget-default-namespace`: the namespace `deploy/` installs into.
const DEFAULT_NAMESPACE: &str = "gpuledger-system";

/// How often the leader compares the objects with the ledger besides reacting to the watch
/// (it catches a leadership change, and a PriorityClass created after its budget was refused).
const RESYNC: Duration = Duration::from_secs(2);

/// Flags of the GPUBudget watch.
#[derive(clap::Args, Debug, Clone)]
pub struct BudgetArgs {
    /// The namespace whose GPUBudget named `default` is the cluster default budget (for
    /// namespaces without their own): the allocator's own namespace.
    #[arg(long, env = "GPULEDGER_BUDGET_DEFAULT_NAMESPACE", default_value = DEFAULT_NAMESPACE)]
    pub budget_default_namespace: String,
}

impl Default for BudgetArgs {
    fn default() -> Self {
        BudgetArgs {
            budget_default_namespace: DEFAULT_NAMESPACE.into(),
        }
    }
}

/// What the budget RPCs check against Kubernetes: which namespaces a GPUBudget governs, and
/// whether a priority class exists. Set once the watch runs; absent without Kubernetes.
#[derive(Clone)]
pub struct BudgetGuard {
    store: Store<GPUBudget>,
    client: kube::Client,
    default_ns: String,
}

/// Where the gRPC service finds the guard once the watch sets it.
pub type GuardSlot = Arc<OnceLock<BudgetGuard>>;

impl BudgetGuard {
    /// The GPUBudget ("ns/name") that governs ledger namespace `ns` ("" = cluster default).
    pub fn governed_by(&self, ns: &str) -> Option<String> {
        let groups = governing(&self.store.state(), &self.default_ns);
        let o = groups.get(ns)?.first()?;
        Some(format!(
            "{}/{}",
            o.namespace().unwrap_or_default(),
            o.name_any()
        ))
    }

    /// Whether PriorityClass `name` exists; an error when the API server cannot say.
    pub async fn priority_class_exists(&self, name: &str) -> Result<bool, kube::Error> {
        let api: Api<PriorityClass> = Api::all(self.client.clone());
        Ok(api.get_opt(name).await?.is_some())
    }

    /// Refuse an RPC's budget change (`remove`: a removal) that a GPUBudget owns, or a demote
    /// budget whose priority class does not exist. Nothing is written when it refuses.
    pub async fn check_budget(&self, b: &pb::BudgetSet, remove: bool) -> Result<(), Refusal> {
        self.check_owner(&b.namespace, "budget")?;
        if remove || b.policy != pb::BudgetPolicy::Demote as i32 || b.priority_class.is_empty() {
            return Ok(());
        }
        match self.priority_class_exists(&b.priority_class).await {
            Ok(true) => Ok(()),
            Ok(false) => Err(Refusal::NoPriorityClass(b.priority_class.clone())),
            Err(source) => Err(Refusal::Unchecked {
                class: b.priority_class.clone(),
                source,
            }),
        }
    }

    /// Refuse a change to what a GPUBudget governs (`what`: "budget" or "quota"): the object
    /// is where it is changed.
    pub fn check_owner(&self, ns: &str, what: &'static str) -> Result<(), Refusal> {
        match self.governed_by(ns) {
            Some(by) => Err(Refusal::Governed {
                what,
                namespace: ns.to_owned(),
                by,
            }),
            None => Ok(()),
        }
    }
}

/// Why the budget RPCs refused a change; nothing was written.
#[derive(Debug, thiserror::Error)]
pub enum Refusal {
    /// A GPUBudget object (`by`, "ns/name") governs the namespace ("" = the cluster default):
    /// the change belongs in that object. Not retryable.
    #[error(
        "the {what} of {} is set by GPUBudget {by}: change or delete that object \
         (kubectl edit gpubudget -n {})",
        governed_place(namespace),
        by.split('/').next().unwrap_or_default()
    )]
    Governed {
        /// What the change sets: "budget" or "quota".
        what: &'static str,
        /// The ledger namespace.
        namespace: String,
        /// The governing object.
        by: String,
    },
    /// A demote budget names a priority class the cluster does not have. Retryable once the
    /// class is created.
    #[error("{}", no_class(.0))]
    NoPriorityClass(String),
    /// The API server could not say whether the priority class exists. Retryable.
    #[error("could not check that priority class {class:?} exists: {source}")]
    Unchecked {
        /// The priority class.
        class: String,
        /// Why the API server did not answer.
        source: kube::Error,
    },
}

/// Ledger namespace `ns` as a refusal names it.
fn governed_place(ns: &str) -> String {
    if ns.is_empty() {
        "the cluster default".to_owned()
    } else {
        format!("namespace {ns}")
    }
}

/// The leader's side: the objects, the ledger, and the writes between them.
struct Watch {
    rt: Runtime,
    shared: Arc<Shared>,
    guard: BudgetGuard,
    ready: AtomicBool,
    /// One pass at a time: the watch and the resync both start passes.
    pass: Mutex<()>,
}

impl Watch {
    fn leading(&self) -> bool {
        self.rt.leading()
    }

    /// Compare every object with the ledger and write the differences (leader only).
    async fn reconcile(&self) {
        let _one = self.pass.lock().await;
        if !self.leading() || !self.ready.load(Ordering::Relaxed) {
            return;
        }
        let groups = governing(&self.guard.store.state(), &self.guard.default_ns);
        let fixes = {
            let l = self.shared.view().await;
            plan::plan(&groups, l.budgets().budgets(), l.quotas())
        };
        for fix in fixes {
            match fix {
                Fix::Apply {
                    object,
                    budget,
                    write_budget,
                    quota,
                } => self.apply(&object, budget, write_budget, quota).await,
                Fix::Refuse { object, why } => self.refuse(&object, why).await,
                Fix::Remove {
                    ns,
                    source,
                    clear_quota,
                } => self.remove(&ns, &source, clear_quota).await,
            }
        }
    }

    /// Write what `o` asks (the budget when `write_budget`, the quota when given), then mark
    /// it applied.
    async fn apply(
        &self,
        o: &GPUBudget,
        budget: pb::BudgetSet,
        write_budget: bool,
        quota: Option<pb::QuotaSet>,
    ) {
        let class = &budget.priority_class;
        if write_budget && !class.is_empty() {
            match self.guard.priority_class_exists(class).await {
                Ok(true) => {}
                Ok(false) => return self.refuse(o, no_class(class)).await,
                Err(e) => {
                    warn!(class = %class, error = %e, "could not read the priority class; retrying");
                    return;
                }
            }
        }
        let what = format!("GPUBudget {}", name_of(o));
        let changed = write_budget || quota.is_some();
        let mut seq = self.shared.view().await.seq();
        if write_budget {
            match self.write(Command::SetBudget(budget.clone()), &what).await {
                Ok(s) => seq = s,
                Err(Some(why)) => return self.refuse(o, why).await,
                Err(None) => return,
            }
        }
        if let Some(quota) = quota {
            match self.write(Command::SetQuota(quota), &what).await {
                Ok(s) => seq = s,
                Err(Some(why)) => return self.refuse(o, why).await,
                Err(None) => return,
            }
        }
        let message = budget_summary(&budget);
        self.set_status(o, STATE_APPLIED, Some(seq), &message).await;
        if changed {
            self.event(
                o,
                Kind::Normal,
                "BudgetApplied",
                format!("written to the GPU ledger at seq {seq}: {message}"),
            )
            .await;
        }
    }

    /// Remove the budget of `ns` that `source` wrote and is gone (and the quota with it).
    async fn remove(&self, ns: &str, source: &str, clear_quota: bool) {
        let removed = self
            .write(
                Command::RemoveBudget(pb::BudgetRemoved {
                    namespace: ns.to_string(),
                    source: source.to_string(),
                }),
                &format!("remove the budget of {ns:?}: {source} is gone"),
            )
            .await;
        if removed.is_ok() && clear_quota {
            let _ = self
                .write(
                    Command::SetQuota(pb::QuotaSet {
                        namespace: ns.to_string(),
                        ..Default::default()
                    }),
                    &format!("clear the quota of {ns}: {source} is gone"),
                )
                .await;
        }
    }

    /// Submit `cmd` as the leader: the seq it committed at; `Err(Some(why))` when the ledger
    /// refuses it, `Err(None)` when it should be tried again (not leading, leadership lost).
    async fn write(&self, cmd: Command, what: &str) -> Result<u64, Option<String>> {
        match self.rt.write(cmd, what).await {
            Ok(c) => Ok(c.seq),
            Err(Unwritten::Refused(
                CommandError::Invalid(why) | CommandError::Unsatisfiable(why),
            )) => Err(Some(why)),
            Err(_) => Err(None),
        }
    }

    /// Refuse `o`: nothing is written; its status, a log line and (once) an Event say why.
    async fn refuse(&self, o: &GPUBudget, why: String) {
        if plan::already_refused(o, &why) {
            return;
        }
        warn!(object = %name_of(o), reason = %why, "GPUBudget refused");
        self.set_status(o, STATE_REFUSED, None, &why).await;
        self.event(o, Kind::Warning, "BudgetRefused", why).await;
    }

    async fn set_status(&self, o: &GPUBudget, state: &str, seq: Option<u64>, message: &str) {
        let want = GPUBudgetStatus {
            observed_generation: o.metadata.generation,
            state: state.into(),
            seq,
            message: message.into(),
        };
        if o.status.as_ref() == Some(&want) {
            return;
        }
        // Every field named, nulls included: a merge patch keeps what it does not name.
        let patch = k8s_openapi::serde_json::json!({"status": {
            "observedGeneration": want.observed_generation,
            "state": want.state,
            "seq": want.seq,
            "message": want.message,
        }});
        let api: Api<GPUBudget> = Api::namespaced(
            self.guard.client.clone(),
            &o.namespace().unwrap_or_default(),
        );
        if let Err(e) = api
            .patch_status(
                &o.name_any(),
                &PatchParams::default(),
                &Patch::Merge(&patch),
            )
            .await
        {
            warn!(object = %name_of(o), error = %e, "could not write the GPUBudget's status");
        }
    }

    /// An Event on the object (what `kubectl describe gpubudget` shows).
    async fn event(&self, o: &GPUBudget, kind: Kind, reason: &'static str, message: String) {
        let ns = o.namespace().unwrap_or_default();
        let mut ev = to_event(
            &PodEvent {
                namespace: ns.clone(),
                name: o.name_any(),
                uid: o.uid().unwrap_or_default(),
                kind,
                reason,
                message,
            },
            "gpuledger-allocator",
            None,
        );
        ev.involved_object = ObjectReference {
            api_version: Some("gpuledger.io/v1alpha1".into()),
            kind: Some("GPUBudget".into()),
            name: Some(o.name_any()),
            namespace: Some(ns.clone()),
            uid: o.uid(),
            resource_version: o.resource_version(),
            ..Default::default()
        };
        let api: Api<Event> = Api::namespaced(self.guard.client.clone(), &ns);
        if let Err(e) = api.create(&PostParams::default(), &ev).await {
            warn!(object = %name_of(o), reason, error = %e, "could not create the GPUBudget Event");
        }
    }
}

/// Demoted pods told so: the webhook marks a pod it demoted with [`ANN_DEMOTED`] (the pod
/// has no UID at admission); the leader's pod watch gives such a pod one Event while it waits
/// to be scheduled. A new leader may tell a still-pending pod once more.
#[derive(Default)]
pub(crate) struct DemotedPods {
    told: std::sync::Mutex<HashSet<String>>,
}

impl DemotedPods {
    /// The Event `pod` should get now, if any.
    pub(crate) fn event_for(&self, pod: &Pod) -> Option<PodEvent> {
        let uid = pod.metadata.uid.clone()?;
        let mut told = self.told.lock().unwrap_or_else(|p| p.into_inner());
        let scheduled = pod.spec.as_ref().is_some_and(|s| s.node_name.is_some());
        let why = pod.annotations().get(ANN_DEMOTED);
        if scheduled || why.is_none() {
            told.remove(&uid);
            return None;
        }
        if !told.insert(uid.clone()) {
            return None;
        }
        let class = pod
            .spec
            .as_ref()
            .and_then(|s| s.priority_class_name.clone())
            .unwrap_or_default();
        Some(PodEvent {
            namespace: pod.namespace().unwrap_or_default(),
            name: pod.name_any(),
            uid,
            kind: Kind::Warning,
            reason: "GpuBudgetDemoted",
            message: format!(
                "admitted at priority class {class}, so in-budget pods may preempt it: {}",
                why.map_or("", String::as_str)
            ),
        })
    }

    /// Forget a deleted pod.
    pub(crate) fn forget(&self, uid: &str) {
        self.told
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(uid);
    }
}

fn name_of(o: &GPUBudget) -> String {
    format!("{}/{}", o.namespace().unwrap_or_default(), o.name_any())
}

/// Start the watch as tasks of `tasks`, writing through `writer` what differs from `shared`'s
/// state, and hand the RPCs their guard in `slot`.
pub(crate) fn spawn(
    tasks: &mut JoinSet<()>,
    shared: Arc<Shared>,
    writer: Writer,
    slot: &GuardSlot,
    client: kube::Client,
    args: &BudgetArgs,
) {
    let (store, objects) = reflector::store::<GPUBudget>();
    let guard = BudgetGuard {
        store,
        client: client.clone(),
        default_ns: args.budget_default_namespace.clone(),
    };
    let _ = slot.set(guard.clone());
    let rt = Runtime::new("budgets", shared.clone(), writer);
    let w = Arc::new(Watch {
        rt: rt.clone(),
        shared,
        guard,
        ready: AtomicBool::new(false),
        pass: Mutex::new(()),
    });
    let changed = Arc::new(Notify::new());
    let stream = reflector::reflector(
        objects,
        watcher(Api::<GPUBudget>::all(client), watcher::Config::default()),
    )
    .default_backoff();
    let (ww, tell) = (w.clone(), changed.clone());
    tasks.spawn(async move {
        let mut s = std::pin::pin!(stream);
        while let Some(ev) = s.next().await {
            match ev {
                Ok(watcher::Event::InitDone) => {
                    ww.ready.store(true, Ordering::Relaxed);
                    tell.notify_one();
                }
                Ok(watcher::Event::Init) => {}
                Ok(_) => tell.notify_one(),
                Err(e) => warn!(
                    error = %e,
                    "GPUBudget watch error (is the CRD from deploy/ installed?); retrying"
                ),
            }
        }
    });
    tasks.spawn(rt.passes(RESYNC, Some(changed), move |_| {
        let w = w.clone();
        async move {
            w.reconcile().await;
            debug!("GPUBudget pass done");
        }
    }));
}
