//! Which allocation an Allocate of some devices answers with, as a state machine: the device
//! plugin feeds it the node's view, the time, and what PodResources and the allocator answered,
//! and does what each [`Step`] says. Pure: no IO, no clock.
//!
//! An Allocate is, in order: a repeat (the devices were assigned already and the kubelet still
//! gives them to that container: the same answer), a wait for finished containers still holding
//! the devices in the ledger (the kubelet reuses devices before their release arrives), then the
//! claim of the oldest pending reservation of that size whose pod the kubelet is admitting,
//! looked for again a few times when the allocator refuses the guess because the view was behind.
//!
//! Allocate names no pod, but the kubelet adds a pod to its pod manager just before it admits it
//! (one pod at a time), and PodResources lists the pods of the pod manager with the devices of
//! each container. A reservation whose pod the kubelet does not know yet, or whose container has
//! its devices already, is not for this Allocate: it is passed over, so a pod that skipped the
//! scheduler (its own `spec.nodeName`) never takes another pod's reservation.

use std::time::{Duration, Instant};

use gpuledger_proto::ledger::v1 as pb;
use gpuledger_proto::podresources::v1 as podres;
use tonic::{Code, Status};

use crate::view::View;

/// How many refused claims an Allocate looks again after.
const MAX_REFUSALS: u32 = 5;

/// How long a refused claim waits for the view to move before it looks again.
const REREAD_WAIT: Duration = Duration::from_millis(200);

/// What the device plugin does next for an Allocate.
#[derive(Debug)]
pub enum Step {
    /// Ask PodResources whether the container that holds this allocation still has the
    /// devices, and tell [`Allocate::owner`].
    AskOwner(pb::Allocation),
    /// Wait for the view to change or for `until`, then call [`Allocate::view`].
    Wait {
        /// When to look again even if the view did not change.
        until: Instant,
        /// Why, when the wait begins for a reason worth a log line.
        note: Option<Note>,
    },
    /// List PodResources and tell [`Allocate::listed`] whether the kubelet is admitting this
    /// reservation's pod ([`admitting`]).
    Confirm(pb::Allocation),
    /// Ask the allocator to assign the devices to this reservation, and tell
    /// [`Allocate::assigned`].
    Assign(u64),
    /// Answer the kubelet with this allocation.
    Answer(pb::Allocation, Answered),
    /// Refuse the Allocate (the kubelet retries the admission).
    Refuse(Status),
}

/// Why a wait began.
#[derive(Debug)]
pub enum Note {
    /// These allocations of finished containers still hold some of the devices in the ledger.
    StaleHolders(Vec<u64>),
    /// The allocator refused to assign the devices to this reservation.
    Refused {
        /// The reservation guessed.
        allocation: u64,
        /// What the allocator said.
        status: Status,
    },
}

/// How the answer was found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answered {
    /// The devices were assigned already and their container still has them.
    Repeat,
    /// A holder whose release never came has exactly these devices: its answer was lost.
    Lost,
    /// The view shows the devices assigned (by an earlier Allocate) while looking.
    Assigned,
    /// The allocator assigned the devices to the reservation guessed.
    Claimed {
        /// When the look for a reservation began.
        started: Instant,
        /// How many guesses the allocator refused before.
        refusals: u32,
    },
}

/// One Allocate of `ids` on `node`.
#[derive(Debug)]
pub struct Allocate {
    ids: Vec<String>,
    node: String,
    wait: Duration,
    phase: Phase,
}

#[derive(Debug)]
enum Phase {
    Start,
    /// Asked whether the container holding this allocation still has the devices.
    Repeat(pb::Allocation),
    /// Waiting until `until` for these holders' release.
    Stale {
        stale: Vec<u64>,
        until: Instant,
    },
    /// Looking for a reservation to claim.
    Claim(Claim),
    /// Asked PodResources whether the kubelet is admitting the pod of `guess`.
    Confirming {
        claim: Claim,
        guess: u64,
    },
    /// Asked PodResources whether the kubelet is admitting again the pod of `holder`, assigned
    /// other devices by an Allocate whose answer was lost.
    ConfirmingLost {
        claim: Claim,
        holder: u64,
    },
    /// Asked the allocator to assign `guess`.
    Assigning {
        claim: Claim,
        guess: u64,
    },
    /// After a refusal: waiting until `until` for the view to move past `seq`.
    Reread {
        claim: Claim,
        seq: u64,
        until: Instant,
    },
    Done,
}

