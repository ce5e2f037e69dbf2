//! DRA claims certified by the ledger (docs/dra.md): the kube-scheduler allocates a share of
//! one of our devices, whose `bindingConditions` hold the pod in PreBind until the allocator
//! has committed a `ClaimGranted` for that exact result **and then** written
//! `gpuledger.io/Granted=True` into the claim's `status.devices`; a result the ledger refuses
//! gets `gpuledger.io/Refused=True` (after its `ClaimRefused`), and the scheduler allocates
//! afresh. A deallocated or deleted claim's grants are released.
//!
//! Every replica watches the claims; only the leader writes (its [`Writer`] answers
//! `NotLeader` elsewhere), through a bounded work queue (`--claim-queue`). On every election
//! and every `--claim-reconcile-interval` the leader lists every claim: a grant whose claim or
//! share is gone is released, an allocated result without its condition is certified. That
//! list replaces a finalizer: a claim deleted while no replica watched is released there.
//! What to do is decided in [`plan`], in what order in the state machine [`certification`]; the
//! writes to Kubernetes are in [`certify`].

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use gpuledger_ledger::{Command, Reply, pb};
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::api::DynamicObject;
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use tokio::task::JoinSet;
use tracing::{debug, info, warn};

use self::certification::{Certification, Outcome, Read, Step, Written};
use self::certify::Claims;
use self::plan::{Allotted, Claim, Release};
use crate::runtime::queue::{Pushed, Queue};
use crate::runtime::{Runtime, Unwritten};
use crate::shared::Shared;
use crate::writer::Writer;

pub mod certification;
pub mod certify;
pub mod plan;

/// Flags of the claim certification.
#[derive(clap::Args, Debug, Clone)]
pub struct ClaimArgs {
    /// Watch resource.k8s.io ResourceClaims and certify those on gpuledger's DRA devices (DRA
    /// mode: the dra overlay and the chart's dra.enabled turn it on). Off, no claim is
    /// certified, and the allocator needs no RBAC for claims.
    #[arg(long = "claim-watch", env = "GPULEDGER_CLAIM_WATCH")]
    pub claim_watch: bool,

    /// How often the leader lists every ResourceClaim against the ledger (besides at every
    /// election), in seconds: grants whose claim or share is gone are released, allocated
    /// results without a gpuledger condition are certified.
    #[arg(
        long = "claim-reconcile-interval",
        env = "GPULEDGER_CLAIM_RECONCILE_INTERVAL",
        value_name = "SECONDS",
        default_value_t = 60,
        value_parser = clap::value_parser!(u64).range(1..)
    )]
    pub claim_reconcile_interval_s: u64,

    /// ResourceClaims waiting to be certified at most; a change beyond it is dropped
    /// (gpuledger_allocator_claim_queue_full_total) and picked up by the next full pass.
    #[arg(
        long = "claim-queue",
        env = "GPULEDGER_CLAIM_QUEUE",
        value_name = "CLAIMS",
        default_value_t = 4096,
        value_parser = clap::value_parser!(u64).range(1..)
    )]
    pub claim_queue: u64,

    /// A ResourceClaimTemplate of gpuledger's (made for a pod the webhook converted) that no
    /// pod has claimed for this many seconds is deleted, at the next full pass.
    #[arg(
        long = "claim-template-collect-after",
        env = "GPULEDGER_CLAIM_TEMPLATE_COLLECT_AFTER",
        value_name = "SECONDS",
        default_value_t = 600,
        value_parser = clap::value_parser!(u64).range(1..)
    )]
    pub claim_template_collect_after_s: u64,

    /// How gpuledger's DRA devices state their `cores` capacity, for the whole cluster:
    /// `thousandths` (a GPU has `cores: 1000`; a claim asks `cores: "300"`) or `fraction` (a
    /// GPU has `cores: 1`; a claim asks `cores: "0.3"`; Kubernetes 1.37 or later, whose
    /// DRAFractionalCapacityRange is on by default). Recorded on every node at its
    /// registration (its slice follows), used for the templates the leader makes and for
    /// certification. The extender's --dra-cores must say the same. A node keeps the unit it
    /// registered with until its agent registers again (restart the agents after a change).
    #[arg(
        long = "dra-cores",
        env = "GPULEDGER_DRA_CORES",
        value_name = "UNIT",
        default_value = "thousandths"
    )]
    pub dra_cores: gpuledger_request::dra::CoresUnit,
}