#[derive(Debug, Clone)]
struct Claim {
    started: Instant,
    deadline: Instant,
    refusals: u32,
    /// Reservations whose pods the kubelet is not admitting.
    passed: Vec<u64>,
    /// Assigned allocations whose pods the kubelet is not admitting again.
    not_lost: Vec<u64>,
}

/// Whether the kubelet is admitting a reservation's pod, from its PodResources listing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Admitting {
    /// The pod is known to the kubelet and the reservation's container has no devices yet.
    Yes,
    /// Not this pod, and why.
    No(String),
}

/// Whether `list` (PodResources `List`) shows the kubelet admitting the container of `a`: its
/// pod is known (the kubelet adds a pod just before admitting it) and the container holds no
/// `resource` devices yet (they are recorded once its Allocate is answered). A container not
/// listed counts as admitting (kubelets list no init containers).
pub fn admitting(
    list: &podres::ListPodResourcesResponse,
    a: &pb::Allocation,
    resource: &str,
) -> Admitting {
    let pod = a.pod.clone().unwrap_or_default();
    let Some(p) = list
        .pod_resources
        .iter()
        .find(|p| p.namespace == pod.namespace && p.name == pod.name)
    else {
        return Admitting::No(format!(
            "{}/{} is not on the kubelet yet",
            pod.namespace, pod.name
        ));
    };
    let holds = p.containers.iter().any(|c| {
        c.name == a.container
            && c.devices
                .iter()
                .any(|d| d.resource_name == resource && !d.device_ids.is_empty())
    });
    if holds {
        return Admitting::No(format!(
            "{}/{} container {} has its devices already",
            pod.namespace, pod.name, a.container
        ));
    }
    Admitting::Yes
}

impl Allocate {
    /// An Allocate of `ids` on `node` that waits at most `wait` for each of the stale holders'
    /// release and a reservation to claim.
    pub fn new(ids: Vec<String>, node: &str, wait: Duration) -> Self {
        Allocate {
            ids,
            node: node.to_string(),
            wait,
            phase: Phase::Start,
        }
    }

    /// The first step, from the view as it is at `now`. `synced`: whether the view came from
    /// the ledger yet (nothing is claimed from an empty one).
    pub fn start(&mut self, view: &View, synced: bool, now: Instant) -> Step {
        match view.by_devices(&self.ids) {
            Some(done) => {
                self.phase = Phase::Repeat(done.clone());
                Step::AskOwner(done.clone())
            }
            None => self.check_holders(view, synced, now),
        }
    }

    /// PodResources said whether the container that holds the assigned allocation still has
    /// the devices (without PodResources, the shell says yes: the safe answer).
    pub fn owner(&mut self, still_holds: bool, view: &View, synced: bool, now: Instant) -> Step {
        match std::mem::replace(&mut self.phase, Phase::Done) {
            Phase::Repeat(done) if still_holds => Step::Answer(done, Answered::Repeat),
            // The kubelet gave the devices to someone else: `done` is a finished container
            // whose release the ledger has not folded yet.
            Phase::Repeat(_) => self.check_holders(view, synced, now),
            other => self.out_of_turn(other, "owner"),
        }
    }