impl Default for ClaimArgs {
    fn default() -> Self {
        ClaimArgs {
            claim_watch: false,
            claim_reconcile_interval_s: 60,
            claim_queue: 4096,
            claim_template_collect_after_s: 600,
            dra_cores: Default::default(),
        }
    }
}

/// Claims certified at once (their grants share etcd transactions through group commit).
const WORKERS: usize = 16;
/// Refusals remembered so that a claim marked Granted that the ledger cannot hold is recorded
/// once, not at every pass.
const REMEMBERED_REFUSALS: usize = 65_536;

/// A unit of work: everything about one claim (UID; its namespace and name never change),
/// certifying it or, once it is gone, releasing its grants.
///
/// One key per claim for its changes and its deletion alike, so that the queue never hands
/// both to two workers at once: a deletion that comes while a certification of the same claim
/// is in flight waits for it, and then runs on a ledger holding whatever it granted
/// ([`Watch::certify`] waits for its grant to be folded). Every grant of a claim is made by its
/// own work, so the work that finds the claim gone sees every grant it will ever get. With a
/// key per event kind instead, the release could read the ledger before the grant committed,
/// and the grant would hold the room until the next full pass.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Work {
    uid: String,
    ns: String,
    name: String,
}

impl Work {
    /// The work of the claim a watch event carries (its Apply and its Delete alike).
    fn of(o: &DynamicObject) -> Option<Work> {
        Some(Work {
            uid: o.uid()?,
            ns: o.namespace().unwrap_or_default(),
            name: o.name_any(),
        })
    }

    /// "ResourceClaim ns/name (uid)", for messages.
    fn what(&self) -> String {
        format!("ResourceClaim {}/{} ({})", self.ns, self.name, self.uid)
    }
}

/// How long a certification waits for its grant to be folded before letting the claim's
/// next work (its deletion) run; past it, the next full pass releases what that missed.
const FOLD_WAIT: Duration = Duration::from_secs(5);

struct Watch {
    rt: Runtime,
    shared: Arc<Shared>,
    claims: Claims,
    /// The pod watch's pods (the consumers' priorities) and the client that reads a pod it
    /// has not delivered yet.
    pods: Store<Pod>,
    client: kube::Client,
    store: Store<DynamicObject>,
    queue: Arc<Queue<Work>>,
    /// Refusals recorded by this replica ("uid/request/share").
    refused: Mutex<HashSet<String>>,
}

impl Watch {
    fn push(&self, w: Work) {
        if !self.rt.leading() {
            return;
        }
        if self.queue.push(w) == Pushed::Full {
            self.shared.metrics.claim_queue_full.inc();
            debug!("claim queue full (--claim-queue): left to the next full pass");
        }
        self.depth();
    }

    fn depth(&self) {
        let n = i64::try_from(self.queue.waiting()).unwrap_or(i64::MAX);
        self.shared.metrics.claim_queue_depth.set(n);
    }