    /// PodResources answered whether the kubelet is admitting the pod of the reservation in
    /// [`Step::Confirm`]; an error refuses the Allocate (no reservation is handed out unconfirmed).
    pub fn listed(
        &mut self,
        answer: Result<Admitting, Status>,
        view: &View,
        synced: bool,
        now: Instant,
    ) -> Step {
        let (mut claim, guess) = match std::mem::replace(&mut self.phase, Phase::Done) {
            Phase::Confirming { claim, guess } => (claim, guess),
            Phase::ConfirmingLost { mut claim, holder } => {
                return match answer {
                    // The pod being admitted holds an allocation on other devices, whose answer
                    // was lost: claim a pending reservation of that size for these devices;
                    // PreStartContainer swaps the two pods' records (identity correction).
                    Ok(Admitting::Yes) => match view.pending(self.ids.len(), &[]) {
                        Some(g) => {
                            let guess = g.id;
                            self.phase = Phase::Assigning { claim, guess };
                            Step::Assign(guess)
                        }
                        None => self.look(claim, view, synced, now),
                    },
                    Ok(Admitting::No(_)) => {
                        claim.not_lost.push(holder);
                        self.look(claim, view, synced, now)
                    }
                    Err(status) => Step::Refuse(unconfirmed(&status)),
                };
            }
            other => return self.out_of_turn(other, "listed"),
        };
        match answer {
            Ok(Admitting::Yes) => {
                self.phase = Phase::Assigning { claim, guess };
                Step::Assign(guess)
            }
            Ok(Admitting::No(_)) => {
                claim.passed.push(guess);
                self.look(claim, view, synced, now)
            }
            Err(status) => Step::Refuse(unconfirmed(&status)),
        }
    }

    /// The view changed, or the wait's `until` passed.
    pub fn view(&mut self, view: &View, synced: bool, now: Instant) -> Step {
        match std::mem::replace(&mut self.phase, Phase::Done) {
            Phase::Stale { stale, until } => {
                let held = view
                    .holding_any(&self.ids)
                    .iter()
                    .any(|x| stale.contains(&x.id));
                if synced && !held {
                    return self.begin_claim(view, synced, now);
                }
                if now < until {
                    self.phase = Phase::Stale { stale, until };
                    return Step::Wait { until, note: None };
                }
                self.stale_answer(view, &stale)
            }
            Phase::Claim(claim) => self.look(claim, view, synced, now),
            Phase::Reread { claim, seq, until } => {
                if (synced && view.seq > seq) || now >= until {
                    return self.look(claim, view, synced, now);
                }
                self.phase = Phase::Reread { claim, seq, until };
                Step::Wait { until, note: None }
            }
            other => self.out_of_turn(other, "view"),
        }
    }

    /// The allocator answered the claim: the allocation, or a refusal. `seq`: the view's seq
    /// now (a refusal waits for it to move).
    pub fn assigned(
        &mut self,
        answer: Result<Option<pb::Allocation>, Status>,
        seq: u64,
        now: Instant,
    ) -> Step {
        let (mut claim, guess) = match std::mem::replace(&mut self.phase, Phase::Done) {
            Phase::Assigning { claim, guess } => (claim, guess),
            other => return self.out_of_turn(other, "assigned"),
        };
        match answer {
            Ok(Some(a)) => Step::Answer(
                a,
                Answered::Claimed {
                    started: claim.started,
                    refusals: claim.refusals,
                },
            ),
            Ok(None) => Step::Refuse(Status::internal("Assign answered without the allocation")),
            // Assigned or released meanwhile (the view is behind), or the devices are still held
            // by an allocation not yet released: wait for the ledger and look again, a few
            // times, then let the kubelet retry the admission.
            Err(status)
                if refused_for_now(status.code())
                    && claim.refusals < MAX_REFUSALS
                    && now < claim.deadline =>
            {
                claim.refusals += 1;
                let until = now + REREAD_WAIT;
                self.phase = Phase::Reread { claim, seq, until };
                Step::Wait {
                    until,
                    note: Some(Note::Refused {
                        allocation: guess,
                        status,
                    }),
                }
            }
            Err(status) => Step::Refuse(status),
        }
    }

    /// Whether finished containers still hold any of the devices in the ledger: then wait for
    /// their release, else look for the reservation.
    fn check_holders(&mut self, view: &View, synced: bool, now: Instant) -> Step {
        let stale: Vec<u64> = view.holding_any(&self.ids).iter().map(|x| x.id).collect();
        if stale.is_empty() {
            return self.begin_claim(view, synced, now);
        }
        let until = now + self.wait;
        self.phase = Phase::Stale {
            stale: stale.clone(),
            until,
        };
        Step::Wait {
            until,
            note: Some(Note::StaleHolders(stale)),
        }
    }