    /// Certify claim `w`: its stale grants released, each result granted or refused in the
    /// ledger, then the conditions written; or, when the API server no longer has it, its
    /// grants released. What to do next is [`Certification`]'s; this does the reads and writes.
    async fn certify(&self, w: &Work) {
        let (mut m, mut step) = Certification::start(&w.uid, w.what());
        loop {
            step = match step {
                Step::Read { fresh } => {
                    // The ledger before the claim (see [`certification`]); the view is let go
                    // before any write, which a view held would stall.
                    let l = self.shared.view().await;
                    let (mut got, from_api) = self.read_claim(w, fresh).await;
                    if let Read::Claim(Ok(c)) = &mut got {
                        c.priority = self.priority_of(&c.consumers).await;
                    }
                    m.read(got, from_api, &l)
                }
                Step::Release(rel) => {
                    for r in &rel {
                        self.release(r).await;
                    }
                    return;
                }
                Step::Carry(claim, p) => {
                    let written = self.carry(&claim, p).await;
                    m.written(written)
                }
                Step::Done(outcome) => return self.done(w, outcome),
            }
        }
    }

    /// Claim `w` from the watch's cache unless `fresh` (or the cache lacks it), else from the
    /// API server; whether it came from the API server.
    async fn read_claim(&self, w: &Work, fresh: bool) -> (Read, bool) {
        let (ns, name) = (w.ns.as_str(), w.name.as_str());
        if !fresh
            && let Some(o) = self
                .store
                .get(&ObjectRef::new_with(name, self.claims_ar()).within(ns))
        {
            return (
                Read::Claim(Claim::from_json(&certify::to_json(&o)).map(Box::new)),
                false,
            );
        }
        let got = match self.claims.get(ns, name).await {
            Ok(Some(j)) => Read::Claim(Claim::from_json(&j).map(Box::new)),
            Ok(None) => Read::Gone,
            Err(e) => Read::Failed(e.to_string()),
        };
        (got, true)
    }

    /// The highest priority among `consumers` as the API server has their pods (a pod that
    /// cannot be read counts as priority 0: it takes no room kept for a preempting pod).
    async fn priority_of(&self, consumers: &[pb::PodRef]) -> i32 {
        let mut top: Option<i32> = None;
        for p in consumers {
            let prio = match crate::preemption::current_pod(&self.pods, &self.client, p).await {
                Ok(Some(x)) => x.spec.as_ref().and_then(|s| s.priority).unwrap_or(0),
                Ok(None) => 0,
                Err(e) => {
                    debug!(pod = %crate::preemption::pod_name(Some(p)), error = %e, "reading a claim consumer's priority failed");
                    0
                }
            };
            top = Some(top.map_or(prio, |t| t.max(prio)));
        }
        top.unwrap_or(0)
    }

    /// End the nominations of `claim`'s consumers once every result of it is granted.
    async fn end_certified(&self, claim: &Claim) {
        let done = {
            let l = self.shared.view().await;
            plan::nominees_certified(&l, claim)
        };
        for uid in done {
            let cmd = Command::EndNomination {
                pod_uid: uid.clone(),
                reason: format!("certified: {} is granted", claim.what()),
            };
            let _ = self
                .rt
                .write(cmd, &format!("end the nomination of pod {uid}"))
                .await;
        }
    }

    /// Carry out plan `p` for `claim`: its releases, its consumers, each result's step, then
    /// the conditions decided written in one status write.
    async fn carry(&self, claim: &Claim, p: plan::Plan) -> Written {
        for r in &p.releases {
            self.release(r).await;
        }
        if let Some(consumers) = p.consumers {
            self.set_consumers(claim, consumers).await;
        }
        let mut devices = claim.devices.clone();
        let mut marked = Vec::new();
        for (r, step) in p.steps {
            let Some((cond, outcome)) = self.decide(claim, &r, step).await else {
                continue;
            };
            devices = plan::devices_with(&devices, &r, cond);
            marked.push(outcome);
        }
        if marked.is_empty() {
            return Written::Nothing;
        }
        let (ns, name) = (&claim.claim.namespace, &claim.claim.name);
        let rv = &claim.resource_version;
        match self.claims.write_devices(ns, name, rv, devices).await {
            Ok(()) => {
                for (outcome, reason) in marked {
                    self.shared
                        .metrics
                        .claims_certified
                        .get_or_create(&vec![("outcome", outcome), ("reason", reason)])
                        .inc();
                }
                info!(claim = %claim.what(), "ResourceClaim conditions written");
                self.end_certified(claim).await;
                Written::Done
            }
            Err(e) if certify::is_conflict(&e) || certify::is_gone(&e) => {
                debug!(claim = %claim.what(), "ResourceClaim changed or deleted meanwhile; reading it again");
                Written::Conflict
            }
            Err(e) => Written::Failed(e.to_string()),
        }
    }