    /// No release came for the stale holders. One whose release does not come within the wait
    /// is most likely not a finished container but one whose Allocate answer was lost (the
    /// agent restarted after committing the claim, or the kubelet's call timed out): the
    /// kubelet is admitting its pod again with the same devices. When that holder has exactly
    /// these devices, it is the answer, as for a repeat; PreStartContainer then checks with
    /// PodResources which pod really got them and corrects the ledger if it was another.
    fn stale_answer(&mut self, view: &View, stale: &[u64]) -> Step {
        let holders = view.holding_any(&self.ids);
        if let [only] = holders.as_slice()
            && stale.contains(&only.id)
            && let Some(held) = view.by_devices(&self.ids).filter(|x| x.id == only.id)
        {
            return Step::Answer(held.clone(), Answered::Lost);
        }
        Step::Refuse(Status::unavailable(format!(
            "devices {:?} are still held by allocation(s) {stale:?} in the ledger (their release has not arrived after {:?}); the kubelet will retry",
            self.ids, self.wait
        )))
    }

    fn begin_claim(&mut self, view: &View, synced: bool, now: Instant) -> Step {
        let claim = Claim {
            started: now,
            deadline: now + self.wait,
            refusals: 0,
            passed: Vec::new(),
            not_lost: Vec::new(),
        };
        self.look(claim, view, synced, now)
    }

    /// Look for the reservation to claim: the devices assigned meanwhile are the answer; else
    /// the oldest pending reservation of that many slices not passed over yet is the guess,
    /// once PodResources confirms that the kubelet is admitting its pod.
    fn look(&mut self, claim: Claim, view: &View, synced: bool, now: Instant) -> Step {
        if synced {
            if let Some(done) = view.by_devices(&self.ids) {
                return Step::Answer(done.clone(), Answered::Assigned);
            }
            if let Some(guess) = view.pending(self.ids.len(), &claim.passed) {
                let guess = guess.clone();
                self.phase = Phase::Confirming {
                    claim,
                    guess: guess.id,
                };
                return Step::Confirm(guess);
            }
            // Every pending reservation is another pod's: unless the pod being admitted is one
            // whose Allocate answer was lost, holding an allocation on other devices.
            if !claim.passed.is_empty()
                && let Some(holder) = view.allocs.values().find(|a| {
                    a.state == pb::AllocationState::Assigned as i32
                        && a.shares.len() == self.ids.len()
                        && !a.device_ids.is_empty()
                        && !claim.not_lost.contains(&a.id)
                })
            {
                let holder = holder.clone();
                self.phase = Phase::ConfirmingLost {
                    claim,
                    holder: holder.id,
                };
                return Step::Confirm(holder);
            }
        }
        if now >= claim.deadline {
            if claim.passed.is_empty() {
                return Step::Refuse(Status::failed_precondition(format!(
                    "no pending gpuledger reservation of {} slice(s) on node {} (waited {:?})",
                    self.ids.len(),
                    self.node,
                    self.wait
                )));
            }
            // Other pods' names stay out: the refused pod's status shows this message.
            return Step::Refuse(Status::failed_precondition(format!(
                "the pod being admitted holds no gpuledger reservation of {} slice(s) on node {}: it was not placed by the gpuledger scheduler (a pod that sets spec.nodeName itself skips it); the {} pending reservation(s) of that size here are other pods' (waited {:?})",
                self.ids.len(),
                self.node,
                claim.passed.len(),
                self.wait
            )));
        }
        let until = claim.deadline;
        self.phase = Phase::Claim(claim);
        Step::Wait { until, note: None }
    }

    /// An input the current phase does not expect: a bug in the shell.
    fn out_of_turn(&mut self, phase: Phase, input: &str) -> Step {
        let why = format!("Allocate got {input} while in {phase:?}");
        self.phase = phase;
        Step::Refuse(Status::internal(why))
    }
}

/// The refusal when PodResources cannot say which pod the kubelet is admitting.
fn unconfirmed(status: &Status) -> Status {
    Status::unavailable(format!(
        "cannot tell which pod the kubelet is admitting, so no gpuledger reservation is handed out: PodResources: {}",
        status.message()
    ))
}

/// Whether the allocator's refusal of a claim may pass once the view catches up.
fn refused_for_now(code: Code) -> bool {
    matches!(
        code,
        Code::AlreadyExists | Code::FailedPrecondition | Code::NotFound | Code::Aborted
    )
}

#[cfg(test)]
mod tests;