    /// Log how the certification of `w` ended.
    fn done(&self, w: &Work, outcome: Outcome) {
        let claim = w.what();
        match outcome {
            Outcome::Settled => {}
            Outcome::Unreadable(e) => {
                warn!(%claim, error = %e, "ResourceClaim not understood; skipped")
            }
            Outcome::ReadFailed(e) => {
                warn!(%claim, error = %e, "reading a ResourceClaim failed; left to the next pass")
            }
            Outcome::WriteFailed(e) => {
                self.shared.metrics.claim_status_failures.inc();
                warn!(%claim, error = %e, "writing the ResourceClaim's status failed; retried at its next change or pass");
            }
            Outcome::KeptChanging => {
                self.shared.metrics.claim_status_failures.inc();
                warn!(%claim, "ResourceClaim kept changing; retried at its next change or pass");
            }
        }
    }

    /// Write `step` to the ledger: the condition to set on the result (and its outcome and
    /// reason for the metric), or None when no condition is to be written now.
    async fn decide(
        &self,
        claim: &Claim,
        r: &Allotted,
        step: plan::Step,
    ) -> Option<(k8s_openapi::serde_json::Value, (&'static str, &'static str))> {
        let now = self.now();
        let (refusal, reason) = match step {
            plan::Step::Name { message } => {
                info!(claim = %claim.what(), request = %r.request, "ResourceClaim result's condition named the ledger's grant");
                let cond = plan::condition(
                    plan::GRANTED,
                    plan::REASON_GRANT,
                    &message,
                    claim.generation,
                    &now,
                );
                return Some((cond, ("granted", plan::REASON_GRANT)));
            }
            plan::Step::Grant { grant } => {
                let share = grant.share.clone();
                let what = format!("grant {} request {}", claim.what(), r.request);
                match self.rt.write(Command::GrantClaim(grant), &what).await {
                    Ok(c) => {
                        let a = match &c.reply {
                            Reply::Reserved { allocations, .. } => allocations.first().cloned(),
                            _ => None,
                        }?;
                        info!(claim = %claim.what(), request = %r.request, allocation = a.id, epoch = a.epoch, "ResourceClaim result granted");
                        // The claim's next work (its deletion) must see this grant.
                        self.shared.wait_applied(c.seq, FOLD_WAIT).await;
                        let cond = plan::condition(
                            plan::GRANTED,
                            plan::REASON_GRANT,
                            &plan::granted_message(a.id, a.epoch, &a.node, &a.shares),
                            claim.generation,
                            &now,
                        );
                        return Some((cond, ("granted", plan::REASON_GRANT)));
                    }
                    Err(Unwritten::Refused(e)) => {
                        let reason = plan::refusal_reason(&e)?;
                        (plan::refusal_of(claim, r, e.to_string(), share), reason)
                    }
                    Err(Unwritten::Dropped | Unwritten::Later(_)) => return None,
                }
            }
            plan::Step::Refuse { refusal, reason } => (refusal, reason),
        };
        let message = format!(
            "the GPU ledger refused request {} on {}: {}",
            r.request, r.device, refusal.reason
        );
        if !self.record_refusal(claim, refusal).await {
            return None;
        }
        warn!(claim = %claim.what(), reason, %message, "ResourceClaim result refused");
        let cond = plan::condition(plan::REFUSED, reason, &message, claim.generation, &now);
        Some((cond, ("refused", reason)))
    }

    /// Commit `refusal` (once per result on this replica); whether it is in the ledger.
    async fn record_refusal(&self, claim: &Claim, refusal: pb::ClaimRefused) -> bool {
        let key = format!(
            "{}/{}/{}",
            claim.claim.uid, refusal.request, refusal.share_id
        );
        if self.lock_refused().contains(&key) {
            return true;
        }
        let what = format!("record the refusal of {}", claim.what());
        match self.rt.write(Command::RefuseClaim(refusal), &what).await {
            Ok(_) => {
                let mut s = self.lock_refused();
                if s.len() >= REMEMBERED_REFUSALS {
                    s.clear();
                }
                s.insert(key);
                true
            }
            Err(_) => false,
        }
    }

    fn lock_refused(&self) -> std::sync::MutexGuard<'_, HashSet<String>> {
        self.refused.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Commit the pods `claim` is reserved for now as its grants' consumers.
    async fn set_consumers(&self, claim: &Claim, consumers: Vec<pb::PodRef>) {
        let n = consumers.len();
        let cmd = Command::SetClaimConsumers {
            claim_uid: claim.claim.uid.clone(),
            consumers,
        };
        let what = format!("set the {n} consumers of {}", claim.what());
        let _ = self.rt.write(cmd, &what).await;
    }

    async fn release(&self, r: &Release) {
        let cmd = Command::Release {
            pod_uid: String::new(),
            container: String::new(),
            allocation_id: r.allocation_id,
            reason: r.reason.into(),
        };
        let what = format!(
            "release grant {} of {} ({})",
            r.allocation_id, r.what, r.reason
        );
        if self.rt.write(cmd, &what).await.is_ok() {
            self.shared
                .metrics
                .claim_releases
                .get_or_create(&vec![("reason", r.reason)])
                .inc();
        }
    }

    /// The full pass (leader only): release what no claim holds, queue what needs a step.
    async fn reconcile(&self) {
        // The ledger before the list: a grant it shows was made for a claim the list has,
        // unless that claim is gone.
        let l = self.shared.view().await;
        let listed = match self.claims.list().await {
            Ok(v) => v,
            Err(e) => {
                warn!(error = %e, "listing ResourceClaims failed (is resource.k8s.io/v1 served, may the allocator list resourceclaims?); retried at the next pass");
                return;
            }
        };
        let claims: Vec<Claim> = listed
            .iter()
            .filter_map(|j| Claim::from_json(j).ok())
            .collect();
        let (gone, todo) = plan::plan_all(&l, &claims);
        drop(l);
        for r in &gone {
            self.release(r).await;
        }
        let uids: HashSet<&str> = claims.iter().map(|c| c.claim.uid.as_str()).collect();
        self.lock_refused()
            .retain(|k| uids.contains(k.split('/').next().unwrap_or("")));
        let n = todo.len();
        for i in todo {
            let c = &claims[i].claim;
            self.push(Work {
                uid: c.uid.clone(),
                ns: c.namespace.clone(),
                name: c.name.clone(),
            });
        }
        debug!(
            claims = claims.len(),
            released = gone.len(),
            queued = n,
            "ResourceClaim pass done"
        );
    }

    fn claims_ar(&self) -> kube::api::ApiResource {
        kube::api::ApiResource::erase::<k8s_openapi::api::resource::v1::ResourceClaim>(&())
    }

    /// Now, as a condition's lastTransitionTime (RFC 3339, whole seconds).
    fn now(&self) -> String {
        let ms = self.shared.clock.now_ms();
        k8s_openapi::jiff::Timestamp::from_millisecond(ms)
            .map(|t| t.strftime("%Y-%m-%dT%H:%M:%SZ").to_string())
            .unwrap_or_else(|_| "1970-01-01T00:00:00Z".into())
    }
}

/// Start the claim watch, its workers and its passes as tasks of `tasks`; the watch's claims,
/// None when it is off.
pub(crate) fn spawn(
    tasks: &mut JoinSet<()>,
    shared: Arc<Shared>,
    writer: Writer,
    client: kube::Client,
    pods: Store<Pod>,
    args: &ClaimArgs,
) -> Option<Store<DynamicObject>> {
    if !args.claim_watch {
        info!("no --claim-watch: DRA ResourceClaims are not certified");
        return None;
    }
    let claims = Claims::new(client.clone());
    let ar = kube::api::ApiResource::erase::<k8s_openapi::api::resource::v1::ResourceClaim>(&());
    let store_writer = reflector::store::Writer::<DynamicObject>::new(ar);
    let rt = Runtime::new("claims", shared.clone(), writer);
    let store = store_writer.as_reader();
    let w = Arc::new(Watch {
        rt: rt.clone(),
        shared,
        store: store.clone(),
        queue: Arc::new(Queue::new(
            usize::try_from(args.claim_queue).unwrap_or(usize::MAX),
        )),
        claims: claims.clone(),
        pods,
        client,
        refused: Mutex::default(),
    });
    let stream = reflector::reflector(
        store_writer,
        watcher(claims.all(), watcher::Config::default()),
    )
    .default_backoff();
    let ww = w.clone();
    tasks.spawn(async move {
        let mut s = std::pin::pin!(stream);
        while let Some(ev) = s.next().await {
            match ev {
                // A change and a deletion are one key (see [`Work`]).
                Ok(
                    watcher::Event::Apply(o)
                    | watcher::Event::InitApply(o)
                    | watcher::Event::Delete(o),
                ) => {
                    if let Some(w) = Work::of(&o) {
                        ww.push(w);
                    }
                }
                Ok(watcher::Event::Init | watcher::Event::InitDone) => {}
                Err(e) => warn!(
                    error = %e,
                    "ResourceClaim watch error (is resource.k8s.io/v1 served, may the allocator watch resourceclaims? without --claim-watch it is off); retrying"
                ),
            }
        }
    });
    let ww = w.clone();
    rt.workers(tasks, WORKERS, w.queue.clone(), move |job: Work| {
        let ww = ww.clone();
        async move {
            ww.depth();
            ww.certify(&job).await
        }
    });
    let every = Duration::from_secs(args.claim_reconcile_interval_s.max(1));
    tasks.spawn(rt.passes(every, None, move |_| {
        let w = w.clone();
        async move { w.reconcile().await }
    }));
    Some(store)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Regression: a claim's change and its deletion were two keys, so the release could run
    /// beside the certification, before its grant committed, and miss it.
    #[tokio::test]
    async fn a_deletion_waits_for_the_certification_of_its_claim() {
        let ar =
            kube::api::ApiResource::erase::<k8s_openapi::api::resource::v1::ResourceClaim>(&());
        let mut o = DynamicObject::new("c", &ar).within("team-a");
        o.metadata.uid = Some("u1".into());
        o.metadata.resource_version = Some("7".into());
        let applied = Work::of(&o).expect("a uid");
        // The Delete event carries the claim as last seen, later than the Apply.
        o.metadata.resource_version = Some("8".into());
        let deleted = Work::of(&o).expect("a uid");
        assert_eq!(deleted, applied, "one key per claim");

        let q = Queue::new(8);
        assert_eq!(q.push(applied), Pushed::Queued);
        let certifying = q.pop().await;
        assert_eq!(q.push(deleted), Pushed::Queued);
        let early = tokio::time::timeout(Duration::from_millis(50), q.pop()).await;
        assert!(early.is_err(), "the deletion ran beside the certification");
        q.done(&certifying);
        let next = tokio::time::timeout(Duration::from_secs(5), q.pop())
            .await
            .expect("the deletion runs once the certification is done");
        assert_eq!(next.uid, "u1");
    }
}
